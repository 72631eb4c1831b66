"""Sweeps of the simulator (policy × DP size × workload) and their plots.

:func:`sweep` runs :func:`atom.dp.sim.simulate` for every combination, each workload sized
for its DP size (:func:`atom.dp.sim.workload.scaled`: the same load per rank); :func:`plot`
draws one PNG (matplotlib, headless): a row per workload, a column per metric, the DP size
on the x axis and a line per policy; latencies in seconds (the unit of ``atom sim sweep``'s
table for such runs), and an overloaded run's points (:func:`atom.dp.sim.metrics.overload_note`)
circled in red, as the table's ``overload`` column says. ``atom sim sweep`` and
``scripts/sim_study.py`` use both.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

from atom.config import EngineConfig
from atom.dp.sim.workload import scaled

# (result key, statistic or None, axis label, factor from the result's unit to the axis')
PLOT_METRICS = (("mixed_step_fraction", None, "mixed-step fraction", 1.0),
                ("output_tokens_per_s", None, "output tokens/s", 1.0),
                ("ttft_ms", "p50", "TTFT p50 (s)", 1e-3),
                ("ttft_ms", "p99", "TTFT p99 (s)", 1e-3))
OVERLOADED_LABEL = "overloaded (latency = queue)"


def sweep(*, base: EngineConfig, workloads: Sequence[str], dp_sizes: Sequence[int],
          policies: Sequence[str], profile=None, clock: str = "time", seed: int = 0,
          workload_args: dict[str, dict] | None = None,
          trace_root: str | pathlib.Path | None = None) -> list[dict]:
    """One simulated run per (workload, DP size, policy); returns their result dicts, each
    with ``workload`` added.

    Args:
        base: the deployment's options; ``data_parallel_size`` and ``prefill_policy`` are set
            per run (with expert parallelism, ``moe_split_experts`` must cover the largest
            DP size).
        workloads: generator names (:data:`atom.dp.sim.workload.GENERATORS`).
        workload_args: per generator, arguments that replace :func:`scaled`'s.
        trace_root: write each run's per-tick trace in a folder under it.
    """
    from atom.dp.sim import simulate

    results = []
    for name in workloads:
        for dp_size in dp_sizes:
            requests = scaled(name, dp_size=dp_size, clock=clock, seed=seed,
                              **(workload_args or {}).get(name, {}))
            for policy in policies:
                config = dataclasses.replace(base, data_parallel_size=dp_size,
                                             prefill_policy=policy)
                label = f"{name}, DP {dp_size}, {policy}"
                trace = (None if trace_root is None else
                         pathlib.Path(trace_root) / f"{name}_dp{dp_size}_{policy}")
                result = simulate(requests, config, profile, name=label, trace_dir=trace)
                result["workload"] = name
                results.append(result)
    return results


def _value(result: dict, key: str, stat: str | None) -> float:
    value = result[key]
    return value.get(stat, float("nan")) if stat else value


def plot(results: Sequence[dict], path: str | pathlib.Path, *, title: str,
         metrics: Sequence[tuple[str, str | None, str, float]] = PLOT_METRICS) -> None:
    """The sweep as one PNG (module docstring)."""
    from atom.dp.sim.metrics import overload_note
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    policies = list(dict.fromkeys(r["prefill_policy"] for r in results))
    fig, axes = plt.subplots(len(workloads), len(metrics), squeeze=False,
                             figsize=(3.4 * len(metrics), 2.8 * len(workloads)))
    for row, workload in enumerate(workloads):
        for col, (key, stat, label, factor) in enumerate(metrics):
            ax = axes[row][col]
            for policy in policies:
                runs = sorted((r for r in results if r["workload"] == workload
                               and r["prefill_policy"] == policy), key=lambda r: r["dp_size"])
                ax.plot([r["dp_size"] for r in runs],
                        [_value(r, key, stat) * factor for r in runs], marker="o", label=policy)
                over = [r for r in runs if overload_note(r)]
                if over:
                    ax.scatter([r["dp_size"] for r in over],
                               [_value(r, key, stat) * factor for r in over], s=110,
                               facecolors="none", edgecolors="red", linewidths=1.2,
                               label=OVERLOADED_LABEL, zorder=3)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["dp_size"] for r in results}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_title(f"{workload}: {label}", fontsize=9)
            ax.set_xlabel("DP size", fontsize=8)
            ax.tick_params(labelsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # the overload mark once, from whichever panel has one
        for handle, text in zip(*ax.get_legend_handles_labels()):
            if text == OVERLOADED_LABEL and text not in labels:
                handles.append(handle)
                labels.append(text)
    keep = dict(zip(labels, handles))  # one entry per label
    axes[0][0].legend(list(keep.values()), list(keep), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
