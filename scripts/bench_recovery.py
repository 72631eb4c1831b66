"""Recovery from a rank failure on ``atom serve --data-parallel-size 2`` (issue 19): how long
streams stall, how long the new group takes, how many requests were resumed, and whether the
resumed texts equal an undisturbed run's.

Per policy (``--policies``, of ``--on-rank-failure``) and fault (``--faults``: ``kill`` =
SIGKILL, a dead rank; ``stop`` = SIGSTOP, a hung rank, found after ``--hang-timeout-s``), on a
fresh server each: run ``--num-requests`` greedy prompts once undisturbed (the reference),
then stream them all at once and, when every stream has its first token, send the fault to
DP rank 1's engine core. Measured:

- outage: from the fault to the end of the longest pause in the token flow of all streams
  together (what clients see; tokens already computed may still arrive just after the fault,
  so the first token after it is not the end of the outage);
- recovery: the server's ``atom:rank_recovery_last_seconds`` (from the failure's detection
  to the new group's ready messages: process start, weights, rendezvous);
- detection + resume: outage - recovery (for ``stop`` about the hang timeout);
- worst stall: the longest any stream waited for its next token after the fault;
- requests resumed (``atom:resumed_requests``), streams whose text equals the reference,
  streams that ended with an error.

Prints a table with the CPU and the load average (other jobs on the machine move the numbers)
and writes JSON (``--output-json``)::

    .venv/bin/python scripts/bench_recovery.py --output-json results/bench_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import threading
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench_sessions import cpu_description, report, start_server, stop_server

_MODEL = "SmolLM2-135M-Instruct"
_FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_STREAM_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["replace", "shrink"],
                   choices=["replace", "shrink"])
    p.add_argument("--faults", nargs="+", default=["kill", "stop"], choices=list(_FAULTS))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hang-timeout-s", type=float, default=10.0,
                   help="--engine-hang-timeout-s of the servers (the default, 60, also works)")
    p.add_argument("--server-args", default="--dtype float32 --num-kv-blocks 128 "
                                            "--max-model-len 512 --num-threads 1",
                   help="engine options of every server (one string)")
    p.add_argument("--output-json", type=pathlib.Path,
                   default=pathlib.Path("results/bench_recovery.json"))
    return p.parse_args(argv)


def _body(prompt, args: argparse.Namespace) -> dict:
    return {"model": _MODEL, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True}


class _Stream(threading.Thread):
    """One streaming completion: its text, error and the arrival time of every token chunk."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.text, self.error, self.times_s = "", None, []
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json={**self.body,
                              "stream": True}, timeout=_STREAM_TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    self.error = event.get("error", self.error)
                    for choice in event.get("choices", []):
                        if choice.get("text"):
                            self.text += choice["text"]
                            self.times_s.append(time.monotonic())
                            self.started.set()
        finally:
            self.started.set()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30.0).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def _rank1_core(proc) -> psutil.Process:
    for p in psutil.Process(proc.pid).children(recursive=True):
        if "core_proc" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1":
            return p
    raise RuntimeError("no engine core of dp rank 1")


def _longest_pause_end(times_s: list[float], fault_s: float) -> float:
    """When tokens flowed again after the longest pause (from the fault on) in ``times_s``,
    the arrival times of every stream's tokens (NaN: none came after the fault)."""
    after = sorted(t for t in times_s if t > fault_s)
    if not after:
        return float("nan")
    points = [fault_s, *after]
    return max(zip(points, points[1:]), key=lambda gap: gap[1] - gap[0])[1]


def run_scenario(policy: str, fault: str, args: argparse.Namespace) -> dict:
    server_args = (f"{args.server_args} --on-rank-failure {policy} "
                   f"--engine-hang-timeout-s {args.hang_timeout_s}")
    proc, url = start_server("least_requests", server_args)
    try:
        prompts = [f"Write a short story about the number {i}." for i in range(args.num_requests)]
        r = httpx.post(url + "/v1/completions", json=_body(prompts, args), timeout=600.0)
        reference = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        streams = [_Stream(url, _body(p, args)) for p in prompts]
        for s in streams:
            s.start()
        for s in streams:
            s.started.wait(_STREAM_TIMEOUT_S)
        os.kill(_rank1_core(proc).pid, _FAULTS[fault])
        fault_s = time.monotonic()
        for s in streams:
            s.join(_STREAM_TIMEOUT_S)
        outage_s = _longest_pause_end([t for s in streams for t in s.times_s], fault_s) - fault_s
        stalls = [b - a for s in streams for a, b in zip(s.times_s, s.times_s[1:]) if b > fault_s]
        recovery_s = _metric(url, "atom:rank_recovery_last_seconds")
        return {"outage_s": outage_s, "recovery_s": recovery_s,
                "detect_and_resume_s": outage_s - recovery_s,
                "worst_stall_s": max(stalls, default=float("nan")),
                "resumed": _metric(url, "atom:resumed_requests_total"),
                "equal_texts": sum(s.text == ref for s, ref in zip(streams, reference)),
                "errors": sum(s.error is not None for s in streams),
                "num_requests": len(streams), "dp_size_after": _metric(url, "atom:dp_size")}
    finally:
        stop_server(proc)


def format_table(results: dict[str, dict]) -> str:
    rows = [("policy/fault", "outage s", "recovery s", "detect+resume s", "worst stall s",
             "resumed", "equal texts", "errors", "dp after")]
    for name, r in results.items():
        rows.append((name, f"{r['outage_s']:.1f}", f"{r['recovery_s']:.1f}",
                     f"{r['detect_and_resume_s']:.1f}", f"{r['worst_stall_s']:.1f}",
                     f"{r['resumed']:.0f}", f"{r['equal_texts']}/{r['num_requests']}",
                     str(r["errors"]), f"{r['dp_size_after']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(cpu_description())
    results, load = {}, {}
    for policy in args.policies:
        for fault in args.faults:
            name = f"{policy}/{fault}"
            load_before = os.getloadavg()[0]
            results[name] = run_scenario(policy, fault, args)
            load[name] = {"before": load_before, "after": os.getloadavg()[0]}
            print(f"{name}: load average {load_before:.1f} -> {load[name]['after']:.1f}",
                  flush=True)
    report(args, table=format_table(results), load=load, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
