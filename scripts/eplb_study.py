"""The simulator's EPLB study of docs/DP_EXPERIMENTS.md: EPLB off, on, on with redundant
experts, and the fake-uniform bound × DP 8 and 32 × routing skew, expert parallelism on.

Routing: a Zipf popularity over 64 experts per MoE layer, 8 layers, top-4, the hot experts at
random places per layer (:meth:`atom.dp.sim.experts.ExpertPopularity.zipf`, seeded), exponents
``--skews`` (0.8 and 1.2 by default; at 1.2 the hottest expert takes the 1/4 cap, a quarter
of its layer's pairs, which one rank cannot share without replicas). Configurations (the
delayer as prefill policy; EPLB windows of ``--window`` ticks ending every ``--interval``):

- *off*: the contiguous placement; its windows are measured but never acted on
  (``eplb_min_balancedness`` 0: the simulator charges no move, so this is EPLB off);
- *on*: re-placement only;
- *on + redundant*: one redundant slot per rank (``eplb_num_redundant_experts`` = DP);
- *fake uniform*: every expert the same share (``eplb_fake_uniform``: the balanced bound).

The workload is the prefill-policy study's bursty one (``scripts/sim_study.py``: bursts of 3
requests per rank every 6 s, prompts 32-192 tokens, 8-48 output tokens), 30 bursts; the
profile the committed 4-expert MoE one. Prints a table, writes the JSON and two PNGs: output
tokens/s and TTFT p99 per configuration, and every window's balancedness over the run.

    python scripts/eplb_study.py     # results/eplb_study.json, docs/eplb_study_*.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

from atom.dp.sim import ExpertPopularity, load_profile, simulate
from atom.dp.sim.workload import scaled

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sim_study import BASE, WORKLOAD_ARGS  # noqa: E402  (the same deployment and workload)

NUM_BURSTS = 30
NUM_EXPERTS, NUM_LAYERS, TOP_K = 64, 8, 4
CONFIGS = ("off", "on", "on + redundant", "fake uniform")


def config_options(name: str, dp_size: int, *, window: int, interval: int) -> dict:
    eplb = dict(enable_eplb=True, eplb_window_size=window, eplb_step_interval=interval)
    return {"off": dict(eplb, eplb_min_balancedness=0.0), "on": eplb,
            "on + redundant": dict(eplb, eplb_num_redundant_experts=dp_size),
            "fake uniform": dict(eplb, eplb_fake_uniform=True)}[name]


def run(args: argparse.Namespace) -> list[dict]:
    profile = load_profile(args.profile)
    results = []
    for dp_size in args.dp_sizes:
        requests = scaled("bursty", dp_size=dp_size, seed=args.seed,
                          **{**WORKLOAD_ARGS["bursty"], "num_requests": 3 * NUM_BURSTS * dp_size,
                             "burst_size": 3 * dp_size})
        for skew in args.skews:
            for name in CONFIGS:
                config = dataclasses.replace(
                    BASE, data_parallel_size=dp_size, prefill_policy="delayer",
                    **config_options(name, dp_size, window=args.window, interval=args.interval))
                routing = ExpertPopularity.zipf(NUM_LAYERS, NUM_EXPERTS, top_k=TOP_K,
                                                exponent=skew, seed=args.seed)
                start = time.process_time()
                result = simulate(requests, config, profile, routing=routing,
                                  name=f"DP {dp_size}, Zipf {skew}, {name}")
                result.update(config_name=name, skew=skew)
                results.append(result)
                print(f"{result['name']}: {time.process_time() - start:.1f} CPU s",
                      file=sys.stderr)
    return results


def print_table(results: list[dict]) -> None:
    print("| DP | Zipf | EPLB | output tok/s | vs off | TTFT p50 (s) | TTFT p99 (s) | "
          "mean step imbalance | windows' balancedness (first → last) | rebalances | ticks |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in results:
        off = next(o for o in results if o["dp_size"] == r["dp_size"] and o["skew"] == r["skew"]
                   and o["config_name"] == "off")
        windows = r["experts"]["windows"]
        print(f"| {r['dp_size']} | {r['skew']} | {r['config_name']} | "
              f"{r['output_tokens_per_s']:.1f} | "
              f"{r['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x | "
              f"{r['ttft_ms']['p50'] / 1e3:.1f} | {r['ttft_ms']['p99'] / 1e3:.1f} | "
              f"{r['experts']['mean_imbalance']:.2f} | "
              f"{windows[0]['balancedness']:.2f} → {windows[-1]['balancedness']:.2f} | "
              f"{r['experts']['num_rebalances']} | {r['sim']['num_ticks']} |")


def plot(results: list[dict], folder: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    groups = list(dict.fromkeys((r["dp_size"], r["skew"]) for r in results))
    bars = folder / "eplb_study_throughput.png"
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 2.9))
    for ax, (key, stat, label) in zip(axes, (("output_tokens_per_s", None, "output tokens/s"),
                                             ("ttft_ms", "p99", "TTFT p99 (s)"))):
        width = 0.8 / len(CONFIGS)
        for i, name in enumerate(CONFIGS):
            values = []
            for dp_size, skew in groups:
                r = next(r for r in results if (r["dp_size"], r["skew"], r["config_name"])
                         == (dp_size, skew, name))
                values.append(r[key] if stat is None else r[key][stat] / 1e3)
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"DP {d}\nZipf {s}" for d, s in groups], fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(bars, dpi=100)
    plt.close(fig)
    lines = folder / "eplb_study_balancedness.png"
    fig, axes = plt.subplots(1, len(groups), figsize=(2.6 * len(groups), 2.7), squeeze=False)
    for ax, (dp_size, skew) in zip(axes[0], groups):
        for name in CONFIGS:
            r = next(r for r in results if (r["dp_size"], r["skew"], r["config_name"])
                     == (dp_size, skew, name))
            windows = r["experts"]["windows"]
            ax.plot([w["tick"] for w in windows], [w["balancedness"] for w in windows],
                    marker=".", label=name)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"DP {dp_size}, Zipf {skew}", fontsize=9)
        ax.set_xlabel("tick", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("window balancedness", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(lines, dpi=100)
    plt.close(fig)
    return [bars, lines]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp-sizes", nargs="+", type=int, default=[8, 32])
    p.add_argument("--skews", nargs="+", type=float, default=[0.8, 1.2])
    p.add_argument("--window", type=int, default=25, help="eplb_window_size (ticks)")
    p.add_argument("--interval", type=int, default=50, help="eplb_step_interval (ticks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="smollm2-moe4-fp32-cpu")
    p.add_argument("--output-json", default="results/eplb_study.json")
    p.add_argument("--plot-dir", default="docs")
    args = p.parse_args(argv)
    results = run(args)
    print_table(results)
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for path in plot(results, pathlib.Path(args.plot_dir)):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
