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

Arrivals are in wall-clock seconds, so step counts move a little between runs (the ticks at
which a burst lands depend on the machine's speed); the step counters themselves are exact.
Every configuration writes its per-tick trace (``--trace-dir``/<configuration>/), its
Perfetto JSON and its PNG timeline (``scripts/dp_trace.py``). Prints a table and writes JSON
(``--output-json``). Wall-clock numbers move with machine load; compare configurations of the
same run, and step counts across runs.

    python scripts/dp_experiment.py --output-json results/dp_experiment.json
    python scripts/dp_experiment.py --moe-split-experts 4 --prefill-policy none delayer \
        --prefill-decode-interval 0 --output-json results/dp_experiment_moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import re
import statistics
import sys
import time

import dp_trace  # scripts/dp_trace.py, beside this script
from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace, to_perfetto
from atom.entrypoints.llm import build_engine
from atom.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the start
    prompt_token_ids: list[int]
    max_tokens: int
    dp_rank: int | None  # None: the router decides


def make_workload(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(length)]

    arrivals = [Arrival(0.0, prompt(args.pressure_prompt_len), args.pressure_max_tokens, 0)
                for _ in range(args.pressure_prompts)]
    for burst in range(args.num_bursts):
        for _ in range(args.burst_size):
            arrivals.append(Arrival(burst * args.burst_interval_s,
                                    prompt(rng.randint(*args.short_prompt_len)),
                                    rng.randint(*args.short_max_tokens), None))
    return arrivals


def _summary(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "p50": values[len(values) // 2],
            "p90": values[min(len(values) - 1, int(0.9 * len(values)))]}


def run_config(name: str, config: EngineConfig, workload: list[Arrival]) -> dict:
    """Run ``workload`` on a fresh engine built from ``config``; returns the measurements."""
    engine = build_engine(config)
    try:
        pending = sorted(enumerate(workload), key=lambda item: item[1].at_s)
        finished = {}
        start = time.monotonic()
        while pending or engine.has_unfinished_requests():
            now = time.monotonic() - start
            while pending and pending[0][1].at_s <= now:
                i, arrival = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens,
                                        ignore_eos=True)
                engine.add_request(str(i), arrival.prompt_token_ids, params,
                                   data_parallel_rank=arrival.dp_rank)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if pending and not engine.has_unfinished_requests():
                time.sleep(max(0.0, min(0.05, pending[0][1].at_s - (time.monotonic() - start))))
        elapsed_s = time.monotonic() - start
        errors = [o.outputs[0].error for o in finished.values()
                  if o.outputs[0].finish_reason not in ("length", "stop")]
        if errors:
            raise RuntimeError(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
        ranks = _idle_rank_stats(engine)
    finally:
        engine.shutdown()
    return _measurements(name, config, finished, ranks, elapsed_s)


def _measurements(name: str, config: EngineConfig, finished: dict, ranks: list[dict],
                  elapsed_s: float) -> dict:
    """The result row of one configuration (the step counters are rank 0's: every rank counts
    the group's steps from the same gathered batch shapes)."""
    num_steps = ranks[0]["num_steps"]
    policy = {k.removeprefix("prefill_policy_"): v for k, v in ranks[0].items()
              if k.startswith("prefill_policy_")}
    ttft = [o.metrics.ttft_s * 1e3 for o in finished.values() if o.metrics.ttft_s is not None]
    tpot = [o.metrics.tpot_s * 1e3 for o in finished.values() if o.metrics.tpot_s is not None]
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in finished.values())
    return {
        "name": name,
        "prefill_policy": config.resolved_prefill_policy(),
        "prefill_decode_interval": config.prefill_decode_interval,
        "num_requests": len(finished),
        "num_output_tokens": num_output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": num_output_tokens / elapsed_s,
        "num_steps": num_steps,
        "num_prefill_steps": ranks[0]["num_prefill_steps"],
        "num_mixed_prefill_steps": ranks[0]["num_mixed_prefill_steps"],
        "num_tbo_steps": ranks[0]["num_tbo_steps"],
        "num_dummy_steps": sum(r["num_dummy_steps"] for r in ranks),
        "mixed_step_fraction": ranks[0]["num_mixed_prefill_steps"] / max(1, num_steps),
        "prefill_step_fraction": ranks[0]["num_prefill_steps"] / max(1, num_steps),
        "dummy_step_fraction": sum(r["num_dummy_steps"] for r in ranks)
        / max(1, num_steps * len(ranks)),
        "hold_rate": policy["hold_rate"],
        "max_consecutive_holds": policy["max_consecutive_holds"],
        "prefill_policy_stats": policy,
        "ttft_ms": _summary(ttft),
        "tpot_ms": _summary(tpot),
        "per_rank": [{k: r[k] for k in ("dp_rank", "num_real_steps", "num_dummy_steps",
                                        "num_preemptions") if k in r} for r in ranks],
    }


def _idle_rank_stats(engine, timeout_s: float = 60.0) -> list[dict]:
    """Every rank's stats once the group has ended its wave (the counters are final)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = engine.get_rank_stats()
        if all(r["idle"] for r in ranks) and len({r["tick"] for r in ranks}) == 1:
            return ranks
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not go idle within {timeout_s:.0f} s: {ranks}")
        time.sleep(0.05)


def print_table(results: list[dict]) -> None:
    rows = [("configuration", [r["name"] for r in results]),
            ("output tok/s", [f"{r['output_tokens_per_s']:.1f}" for r in results]),
            ("forward steps (TBO)", [f"{r['num_steps']} ({r['num_tbo_steps']})" for r in results]),
            ("prefill / mixed steps", [f"{r['num_prefill_steps']} / {r['num_mixed_prefill_steps']}"
                                       for r in results]),
            ("mixed-step fraction", [f"{r['mixed_step_fraction']:.3f}" for r in results]),
            ("prefill-step fraction", [f"{r['prefill_step_fraction']:.3f}" for r in results]),
            ("dummy-step fraction", [f"{r['dummy_step_fraction']:.3f}" for r in results]),
            ("hold rate (longest run)", [f"{r['hold_rate']:.3f} ({r['max_consecutive_holds']})"
                                         for r in results]),
            ("TTFT mean / p90 (ms)", [f"{r['ttft_ms']['mean']:.0f} / {r['ttft_ms']['p90']:.0f}"
                                      for r in results]),
            ("TPOT mean / p90 (ms)", [f"{r['tpot_ms']['mean']:.0f} / {r['tpot_ms']['p90']:.0f}"
                                      for r in results]),
            ("elapsed (s)", [f"{r['elapsed_s']:.1f}" for r in results])]
    base = results[0]
    rows.append((f"tok/s vs {base['name']}",
                 [f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x"
                  for r in results]))
    width = max(len(label) for label, _ in rows)
    cols = [max(len(row[1][i]) if i < len(row[1]) else 0 for row in rows) for i in
            range(len(results))]
    cols = [max(c, 12) for c in cols]
    for label, values in rows:
        print(f"| {label:<{width}} | " + " | ".join(f"{v:>{c}}" for v, c in zip(values, cols))
              + " |")


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
    p.add_argument("--burst-interval-s", type=float, default=1.0)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = make_workload(args)
    results = []
    for name, options in configurations(args):
        folder = pathlib.Path(args.trace_dir) / re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        config = EngineConfig.from_kwargs(**options, dp_trace=str(folder))
        print(f"running: {name} ...", file=sys.stderr, flush=True)
        results.append(run_config(name, config, workload))
        write_trace_views(folder, name)
        results[-1]["trace"] = str(folder)
    print_table(results)
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
