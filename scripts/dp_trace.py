"""Turn a per-tick DP trace (``--dp-trace FOLDER``: one ``dp<rank>.jsonl`` per rank) into a
Chrome trace / Perfetto JSON and a PNG timeline, and print a per-rank summary.

- JSON (``--perfetto``, load it in https://ui.perfetto.dev or chrome://tracing): one track per
  rank; a slice per control sync and per step, named by what the rank's step did (``prefill``,
  ``prefill (mixed)`` when another rank did not prefill that tick, ``decode``, ``dummy``); an
  instant ``hold: <reason>`` on every held tick; a KV-usage counter per rank.
- PNG (``--png``): ranks × ticks, each cell coloured by the step's kind (prefill on an aligned
  tick, prefill on a mixed tick, decode, dummy), a strip on top marking held ticks, and below it
  each rank's step time per tick (ms, the rank's own clock). The x axis counts ticks; a second
  axis on top gives the seconds since the first tick (rank 0's clock: ticks are not evenly
  spaced in time). The title names the trace folder (not its whole path) and the policy.

    python scripts/dp_trace.py results/dp_trace --perfetto results/dp_trace.json \\
        --png results/dp_trace.png
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

from atom.dp.dp_trace import RankTrace, read_trace, step_kind, to_perfetto

COLORS = {"prefill": "#1f77b4", "prefill (mixed)": "#d62728", "decode": "#2ca02c",
          "dummy": "#c7c7c7", "hold": "#ff7f0e"}


def cell_kind(row: dict) -> str:
    kind = step_kind(row)
    return "prefill (mixed)" if kind == "prefill" and row["mixed"] else kind


def summary(traces: list[RankTrace]) -> list[str]:
    """One line per rank (step kinds) and one for the decisions (reasons)."""
    lines = []
    for t in traces:
        kinds = collections.Counter(cell_kind(row) for row in t.rows)
        lines.append(f"dp{t.dp_rank}: {len(t.rows)} steps, " + ", ".join(
            f"{k} {kinds[k]}" for k in ("prefill", "prefill (mixed)", "decode", "dummy")))
    reasons = collections.Counter(row["reason"] for row in traces[0].rows)
    lines.append(f"decisions ({traces[0].header['policy']}): " + ", ".join(
        f"{r} {n}" for r, n in reasons.most_common()))
    return lines


def _runs(ticks: list[int]) -> list[tuple[int, int]]:
    """Consecutive ticks as (start, length) bars for broken_barh."""
    bars: list[tuple[int, int]] = []
    for tick in ticks:
        if bars and bars[-1][0] + bars[-1][1] == tick:
            bars[-1] = (bars[-1][0], bars[-1][1] + 1)
        else:
            bars.append((tick, 1))
    return bars


def default_title(trace: str, traces: list[RankTrace]) -> str:
    """The PNG's title: the trace folder's name (not its path) and the policy."""
    return f"{pathlib.Path(trace).resolve().name} (policy {traces[0].header['policy']})"


def tick_to_seconds(rows: list[dict]):
    """``(forward, inverse)`` between ticks and seconds since the first row's start (``rows``:
    one rank's trace rows, ticks increasing), for a secondary axis: interpolated between rows,
    extended past them at the run's mean seconds per tick (matplotlib asks outside the data
    too, and needs both directions monotonic)."""
    import numpy as np

    ticks = np.array([row["tick"] for row in rows], dtype=float)
    seconds = (np.array([row["start_us"] for row in rows], dtype=float) - rows[0]["start_us"]) / 1e6
    seconds += np.arange(len(rows)) * 1e-9  # strictly increasing: one clock µs may hold two
    if len(rows) == 1:
        ticks, seconds = np.append(ticks, ticks[0] + 1), np.append(seconds, seconds[0] + 1e-3)
    slope = (seconds[-1] - seconds[0]) / (ticks[-1] - ticks[0])

    def interp(x, xp, fp, slope):
        x = np.asarray(x, dtype=float)
        y = np.interp(x, xp, fp)
        y = np.where(x < xp[0], fp[0] + (x - xp[0]) * slope, y)
        return np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * slope, y)

    return (lambda x: interp(x, ticks, seconds, slope),
            lambda s: interp(s, seconds, ticks, 1 / slope))


def plot(traces: list[RankTrace], path: pathlib.Path, *, title: str) -> None:
    """The PNG timeline (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(traces)
    fig, (ax, ax_ms) = plt.subplots(2, 1, figsize=(12, 2.2 + 0.5 * n), sharex=True,
                                    gridspec_kw={"height_ratios": [1 + n, 2]})
    for t in traces:
        y = n - 1 - t.dp_rank
        for kind, color in COLORS.items():
            ticks = [row["tick"] for row in t.rows if kind != "hold" and cell_kind(row) == kind]
            ax.broken_barh(_runs(ticks), (y + 0.1, 0.8), facecolors=color)
        ax_ms.plot([row["tick"] for row in t.rows], [row["step_us"] / 1e3 for row in t.rows],
                   lw=0.8, label=f"dp{t.dp_rank}")
    held = [row["tick"] for row in traces[0].rows if not row["allow"]]
    ax.broken_barh(_runs(held), (n + 0.2, 0.6), facecolors=COLORS["hold"])
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)] + [n + 0.5],
                  [f"dp{r}" for r in range(n)] + ["held"])
    ax.set_ylim(0, n + 1)
    ax.set_title(title)
    top = ax.secondary_xaxis("top", functions=tick_to_seconds(traces[0].rows))
    top.set_xlabel("seconds since the first tick (dp0)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], ncol=5,
              loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize="small", frameon=False)
    ax_ms.set_ylabel("step (ms)")
    ax_ms.set_xlabel("tick")
    ax_ms.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the --dp-trace folder")
    p.add_argument("--perfetto", help="write the Chrome trace / Perfetto JSON here")
    p.add_argument("--png", help="write the PNG timeline here")
    p.add_argument("--title", default=None, help="PNG title (default: the folder and policy)")
    args = p.parse_args(argv)
    traces = read_trace(args.trace)
    print("\n".join(summary(traces)))
    if args.perfetto:
        out = pathlib.Path(args.perfetto)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(to_perfetto(traces)))
        print(f"wrote {out}", file=sys.stderr)
    if args.png:
        out = pathlib.Path(args.png)
        out.parent.mkdir(parents=True, exist_ok=True)
        title = args.title or default_title(args.trace, traces)
        plot(traces, out, title=title)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
