"""DP experiment: the cross-rank prefill policies and the decode-protection interval on a bursty
workload with one KV-pressured rank.

Workload (token-id prompts, seeded, identical for every configuration):

- *pressure*: ``--pressure-prompts`` long prompts pinned to rank 0 at t=0; with a small KV pool
  (``--num-kv-blocks`` per rank) rank 0 cannot admit them all, so it keeps prefill work it
  cannot start while the other ranks are free;
- *bursts*: ``--num-bursts`` bursts of ``--burst-size`` short prompts, ``--burst-interval-s``
  apart, routed by the DP router (``least_requests``).

Configurations: every ``--prefill-policy`` (none, delayer, coalescer) × every
``--prefill-decode-interval`` (0 = off); with ``--moe-split-experts E`` the model is the
checkable model (a) of docs/ARCHITECTURE.md (the embedded model's MLPs split into E experts, sharded over the ranks: every MoE
layer exchanges tokens between the ranks), and each configuration runs with two-batch overlap
off and on. Each runs the same workload on ``--dp-size`` real EngineCore processes. Measured
(the step counters come from the batch-shape exchange, so every rank counts the same):

- mixed-step fraction: forward steps where some rank prefills and another does not, over all
  forward steps (in an expert-parallel model the decode-only ranks wait for the prefill);
- prefill-step fraction: forward steps where some rank prefills (the rest are decode-only on
  every rank: what the decode-protection interval protects);
- dummy-step fraction: (rank, step) pairs that ran a dummy batch, over steps × ranks;
- hold rate: the policy's holds over the ticks where some rank could admit a prefill, and the
  longest run of consecutive holds;
- output tokens/s from the first arrival to the last finish; TTFT and TPOT (mean, p50, p90).

By default arrivals are in wall-clock seconds, so step counts move a little between runs (the
ticks at which a burst lands depend on the machine's speed); the step counters themselves are
exact. ``--clock tick`` replays the workload tick-clocked (bursts ``--burst-interval-ticks``
apart, every request sent before the first tick: :mod:`atom.dp.sim.replay`): the per-rank
batch shapes are then identical on every run, and equal to the simulator's
(``atom sim run --workload dp_experiment --clock tick``). The workload is
:func:`atom.dp.sim.workload.dp_experiment`.
Every configuration writes its per-tick trace (``--trace-dir``/<configuration>/), its
Perfetto JSON and its PNG timeline (``scripts/dp_trace.py``). Prints a table and writes JSON
(``--output-json``). Wall-clock numbers move with machine load; compare configurations of the
same run, and step counts across runs.

    python scripts/dp_experiment.py --output-json results/dp_experiment.json
    python scripts/dp_experiment.py --moe-split-experts 4 --prefill-policy none delayer \
        --prefill-decode-interval 0 --output-json results/dp_experiment_moe.json
    python scripts/dp_experiment.py --clock tick --output-json results/dp_experiment_tick.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

import dp_trace  # scripts/dp_trace.py, beside this script
from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace, to_perfetto
from atom.dp.sim import workload
from atom.dp.sim.metrics import format_table
from atom.dp.sim.replay import run_real


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-kv-blocks", type=int, default=32, help="per rank, 16 tokens each")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--prefill-policy", nargs="+", default=["none", "delayer", "coalescer"],
                   choices=["none", "delayer", "coalescer"], help="the policies to sweep")
    p.add_argument("--prefill-decode-interval", type=int, nargs="+", default=[0, 2],
                   help="the decode-protection intervals to sweep (ticks; 0 = off)")
    p.add_argument("--max-delay-passes", type=int, default=30, help="the delayer's bound")
    p.add_argument("--pressure-prompts", type=int, default=3)
    p.add_argument("--pressure-prompt-len", type=int, default=160)
    p.add_argument("--pressure-max-tokens", type=int, default=48)
    p.add_argument("--num-bursts", type=int, default=6)
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-interval-s", type=float, default=1.0,
                   help="time-clocked arrivals: seconds between bursts")
    p.add_argument("--clock", choices=["time", "tick"], default="time",
                   help="tick: replay tick-clocked (bursts --burst-interval-ticks ticks apart; "
                        "the per-rank batch shapes are then the same on every run)")
    p.add_argument("--burst-interval-ticks", type=int, default=8,
                   help="tick-clocked arrivals: ticks between bursts")
    p.add_argument("--short-prompt-len", type=int, nargs=2, default=(24, 64))
    p.add_argument("--short-max-tokens", type=int, nargs=2, default=(8, 24))
    p.add_argument("--moe-split-experts", type=int, default=0,
                   help="E > 0: the embedded model with every MLP split into E experts (model "
                        "(a) of docs/ARCHITECTURE.md), experts sharded over the ranks (expert parallelism), and "
                        "every configuration run with TBO off and on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", default="results/dp_trace",
                   help="each configuration's trace, Perfetto JSON and PNG go in a folder here")
    p.add_argument("--output-json", default="results/dp_experiment.json")
    return p.parse_args(argv)


def configurations(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(name, EngineConfig options) of every configuration to run, in order."""
    base = dict(data_parallel_size=args.dp_size, dtype=args.dtype,
                num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                max_model_len=1024, enable_prefix_caching=False,
                prefill_delayer_max_delay_passes=args.max_delay_passes)
    policies = [(f"{policy}, interval {n}", dict(prefill_policy=policy, prefill_decode_interval=n))
                for policy in args.prefill_policy for n in args.prefill_decode_interval]
    if not args.moe_split_experts:
        return [(name, {**base, **options}) for name, options in policies]
    # model (a) with its experts over the ranks; TBO off and on
    base.update(moe_split_experts=args.moe_split_experts, enable_expert_parallel=True)
    return [(f"{name}, TBO {'on' if tbo else 'off'}", {**base, **options, "enable_tbo": tbo})
            for name, options in policies for tbo in (False, True)]


def write_trace_views(folder: pathlib.Path, name: str) -> None:
    """The configuration's Perfetto JSON and PNG timeline, beside its trace rows."""
    traces = read_trace(folder)
    (folder / "perfetto.json").write_text(json.dumps(to_perfetto(traces)))
    dp_trace.plot(traces, folder / "timeline.png", title=name)


def make_workload(args: argparse.Namespace) -> list[workload.TraceRequest]:
    """The experiment's workload (:func:`atom.dp.sim.workload.dp_experiment`) on the chosen
    clock."""
    return workload.dp_experiment(
        clock=args.clock, burst_interval=(args.burst_interval_s if args.clock == "time"
                                          else args.burst_interval_ticks),
        pressure_prompts=args.pressure_prompts, pressure_prompt_len=args.pressure_prompt_len,
        pressure_max_tokens=args.pressure_max_tokens, num_bursts=args.num_bursts,
        burst_size=args.burst_size, short_prompt_len=tuple(args.short_prompt_len),
        short_max_tokens=tuple(args.short_max_tokens), seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = make_workload(args)
    results = []
    for name, options in configurations(args):
        folder = pathlib.Path(args.trace_dir) / re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        config = EngineConfig.from_kwargs(**options, dp_trace=str(folder))
        print(f"running: {name} ...", file=sys.stderr, flush=True)
        results.append(run_real(requests, config, name=name))
        write_trace_views(folder, name)
        results[-1]["trace"] = str(folder)
    print(format_table(results))
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
