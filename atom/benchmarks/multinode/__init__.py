"""Multi-node benchmark driver: ``atom bench multinode`` (and ``scripts/multinode_bench.py``).

Starts ``atom launch ... serve`` on every node of a cluster (a JSON description:
:mod:`.cluster`), waits for ``/health`` on node 0, runs ``atom bench serve`` against it from
the host side while sampling ``/metrics``, collects every rank's numbers, stops everything,
checks that nothing is left running, and writes one report folder per run (:mod:`.driver`,
:mod:`.report`)::

    atom bench multinode --cluster scripts/clusters/netns_2x1.json --method netns \\
        --serve-args "--dtype float32 --num-kv-blocks 256" \\
        --bench-args "--num-prompts 32 --random-input-len 128 --random-output-len 32"
    atom bench multinode --compare results/multinode/1x2-... results/multinode/2x1-...

Methods (:mod:`.deploy`): ``netns`` makes the nodes separate network hosts on this machine
(network namespaces on a bridge, :mod:`.netns`; root and iproute2 needed; removed afterwards,
even on failure), ``ssh`` runs one command per host (plain OpenSSH, untested here), ``print``
prints each node's exact command for SLURM or any other runner and runs nothing.
``--compare RUN_A RUN_B`` prints the B / A ratios of two runs' throughputs and latencies
(``--compare-output DIR`` adds ``compare.md`` and plots of both).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import pathlib
import shlex
import signal
import sys

logger = logging.getLogger(__name__)

METHODS = ("netns", "ssh", "print")
_REQUESTED_STOP = 128 + signal.SIGTERM  # a launcher's exit code after the driver's stop


def add_multinode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", type=pathlib.Path, help="cluster description (JSON)")
    parser.add_argument("--method", choices=METHODS, default="netns",
                        help="how the nodes are started (module docstring)")
    parser.add_argument("--output-dir", type=pathlib.Path,
                        default=pathlib.Path("results/multinode"),
                        help="the run's folder is made in here")
    parser.add_argument("--serve-args", default="",
                        help="options after `serve` on every node, one shell-quoted string")
    parser.add_argument("--bench-args", default="",
                        help="options of `atom bench serve`, one shell-quoted string")
    parser.add_argument("--launch-args", default="",
                        help="extra `atom launch` options, e.g. '--node-timeout-s 10'")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0,
                        help="how long to wait for /health on node 0")
    parser.add_argument("--stop-timeout-s", type=float, default=60.0,
                        help="how long the launchers may take to stop, per escalation")
    parser.add_argument("--sample-interval-s", type=float, default=1.0,
                        help="how often /metrics is scraped during the benchmark")
    parser.add_argument("--trace", action="store_true",
                        help="record the per-tick DP trace (--dp-trace) into the report")
    parser.add_argument("--extra-command",
                        help="a shell command run on the host side after the benchmark "
                             "({base_url} and {run_dir} filled in), e.g. a trace replay")
    parser.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), type=pathlib.Path,
                        help="print the ratios of two run folders instead of running")
    parser.add_argument("--compare-output", type=pathlib.Path,
                        help="with --compare: write compare.md and plots here")


def add_bench_multinode_parser(subparsers, formatter_class=argparse.HelpFormatter) -> None:
    """Register ``multinode`` on ``atom bench``'s subparsers."""
    parser = subparsers.add_parser("multinode", help="multi-node benchmark driver "
                                   "(scripts/multinode_bench.py)",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=formatter_class)
    add_multinode_args(parser)
    parser.set_defaults(func=run_cli)


def run(args: argparse.Namespace) -> int:
    """Run (or print, or compare) as ``args`` say; the exit code (module docstring).

    Raises:
        ValueError: a bad cluster file or option.
        RuntimeError: the deployment did not come up (the run folder has the logs).
    """
    # imports here, not at the top: every `atom` command builds this parser
    from atom.benchmarks.multinode.cluster import ClusterSpec
    from atom.benchmarks.multinode.deploy import node_commands
    from atom.benchmarks.multinode.report import compare

    if args.compare:
        print(compare(*args.compare, output_dir=args.compare_output))
        return 0
    if args.cluster is None:
        raise ValueError("--cluster FILE is needed (or --compare RUN_A RUN_B)")
    cluster = ClusterSpec.load(args.cluster)
    serve_args = tuple(shlex.split(args.serve_args))
    launch_args = tuple(shlex.split(args.launch_args))
    if args.method == "print":
        for c in node_commands(cluster, log_dir=lambda r: f"atom-logs/node{r}",
                               serve_args=serve_args, launch_args=launch_args):
            print(f"# node {c.node_rank}\n{c.shell()}")
        return 0
    return _run_deployment(cluster, args, serve_args=serve_args, launch_args=launch_args)


def _run_deployment(cluster, args: argparse.Namespace, *, serve_args: tuple[str, ...],
                    launch_args: tuple[str, ...]) -> int:
    """One run with ``netns`` or ``ssh`` (module docstring of :mod:`.driver`)."""
    from atom.benchmarks.multinode.driver import (
        benchmark,
        hosts_for,
        invocation,
        new_run_dir,
        run_summary,
        start_nodes,
        trace_args,
    )
    from atom.benchmarks.multinode.report import write_report

    run_dir = new_run_dir(args.output_dir, cluster.name)
    serve_args += trace_args(args.trace, run_dir)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"run folder: {run_dir}", flush=True)
    with hosts_for(cluster, args.method) as (cluster, hosts):
        (run_dir / "config.json").write_text(json.dumps({
            "cluster": cluster.to_json(), "method": args.method, "serve_args": serve_args,
            "bench_args": args.bench_args, "launch_args": launch_args}, indent=2))
        deployment = start_nodes(cluster, hosts, run_dir=run_dir, serve_args=serve_args,
                                 launch_args=launch_args)
        try:
            live = benchmark(deployment, args, run_dir)
        finally:
            codes = deployment.stop(args.stop_timeout_s)
            leftovers = deployment.leftovers()
    summary = run_summary(cluster, args, live, codes=codes, leftovers=leftovers,
                          started=started, command=invocation())
    print(f"report: {write_report(run_dir, summary, live['samples'])}")
    return _verdict(summary, live)


def _verdict(summary: dict, live: dict) -> int:
    bad_nodes = [n for n in summary["nodes"] if n["exit_code"] not in (0, _REQUESTED_STOP)]
    problems = ([f"left running after the stop: {summary['leftovers']}"]
                if summary["leftovers"] else [])
    problems += [f"node {n['node_rank']}'s launcher exited with {n['exit_code']}"
                 for n in bad_nodes]
    if live["bench_rc"] != 0:
        problems.append(f"atom bench serve exited with {live['bench_rc']} (see bench.log)")
    if live["extra_rc"] not in (None, 0):
        problems.append(f"--extra-command exited with {live['extra_rc']} (see extra.log)")
    for problem in problems:
        print(f"atom bench multinode: {problem}", file=sys.stderr)
    return 1 if problems else 0


def run_cli(args: argparse.Namespace) -> int:
    """:func:`run` as a command: a SIGTERM unwinds it (the namespaces go, the nodes stop), a
    deployment that does not come up is one line and exit code 1 (ValueError propagates, for
    the caller's usage error)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(_REQUESTED_STOP))
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"atom bench multinode: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """``scripts/multinode_bench.py``'s entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_multinode_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /metrics scrape
    try:
        return run_cli(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2
