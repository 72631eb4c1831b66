"""The run: start the nodes, wait for health, benchmark, collect, stop, check, report.

One run writes one folder, ``OUTPUT_DIR/<cluster name>-<UTC time>/``:

====================  ==============================================================
``config.json``       the cluster (addresses as used) and the driver's options
``commands.sh``       every node's exact launcher command
``nodes/node<R>/``    ``launcher.log`` (the launcher's console: its lines and every rank's
                      stderr with a ``[rankN]`` prefix) and the launcher's ``--log-dir``
                      (``rank<N>.stderr.log``; with ``ssh`` those stay on the node)
``bench.json``        ``atom bench serve``'s JSON (summary and every request); ``bench.log``
``metrics.txt``       node 0's ``/metrics`` after the benchmark (every rank's series)
``rank_stats.json``   the same per rank; ``metrics_samples.jsonl``: scrapes during it
``trace/``            the per-tick DP trace (``--trace``, where the engine has ``--dp-trace``)
``extra.log``         ``--extra-command``'s output, when given
``summary.json``,     what ``--compare`` reads; the report with its tables and
``report.md``, PNGs   ``throughput.png``, ``latency.png``, ``rank_load.png``
====================  ==============================================================

The run fails (exit code 1, no report) when the deployment does not come up; the folder then
holds the nodes' logs. It also fails when something is left running on a node after the stop
(listed in the summary), or when a benchmark request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import shlex
import subprocess
import sys

from atom.benchmarks.multinode.cluster import ClusterSpec
from atom.benchmarks.multinode.deploy import (
    Deployment,
    LocalNode,
    SshNode,
    driver_env,
    node_commands,
)
from atom.benchmarks.multinode.netns import NODE_IFNAME, NetnsHosts
from atom.benchmarks.multinode.rank_stats import MetricsSampler, group_series, per_rank, scrape

logger = logging.getLogger(__name__)

_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """This machine's CPU model, core count and the flags that decide the dtype."""
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    shown = ", ".join(f for f in _CPU_FLAGS if f in flags) or "none of " + "/".join(_CPU_FLAGS)
    return f"{model}, {os.cpu_count()} cores ({shown})"


@contextlib.contextmanager
def hosts_for(cluster: ClusterSpec, method: str):
    """``(cluster with addresses, NetnsHosts or None)`` for the run; netns hosts are created
    here and removed on the way out (raising if any is left)."""
    if method != "netns":
        _ = cluster.master_addr  # raises ValueError when the addresses are missing
        yield cluster, None
        return
    given = [n.address for n in cluster.nodes] if cluster.subnet() is not None else None
    with NetnsHosts(cluster.nnodes, addresses=given) as hosts:
        if cluster.gloo_socket_ifname is None:  # the driver knows the interface
            cluster = dataclasses.replace(cluster, gloo_socket_ifname=NODE_IFNAME)
        yield cluster.with_addresses(hosts.addresses), hosts


def netns_env(cluster: ClusterSpec, serve_args: tuple[str, ...]) -> dict[str, str]:
    """netns nodes share this machine's cores: ``OMP_NUM_THREADS`` = cores ÷ all ranks,
    unless the cluster or ``--num-threads`` says otherwise."""
    if "OMP_NUM_THREADS" in cluster.env or "--num-threads" in serve_args:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cluster.world_size))}


def start_nodes(cluster: ClusterSpec, hosts: NetnsHosts | None, *, run_dir: pathlib.Path,
                serve_args: tuple[str, ...], launch_args: tuple[str, ...]) -> Deployment:
    """Start every node's launcher (netns or ssh); writes ``commands.sh``.

    Raises:
        OSError: a launcher could not be started (those already started are stopped).
    """
    def log_dir(rank: int) -> str:
        if hosts is None:  # ssh: a folder on the node itself
            return f"/tmp/atom-multinode/{run_dir.name}/node{rank}"
        return str(run_dir / "nodes" / f"node{rank}")

    env = netns_env(cluster, serve_args) if hosts is not None else {}
    commands = node_commands(cluster, log_dir=log_dir, serve_args=serve_args,
                             launch_args=launch_args, env=env)
    (run_dir / "commands.sh").write_text("".join(f"# node {c.node_rank}\n{c.shell()}\n"
                                                 for c in commands))
    nodes: list[LocalNode] = []
    base_url = f"http://{cluster.master_addr}:{cluster.http_port}"
    try:
        for c, spec in zip(commands, cluster.nodes):
            folder = run_dir / "nodes" / f"node{c.node_rank}"
            folder.mkdir(parents=True, exist_ok=True)
            log = str(folder / "launcher.log")
            if hosts is None:
                nodes.append(SshNode(c, log_path=log, destination=spec.ssh or spec.address,
                                     workdir=cluster.workdir))
            else:
                i = c.node_rank
                nodes.append(LocalNode(c, log_path=log,
                                       wrap=lambda argv, i=i: hosts.exec_argv(i, argv),
                                       leftovers=lambda i=i: hosts.pids(i)))
    except OSError:
        Deployment(nodes, base_url=base_url).stop(timeout_s=10.0)
        raise
    return Deployment(nodes, base_url=base_url)


def run_bench(base_url: str, bench_args: tuple[str, ...], run_dir: pathlib.Path) -> int:
    """``atom bench serve`` against ``base_url`` from this (the host) side; its output goes to
    ``bench.log`` and the console, its JSON to ``bench.json``. Returns its exit code."""
    argv = [sys.executable, "-m", "atom.entrypoints.cli", "bench", "serve", "--base-url",
            base_url, "--output-json", str(run_dir / "bench.json"), "--disable-tqdm",
            *bench_args]
    proc = subprocess.run(argv, capture_output=True, text=True, env=driver_env({}),
                          stdin=subprocess.DEVNULL)
    (run_dir / "bench.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def run_extra(command: str, *, base_url: str, run_dir: pathlib.Path) -> int:
    """``--extra-command`` (``{base_url}`` and ``{run_dir}`` filled in) through the shell,
    output to ``extra.log``; its exit code."""
    line = command.format(base_url=base_url, run_dir=run_dir)
    with open(run_dir / "extra.log", "w") as log:
        return subprocess.run(line, shell=True, stdout=log, stderr=subprocess.STDOUT,
                              env=driver_env({}), stdin=subprocess.DEVNULL).returncode


def trace_args(enabled: bool, run_dir: pathlib.Path) -> tuple[str, ...]:
    """``--dp-trace RUN_DIR/trace`` when asked. Raises ValueError if the engine has no
    ``dp_trace`` option (it comes with the per-tick trace work, issue 14)."""
    if not enabled:
        return ()
    from atom.config import EngineConfig

    if "dp_trace" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise ValueError("--trace: this atom has no --dp-trace option yet (the per-tick DP "
                         "trace); run without --trace")
    return ("--dp-trace", str(run_dir / "trace"))


def new_run_dir(output_dir: pathlib.Path, name: str) -> pathlib.Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_dir = output_dir / f"{name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def benchmark(deployment: Deployment, args: argparse.Namespace, run_dir: pathlib.Path) -> dict:
    """Wait for health, run the benchmark while sampling ``/metrics``, read the final
    ``/metrics``; what the summary needs from the live deployment.

    Raises:
        RuntimeError: the deployment did not become healthy.
    """
    deployment.wait_healthy(args.startup_timeout_s)
    sampler = MetricsSampler(deployment.base_url, interval_s=args.sample_interval_s)
    sampler.start()
    try:
        bench_rc = run_bench(deployment.base_url, tuple(shlex.split(args.bench_args)), run_dir)
    finally:
        samples = sampler.stop()
    sampler.write_jsonl(run_dir / "metrics_samples.jsonl")
    bench_json = run_dir / "bench.json"
    bench = json.loads(bench_json.read_text())["summary"] if bench_json.is_file() else {}
    text = scrape(deployment.base_url)
    (run_dir / "metrics.txt").write_text(text)
    ranks = {str(r): s for r, s in per_rank(text).items()}
    (run_dir / "rank_stats.json").write_text(json.dumps(ranks, indent=2))
    extra_rc = (run_extra(args.extra_command, base_url=deployment.base_url, run_dir=run_dir)
                if args.extra_command else None)
    return {"bench_rc": bench_rc, "bench": bench, "extra_rc": extra_rc, "ranks": ranks,
            "group": group_series(text), "samples": samples,
            "num_failed_samples": sampler.num_failed}


def invocation() -> str:
    """This run's command line, as ``atom bench multinode OPTIONS``."""
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "multinode"]:  # `atom bench multinode`, not the script
        argv = argv[2:]
    return shlex.join(["atom", "bench", "multinode", *argv])


def run_summary(cluster: ClusterSpec, args: argparse.Namespace, live: dict, *,
                codes: dict[int, int], leftovers: dict, started: str, command: str) -> dict:
    """What ``summary.json`` holds (:mod:`atom.benchmarks.multinode.report`): the run's
    shape, the command, every node's launcher exit code, the benchmark summary, each rank's
    final ``/metrics`` series (``live``: :func:`benchmark`'s result) and what was left."""
    return {"name": cluster.name, "nnodes": cluster.nnodes,
            "nproc_per_node": cluster.nproc_per_node, "method": args.method,
            "started": started, "cpu": cpu_description(),
            "command": command,
            "workload": f"`{args.bench_args or '(bench serve defaults)'}`; serve options "
                        f"`{args.serve_args or '(defaults)'}`",
            "nodes": [{"node_rank": r, "address": n.address, "exit_code": codes.get(r)}
                      for r, n in enumerate(cluster.nodes)],
            "bench": live["bench"], "ranks": live["ranks"], "group": live.get("group", {}),
            "leftovers": {str(k): v for k, v in leftovers.items()},
            "num_failed_samples": live["num_failed_samples"]}
