"""A run's report (``report.md``, ``summary.json``, PNG plots) and the comparison of two runs.

``summary.json`` holds what :func:`compare` reads: the run's shape, the serving benchmark's
summary (``atom bench serve``'s JSON ``summary``) and each rank's final ``/metrics`` series.
``report.md`` shows it as tables with three plots: throughput, TTFT / TPOT / ITL / E2E latency
percentiles, and per-rank load over time (running + waiting sequences, KV cache usage) from the
samples taken during the benchmark. matplotlib draws them (Agg, no display).
"""

from __future__ import annotations

import json
import pathlib

THROUGHPUTS = (("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s"),
               ("request_throughput", "requests/s"))
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
STATS = ("mean", "p50", "p90", "p99")
RANK_COLUMNS = (("dp_dummy_steps", "dummy steps"), ("num_preemptions", "preemptions"),
                ("prefix_cache_hits", "prefix hits (tok)"), ("num_kv_blocks_total", "KV blocks"),
                ("prompt_tokens", "prompt tokens"), ("generation_tokens", "output tokens"))
# the DP group's steps (every rank counts the same: /metrics shows them once)
GROUP_COLUMNS = (("dp_steps", "steps"), ("dp_prefill_steps", "prefill steps"),
                 ("dp_mixed_prefill_steps", "mixed prefill steps"), ("dp_tbo_steps", "TBO steps"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(value) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def _latency(bench: dict, name: str, stat: str) -> float | None:
    return bench.get(f"{stat}_{name}_ms")


def bench_tables(bench: dict) -> list[str]:
    """Markdown lines: the throughput table and the latency table of one run."""
    lines = ["| metric | value |", "|---|---:|",
             f"| requests completed / failed | {bench['completed']} / {bench['failed']} |",
             f"| duration (s) | {bench['duration_s']:.2f} |"]
    lines += [f"| {label} | {bench[key]:.2f} |" for key, label in THROUGHPUTS]
    lines += ["", "| latency (ms) | " + " | ".join(STATS) + " |", "|---|" + "---:|" * len(STATS)]
    for name, label in LATENCIES:
        cells = " | ".join(_fmt(_latency(bench, name, s)) for s in STATS)
        lines.append(f"| {label} | {cells} |")
    return lines


def rank_table(ranks: dict[str, dict]) -> list[str]:
    """Markdown lines: one row per DP rank from its final ``/metrics`` series."""
    lines = ["| dp_rank | " + " | ".join(label for _, label in RANK_COLUMNS) + " |",
             "|---:|" + "---:|" * len(RANK_COLUMNS)]
    for rank, series in ranks.items():
        cells = " | ".join(_fmt(series.get(key)) for key, _ in RANK_COLUMNS)
        lines.append(f"| {rank} | {cells} |")
    return lines


def group_table(group: dict) -> list[str]:
    """Markdown lines: the DP group's steps from the final ``/metrics`` (one row)."""
    return ["| " + " | ".join(label for _, label in GROUP_COLUMNS) + " |",
            "|" + "---:|" * len(GROUP_COLUMNS),
            "| " + " | ".join(_fmt(group.get(key)) for key, _ in GROUP_COLUMNS) + " |"]


def plot_throughput(runs: dict[str, dict], path: pathlib.Path) -> None:
    """Bars of output and total tokens/s, one group per run (``name → bench summary``)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / len(runs)
    for i, (name, bench) in enumerate(runs.items()):
        xs = [j + i * width for j in range(2)]
        ax.bar(xs, [bench["output_throughput"], bench["total_token_throughput"]], width,
               label=name)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(2)],
                  ["output tok/s", "total tok/s"])
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_latency(runs: dict[str, dict], path: pathlib.Path) -> None:
    """TTFT / TPOT / ITL / E2E at p50, p90, p99: one panel per metric, bars per run."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(11, 3.2))
    stats = STATS[1:]
    width = 0.8 / len(runs)
    for ax, (name, label) in zip(axes, LATENCIES):
        for i, (run, bench) in enumerate(runs.items()):
            values = [_latency(bench, name, s) or 0.0 for s in stats]
            ax.bar([j + i * width for j in range(len(stats))], values, width, label=run)
        ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(stats))], stats)
        ax.set_title(f"{label} (ms)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_rank_load(samples: list[dict], path: pathlib.Path) -> None:
    """Per rank over time: running + waiting sequences (left), KV cache usage (right)."""
    plt = _plt()
    fig, (load, kv) = plt.subplots(1, 2, figsize=(10, 3.2))
    ranks = sorted({r for s in samples for r in s["ranks"]}, key=int)
    for rank in ranks:
        points = [(s["t_s"], s["ranks"][rank]) for s in samples if rank in s["ranks"]]
        ts = [t for t, _ in points]
        load.plot(ts, [v.get("num_requests_running", 0) + v.get("num_requests_waiting", 0)
                       for _, v in points], label=f"dp{rank}")
        kv.plot(ts, [100 * v.get("kv_cache_usage_perc", 0) for _, v in points],
                label=f"dp{rank}")
    load.set_title("running + waiting sequences")
    kv.set_title("KV cache usage (%)")
    for ax in (load, kv):
        ax.set_xlabel("s since atom bench serve started (tokenizer load, warm-up included)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(run_dir: pathlib.Path, summary: dict, samples: list[dict]) -> pathlib.Path:
    """Write ``summary.json``, the plots and ``report.md`` into ``run_dir``; returns the
    report's path."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    name, bench = summary["name"], summary["bench"]
    plot_throughput({name: bench}, run_dir / "throughput.png")
    plot_latency({name: bench}, run_dir / "latency.png")
    plot_rank_load(samples, run_dir / "rank_load.png")
    lines = [f"# Multi-node benchmark: {name}", "",
             f"{summary['nnodes']} node(s) × {summary['nproc_per_node']} rank(s) "
             f"(world size {summary['nnodes'] * summary['nproc_per_node']}), method "
             f"`{summary['method']}`, {summary['started']}. CPU: {summary['cpu']}.", "",
             "Command:", "", "```", summary["command"], "```", "",
             "Workload (`atom bench serve`): " + summary["workload"], "",
             "## Deployment", "", "| node | address | launcher exit code |", "|---:|---|---:|"]
    lines += [f"| {n['node_rank']} | {n['address']} | {n['exit_code']} |"
              for n in summary["nodes"]]
    lines += ["", "## Serving benchmark", "", *bench_tables(bench), "",
              "![throughput](throughput.png)", "", "![latency](latency.png)", "",
              "## The DP group (final `/metrics`)", "", *group_table(summary.get("group", {})),
              "", "## Per rank (final `/metrics`)", "", *rank_table(summary["ranks"]), "",
              "![per-rank load](rank_load.png)", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def load_summary(run_dir: str | pathlib.Path) -> dict:
    """A run's ``summary.json``. Raises ValueError when the folder has none."""
    path = pathlib.Path(run_dir) / "summary.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no summary.json (not a `atom bench multinode` run "
                         f"folder, or the run did not finish)")
    return json.loads(path.read_text())


def compare_rows(a: dict, b: dict) -> list[tuple[str, float | None, float | None]]:
    """``(metric, A, B)`` for the throughputs and latency statistics of two summaries."""
    rows = [(label, a["bench"].get(key), b["bench"].get(key)) for key, label in THROUGHPUTS]
    for name, label in LATENCIES:
        rows += [(f"{s} {label} (ms)", _latency(a["bench"], name, s),
                  _latency(b["bench"], name, s)) for s in STATS]
    return rows


def compare(run_a: str | pathlib.Path, run_b: str | pathlib.Path,
            output_dir: pathlib.Path | None = None) -> str:
    """The table of ``B / A`` ratios of two runs (ValueError without their summaries); with
    ``output_dir``, also ``compare.md`` and the two plots with both runs there."""
    a, b = load_summary(run_a), load_summary(run_b)
    lines = [f"A = {a['name']} ({a['nnodes']}×{a['nproc_per_node']}), "
             f"B = {b['name']} ({b['nnodes']}×{b['nproc_per_node']})", "",
             "| metric | A | B | B / A |", "|---|---:|---:|---:|"]
    for metric, va, vb in compare_rows(a, b):
        ratio = f"{vb / va:.3f}" if va and vb is not None else "—"
        lines.append(f"| {metric} | {_fmt(va)} | {_fmt(vb)} | {ratio} |")
    text = "\n".join(lines)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        runs = {f"A: {a['name']}": a["bench"], f"B: {b['name']}": b["bench"]}
        plot_throughput(runs, output_dir / "compare_throughput.png")
        plot_latency(runs, output_dir / "compare_latency.png")
        (output_dir / "compare.md").write_text(
            f"# {a['name']} vs {b['name']}\n\n{text}\n\n![throughput](compare_throughput.png)"
            f"\n\n![latency](compare_latency.png)\n")
    return text
