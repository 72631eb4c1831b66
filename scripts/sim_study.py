"""The simulator study of docs/DP_EXPERIMENTS.md: prefill policies × DP size × workload, expert
parallelism on, with this machine's MoE profile.

Policies: none, delayer, coalescer, and the delayer with the decode-protection interval (2
ticks). DP sizes 2, 8, 32. Workloads (time-clocked, seeded, the same load per rank at every DP
size; sized for this CPU's step times, a few requests per rank every few seconds):

- *bursty*: bursts of 3 requests per rank every 6 s, 10 bursts, prompts of 32-192 tokens,
  8-48 output tokens;
- *kv_skewed*: Poisson arrivals, 0.3 requests per second per rank for 120 s; 1/DP of them long
  (prompts of 384-768 tokens, 32-96 output tokens) and pinned to rank 0, whose pool (64 blocks
  of 16 tokens, like every rank's) cannot hold many of them: the KV-pressured rank of
  ``scripts/dp_experiment.py`` at scale; the rest short (32-192, 8-48), routed.

The model is model (a) split into 32 experts (one per rank at DP 32), its experts sharded over
the ranks; the cost of its MLP per row is the 4-expert profile's (a guess for narrower
experts; docs/DP_EXPERIMENTS.md says where else the model guesses). Prints a table per
workload, writes the JSON and one PNG per workload.

    python scripts/sim_study.py                    # docs/sim_study_<workload>.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from atom.config import EngineConfig
from atom.dp.sim import format_table, load_profile
from atom.dp.sim.sweep import plot, sweep

BASE = EngineConfig(dtype="float32", num_kv_blocks=64, max_num_seqs=16,
                    max_num_batched_tokens=1024, max_model_len=2048,
                    enable_prefix_caching=False, moe_split_experts=32,
                    enable_expert_parallel=True)
SHORT = dict(prompt_len=(32, 192), output_len=(8, 48))
WORKLOAD_ARGS = {
    "bursty": dict(burst_interval=6.0, **SHORT),
    "kv_skewed": dict(long_prompt_len=(384, 768), long_output_len=(32, 96),
                      short_prompt_len=SHORT["prompt_len"], short_output_len=SHORT["output_len"]),
}
POLICIES = ("none", "delayer", "coalescer", "delayer+interval")


def per_rank_sizes(name: str, dp_size: int) -> dict:
    """The workload's size for ``dp_size`` ranks (module docstring)."""
    if name == "bursty":
        return dict(num_requests=30 * dp_size, burst_size=3 * dp_size)
    return dict(num_requests=36 * dp_size, rate=0.3 * dp_size, skewed_fraction=1.0 / dp_size)


def run(args: argparse.Namespace) -> list[dict]:
    profile = load_profile(args.profile)
    results = []
    for name in args.workloads:
        for dp_size in args.dp_sizes:
            workload_args = {name: {**WORKLOAD_ARGS[name], **per_rank_sizes(name, dp_size)}}
            for policy in args.policies:
                base, label = BASE, policy
                if policy == "delayer+interval":
                    # the interval needs DP > 1 in the config itself (sweep sets the size too)
                    base = dataclasses.replace(BASE, data_parallel_size=dp_size,
                                               prefill_decode_interval=2)
                    policy = "delayer"
                (result,) = sweep(base=base, workloads=[name], dp_sizes=[dp_size],
                                  policies=[policy], profile=profile, seed=args.seed,
                                  workload_args=workload_args)
                result["prefill_policy"] = label  # the plot's line
                result["name"] = f"{name}, DP {dp_size}, {label}"
                results.append(result)
                sim = result["sim"]
                print(f"{result['name']}: {sim['cpu_s']:.1f} CPU s; simulated time: compute "
                      f"{sim['compute_s'] / sim['simulated_s']:.0%}, EP collectives "
                      f"{sim['ep_s'] / sim['simulated_s']:.0%}, tick overhead "
                      f"{sim['tick_s'] / sim['simulated_s']:.0%}", file=sys.stderr)
    return results


def study_table(results: list[dict]) -> str:
    """The study's markdown table (docs/DP_EXPERIMENTS.md): one row per DP size and policy,
    with the share of the simulated time the EP collectives took (the cost model's guess)."""
    lines = ["| DP | policy | mixed-step fraction | dummy-step fraction | output tok/s | "
             "TTFT p50 (s) | TTFT p99 (s) | TPOT mean (ms) | simulated s | EP share | ticks |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        sim = r["sim"]
        lines.append(
            f"| {r['dp_size']} | {r['prefill_policy']} | {r['mixed_step_fraction']:.3f} | "
            f"{r['dummy_step_fraction']:.3f} | {r['output_tokens_per_s']:.1f} | "
            f"{r['ttft_ms']['p50'] / 1e3:.1f} | {r['ttft_ms']['p99'] / 1e3:.1f} | "
            f"{r['tpot_ms']['mean']:.0f} | {r['elapsed_s']:.0f} | "
            f"{sim['ep_s'] / sim['simulated_s']:.0%} | {sim['num_ticks']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOAD_ARGS))
    p.add_argument("--dp-sizes", nargs="+", type=int, default=[2, 8, 32])
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--profile", default="smollm2-moe4-fp32-cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-dir", default="docs")
    p.add_argument("--output-json", default="results/sim_study.json")
    args = p.parse_args(argv)
    results = run(args)
    for name in args.workloads:
        mine = [r for r in results if r["workload"] == name]
        print(f"\n{name}:\n{format_table(mine)}\n\n{study_table(mine)}")
        path = pathlib.Path(args.plot_dir) / f"sim_study_{name}.png"
        plot(mine, path, title=f"atom sim: {name}, EP over DP ranks (model (a), 32 experts; "
                               f"{args.profile})")
        print(f"wrote {path}", file=sys.stderr)
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in results:
        r.pop("timeline")
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
