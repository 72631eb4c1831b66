"""P/D disaggregation vs one colocated engine, on long prompts arriving while short ones decode.

    python scripts/bench_pd.py [--num-short 8] [--num-long 4] [--long-len 1024] ...

Two deployments, measured in the same run on the same cores:

- colocated: one ``atom serve`` whose engine core runs 2 torch threads (cores 0 and 1);
- P/D: ``atom serve --kv-role producer`` pinned to core 0 (1 thread), ``atom serve --kv-role
  consumer`` pinned to core 1 (1 thread), ``atom pd-proxy`` in front.

Workload: ``--num-short`` short prompts (random token ids, ``--short-len`` tokens, ``--short-out``
output tokens, ignore_eos) sent at t=0; then ``--num-long`` long prompts (``--long-len``
tokens, ``--long-out`` output tokens) one every ``--long-gap-s`` seconds while the short ones
decode. Every request streams; TTFT, TPOT (p50/p99) per class and the output throughput come
from the client side (:mod:`atom.benchmarks.serving`'s request timer). Prints a table,
the P/D / colocated ratios, and writes JSON (``--output-json``). The CPU flags it ran on are in
the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_description, write_json_report  # noqa: E402

from atom.benchmarks.serving import RequestResult, send_request  # noqa: E402

ATOM = str(pathlib.Path(sys.executable).parent / "atom")
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], cores: str, url: str) -> subprocess.Popen:
    proc = subprocess.Popen(["taskset", "-c", cores, *cmd], stdin=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)  # a server that is loading
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not come up")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def serve(port: int, threads: int, *extra: str) -> list[str]:
    return [ATOM, "serve", "--port", str(port), "--dtype", "float32", "--num-threads", str(threads),
            "--num-kv-blocks", "1024", "--log-level", "WARNING", *extra]


async def workload(url: str, args: argparse.Namespace) -> tuple[list[tuple[str, RequestResult]], float]:
    rng = np.random.default_rng(args.seed)

    def payload(length: int, out: int) -> dict:
        return {"model": MODEL, "prompt": rng.integers(100, 40000, length).tolist(),
                "max_tokens": out, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    endpoint = url + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        warm = await send_request(client, endpoint, payload(16, 4), {})
        if not warm.success:
            raise RuntimeError(f"warm-up failed: {warm.error}")
        start_s = time.perf_counter()
        tasks = [("short", asyncio.create_task(send_request(client, endpoint,
                                                            payload(args.short_len, args.short_out), {})))
                 for _ in range(args.num_short)]
        for _ in range(args.num_long):
            await asyncio.sleep(args.long_gap_s)
            tasks.append(("long", asyncio.create_task(send_request(
                client, endpoint, payload(args.long_len, args.long_out), {}))))
        results = [(kind, await task) for kind, task in tasks]
        return results, time.perf_counter() - start_s


def summarize(results: list[tuple[str, RequestResult]], duration_s: float) -> dict:
    failed = [r.error for _, r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    out: dict = {"duration_s": duration_s,
                 "output_throughput": sum(r.output_tokens for _, r in results) / duration_s}
    for kind in ("short", "long", "all"):
        rs = [r for k, r in results if kind in ("all", k)]
        for name, values in (("ttft", [r.ttft_s for r in rs]),
                             ("tpot", [r.tpot_s for r in rs if r.tpot_s is not None])):
            ms = np.array(values) * 1000.0
            out[f"{kind}_{name}_p50_ms"] = float(np.percentile(ms, 50))
            out[f"{kind}_{name}_p99_ms"] = float(np.percentile(ms, 99))
    return out


def run_colocated(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start(serve(port, 2), "0,1", url)]
    try:
        return summarize(*asyncio.run(workload(url, args)))
    finally:
        stop(procs)


def run_pd(args) -> dict:
    p_port, c_port, x_port = free_port(), free_port(), free_port()
    p_url, c_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{c_port}"
    procs = [start(serve(p_port, 1, "--kv-role", "producer"), "0", p_url)]
    try:
        procs.append(start(serve(c_port, 1, "--kv-role", "consumer"), "1", c_url))
        x_url = f"http://127.0.0.1:{x_port}"
        procs.append(start([ATOM, "pd-proxy", "--prefill", p_url, "--decode", c_url, "--port",
                            str(x_port), "--log-level", "WARNING"], "0,1", x_url))
        summary = summarize(*asyncio.run(workload(x_url, args)))
        metrics = httpx.get(c_url + "/metrics", timeout=30).text
        for line in metrics.splitlines():
            for name in ("atom:kv_transfer_bytes_total", "atom:kv_transfer_seconds_total",
                         "atom:kv_transfers_total"):
                if line.startswith(name + "{"):
                    summary[name.removeprefix("atom:")] = float(line.rsplit(" ", 1)[1])
        return summary
    finally:
        stop(procs[::-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--short-out", type=int, default=96)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-out", type=int, default=16)
    parser.add_argument("--long-gap-s", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=pathlib.Path, default=pathlib.Path("results/bench_pd.json"))
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_pd needs 2 cores (taskset -c 0 / -c 1)")
    colocated = run_colocated(args)
    pd = run_pd(args)
    keys = [k for k in colocated if k != "duration_s"]
    print(f"{'metric':<26}{'colocated':>12}{'P/D':>12}{'P/D / colo':>12}")
    for k in keys:
        print(f"{k:<26}{colocated[k]:>12.1f}{pd[k]:>12.1f}{pd[k] / colocated[k]:>12.2f}")
    write_json_report(args.output_json, {"args": vars(args) | {"output_json": str(args.output_json)},
                                         "cpu": cpu_description(), "colocated": colocated, "pd": pd,
                                         "ratios_pd_over_colocated": {k: pd[k] / colocated[k]
                                                                      for k in keys}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
