"""Multi-turn sessions through ``atom serve --data-parallel-size 2``, one server per DP routing
policy (issue 13): prefix-cache hit rate, TTFT and throughput.

Workload (seeded; the same for every policy): ``--num-sessions`` chat sessions run at once, each
``--num-turns`` turns one after the other (a user waits for the reply). Turn k's messages: a
shared system prompt (~``--system-tokens``), the session's history (its earlier user messages
and the replies, as text, the way a chat client resends them) and a new user message
(~``--user-tokens``); the reply is ``--output-tokens`` long (``ignore_eos``), so each turn adds
about user + output tokens. Every request carries ``X-Session-ID`` and streams
``/v1/chat/completions`` with ``include_usage``.

Per policy (``--policies``): start ``atom serve --data-parallel-size 2 --dp-load-balance P``
with ``--server-args``, warm up with one unmeasured request, run the sessions, read
``/metrics``, stop the server. Measured:

- prefix-cache hit rate: ``usage.prompt_tokens_details.cached_tokens`` / prompt tokens, over
  turns 2..T (what routing decides) and over all turns;
- TTFT (time to the first content chunk): mean / p50 / p90 over turns 2..T;
- throughput: output and total (prompt + output) tokens/s over the run's wall time;
- requests per rank and router decisions per reason (``atom:dp_router_decisions``).

Prints a table with ratios against the first policy of the same run, the CPU, and the load
average before and after each policy (other jobs on the machine move the absolute numbers);
writes JSON (``--output-json``).

    .venv/bin/python scripts/bench_sessions.py --output-json results/bench_sessions.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from atom.benchmarks.serving import RequestResult, send_request
from bench_common import cpu_description, write_json_report

ATOM = str(pathlib.Path(sys.executable).parent / "atom")
_STARTUP_TIMEOUT_S = 600.0
_WORDS = ("river stone lamp garden window quiet morning silver paper orange engine market "
          "winter letter island candle forest bridge signal harbor meadow violin pocket "
          "thunder ladder cotton planet mirror feather basket rocket valley marble").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["round_robin", "least_requests", "cache_aware"])
    p.add_argument("--num-sessions", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=64)
    p.add_argument("--user-tokens", type=int, default=184)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--server-args", default="--dtype float32 --num-kv-blocks 320 --num-threads 1",
                   help="engine options of every server (one string)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", type=pathlib.Path,
                   default=pathlib.Path("results/bench_sessions.json"))
    return p.parse_args(argv)


# ----- workload -----

def text_of(rng: random.Random, tokenizer, num_tokens: int) -> str:
    """Random words, about ``num_tokens`` tokens of ``tokenizer``."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < num_tokens:
        words += rng.sample(_WORDS, 8)
    return " ".join(words)


def make_sessions(args: argparse.Namespace, tokenizer) -> tuple[str, list[list[str]]]:
    """The system prompt and, per session, its user messages (one per turn)."""
    rng = random.Random(args.seed)
    system = text_of(rng, tokenizer, args.system_tokens)
    users = [[text_of(rng, tokenizer, args.user_tokens) for _ in range(args.num_turns)]
             for _ in range(args.num_sessions)]
    return system, users


async def run_session(client: httpx.AsyncClient, url: str, index: int, system: str,
                      users: list[str], args: argparse.Namespace) -> list[RequestResult]:
    messages = [{"role": "system", "content": system}]
    results = []
    for user in users:
        messages.append({"role": "user", "content": user})
        payload = {"model": "SmolLM2-135M-Instruct", "messages": messages, "stream": True,
                   "max_tokens": args.output_tokens, "temperature": 0.0, "ignore_eos": True,
                   "stream_options": {"include_usage": True}}
        result = await send_request(client, url + "/v1/chat/completions", payload,
                                    {"X-Session-ID": f"session-{index}"})
        if not result.success:
            raise RuntimeError(f"session {index}: {result.error}")
        results.append(result)
        messages.append({"role": "assistant", "content": result.text})
    return results


async def warm_up(url: str) -> None:
    """One unmeasured request (the first forward of each rank is slower)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        payload = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "stream": True,
                   "messages": [{"role": "user", "content": "warm up"}]}
        await send_request(client, url + "/v1/chat/completions", payload, {})


async def run_workload(url: str, system: str, users: list[list[str]],
                       args: argparse.Namespace) -> tuple[list[list[RequestResult]], float]:
    """Every session at once; returns results per session and turn, and the wall time (s)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        sessions = await asyncio.gather(*(run_session(client, url, i, system, u, args)
                                          for i, u in enumerate(users)))
        return list(sessions), time.perf_counter() - start


# ----- the server -----

def start_server(policy: str, server_args: str) -> tuple[subprocess.Popen, str]:
    """``atom serve`` on a free loopback port; returns it once ``/health`` is 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [ATOM, "serve", "--port", str(port), "--data-parallel-size", "2",
           "--dp-load-balance", policy, *shlex.split(server_args)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{shlex.join(cmd)} exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)  # the server is loading
    proc.kill()
    raise RuntimeError(f"{shlex.join(cmd)} was not healthy within {_STARTUP_TIMEOUT_S:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def router_decisions(url: str) -> dict[str, dict[str, float]]:
    """``{dp_rank: {reason: requests}}`` from ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30.0).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "atom:dp_router_decisions_total":
                out.setdefault(s.labels["dp_rank"], {})[s.labels["reason"]] = s.value
    return out


# ----- results -----

def summarize(sessions: list[list[RequestResult]], wall_s: float,
              decisions: dict[str, dict[str, float]]) -> dict:
    later = [r for turns in sessions for r in turns[1:]]
    every = [r for turns in sessions for r in turns]
    ttft_ms = np.array([r.ttft_s for r in later]) * 1000.0
    output = sum(r.output_tokens for r in every)
    prompt = sum(r.prompt_tokens for r in every)
    return {
        "hit_rate_turns_2_on": sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later),
        "hit_rate_all": sum(r.cached_tokens for r in every) / prompt,
        "ttft_ms_turns_2_on": {"mean": float(ttft_ms.mean()), "p50": float(np.percentile(ttft_ms, 50)),
                               "p90": float(np.percentile(ttft_ms, 90))},
        "output_tok_s": output / wall_s, "total_tok_s": (prompt + output) / wall_s,
        "wall_s": wall_s, "num_requests": len(every), "prompt_tokens": prompt,
        "requests_per_rank": {rank: sum(d.values()) for rank, d in sorted(decisions.items())},
        "decisions": decisions,
    }


def format_table(results: dict[str, dict]) -> str:
    base = next(iter(results.values()))
    rows = [("policy", "hit rate t2+", "hit rate all", "TTFT t2+ mean/p50/p90 ms", "out tok/s",
             "total tok/s", "req per rank", "hit ratio", "TTFT ratio", "total tok/s ratio")]
    for policy, r in results.items():
        t = r["ttft_ms_turns_2_on"]
        rows.append((policy, f"{r['hit_rate_turns_2_on']:.3f}", f"{r['hit_rate_all']:.3f}",
                     f"{t['mean']:.0f} / {t['p50']:.0f} / {t['p90']:.0f}",
                     f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
                     "/".join(f"{v:.0f}" for v in r["requests_per_rank"].values()),
                     f"{r['hit_rate_turns_2_on'] / base['hit_rate_turns_2_on']:.2f}x",
                     f"{t['mean'] / base['ttft_ms_turns_2_on']['mean']:.2f}x",
                     f"{r['total_tok_s'] / base['total_tok_s']:.2f}x"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def report(args, *, table: str, load: dict, results: dict) -> None:
    """Print ``table``; write the args, the CPU, the load averages and the results as JSON to
    ``args.output_json``."""
    print(table)
    write_json_report(args.output_json, {"args": {k: str(v) for k, v in vars(args).items()},
                                         "cpu": cpu_description(), "load_average": load,
                                         "results": results})


def main(argv: list[str] | None = None) -> int:
    from atom.worker.model_files import load_tokenizer

    args = parse_args(argv)
    system, users = make_sessions(args, load_tokenizer(None))
    print(cpu_description())
    results, load = {}, {}
    for policy in args.policies:
        load_before = os.getloadavg()[0]
        proc, url = start_server(policy, args.server_args)
        try:
            asyncio.run(warm_up(url))
            before = router_decisions(url)
            sessions, wall_s = asyncio.run(run_workload(url, system, users, args))
            decisions = {rank: {reason: n - before.get(rank, {}).get(reason, 0)
                                for reason, n in counts.items()}
                         for rank, counts in router_decisions(url).items()}
        finally:
            stop_server(proc)
        results[policy] = summarize(sessions, wall_s, decisions)
        load[policy] = {"before": load_before, "after": os.getloadavg()[0]}
        print(f"{policy}: {wall_s:.1f} s, load average {load_before:.1f} -> "
              f"{load[policy]['after']:.1f}", flush=True)
    report(args, table=format_table(results), load=load, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
