"""Run results: the metrics and step counters of ``scripts/dp_experiment.py``, for real and
simulated runs alike, as one JSON-ready dict per run, and the table that prints them.

Keys (both kinds of run): ``name``, ``prefill_policy``, ``num_requests``,
``num_output_tokens``, ``elapsed_s`` (first arrival to last finish), ``output_tokens_per_s``,
the group's step counters (``num_steps``, ``num_prefill_steps``, ``num_mixed_prefill_steps``,
``num_tbo_steps``; ``num_dummy_steps`` summed over the ranks) and their fractions, the prefill
policy's counters (``hold_rate``, ``max_consecutive_holds``, ``prefill_policy_stats``),
``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` summaries (mean, p50, p90, p99) and ``per_rank``. A
simulated run adds ``sim`` (ticks; wall-clock and CPU seconds of the host; CPU µs per tick;
simulated seconds and their ratio to the CPU seconds), ``timeline`` (per-rank load and KV usage
over time, at most :data:`MAX_TIMELINE_POINTS` points), the deployment it simulated
(``enable_expert_parallel``, ``enable_tbo``, ``num_kv_blocks`` a rank, ``profile``), the load
(:func:`rate_metrics`) and ``ttft_growth_s_per_s`` (:func:`overload_note`).

Printing: :func:`run_header` (what ran), :func:`format_table` (runs of one workload side by
side), :func:`format_sweep` (a sweep: one table per workload, within 120 columns). Latencies
print in ms below 10 s and in seconds above (:func:`format_ms`).
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence

MAX_TIMELINE_POINTS = 500
#: a run is overloaded when the wait for a first token grows by more than this many seconds
#: per second of arrivals (:func:`overload_note`)
OVERLOAD_TTFT_GROWTH = 0.25
_SECONDS_FROM_MS = 10_000.0  # latencies from 10 s up print in seconds
TEXT_WIDTH = 100  # prose lines (headers, notes) wrap here; tables stay within 120 columns


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean and the p50 / p90 / p99 of ``values`` (nearest rank); ``{}`` when empty."""
    values = sorted(values)
    if not values:
        return {}
    n = len(values)
    return {"mean": statistics.fmean(values), "p50": values[n // 2],
            "p90": values[min(n - 1, int(0.9 * n))], "p99": values[min(n - 1, int(0.99 * n))]}


def step_metrics(counters: dict, *, num_ranks: int, policy_stats: dict) -> dict:
    """The step counters and their fractions from rank 0's counters (the group's, identical
    on every rank) with ``num_dummy_steps`` already summed over the ranks."""
    num_steps = counters["num_steps"]
    return {
        "num_steps": num_steps,
        "num_prefill_steps": counters["num_prefill_steps"],
        "num_mixed_prefill_steps": counters["num_mixed_prefill_steps"],
        "num_tbo_steps": counters["num_tbo_steps"],
        "num_spec_steps": counters.get("num_spec_steps", 0),  # steps verifying drafts
        "num_dummy_steps": counters["num_dummy_steps"],
        "mixed_step_fraction": counters["num_mixed_prefill_steps"] / max(1, num_steps),
        "prefill_step_fraction": counters["num_prefill_steps"] / max(1, num_steps),
        "dummy_step_fraction": counters["num_dummy_steps"] / max(1, num_steps * num_ranks),
        "hold_rate": policy_stats["hold_rate"],
        "max_consecutive_holds": policy_stats["max_consecutive_holds"],
        "prefill_policy_stats": policy_stats,
    }


def rate_metrics(num_requests: int, *, arrival_span_s: float, elapsed_s: float) -> dict:
    """How fast requests came and how fast the run finished them, requests per second:
    ``arrival_rate_per_s`` over the arrival span (first to last arrival; None when every
    request arrived at once), ``served_rate_per_s`` over the run (first arrival to last
    finish; None for an empty run)."""
    return {"arrival_span_s": arrival_span_s,
            "arrival_rate_per_s": num_requests / arrival_span_s if arrival_span_s > 0 else None,
            "served_rate_per_s": num_requests / elapsed_s if elapsed_s > 0 else None}


def latency_metrics(*, ttft_s: Sequence[float], tpot_s: Sequence[float],
                    itl_s: Sequence[float] = ()) -> dict:
    """TTFT, TPOT and ITL summaries in milliseconds."""
    return {"ttft_ms": summary([v * 1e3 for v in ttft_s]),
            "tpot_ms": summary([v * 1e3 for v in tpot_s]),
            "itl_ms": summary([v * 1e3 for v in itl_s])}


def sim_result(sim, *, name: str, host_s: float, cpu_s: float) -> dict:
    """The result dict of a finished :class:`~atom.dp.sim.simulator.Simulator` run."""
    records = [r for r in sim.records if r.finished]
    ttft, tpot, itl = [], [], []
    for r in records:
        times = r.token_times_s
        if not times:
            continue
        ttft.append(times[0] - r.arrival_s)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl += [b - a for a, b in zip(times, times[1:])]
    num_output_tokens = sum(len(r.token_times_s) for r in records)
    start = min((r.arrival_s for r in records), default=0.0)
    last_arrival = max((r.arrival_s for r in records), default=start)
    end = max((r.token_times_s[-1] for r in records if r.token_times_s), default=start)
    counters = dict(vars(sim.counters[0]))
    counters["num_dummy_steps"] = sum(c.num_dummy_steps for c in sim.counters)
    num_ranks = len(sim.ranks)
    elapsed = end - start
    return {
        "name": name,
        "prefill_policy": sim.decider.policy.name,
        "prefill_decode_interval": sim.config.prefill_decode_interval,
        "dp_size": num_ranks,
        "num_requests": len(records),
        "num_errors": sum(r.finish_reason == "error" for r in records),
        "num_output_tokens": num_output_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_output_tokens / elapsed if elapsed > 0 else 0.0,
        **rate_metrics(len(records), arrival_span_s=last_arrival - start, elapsed_s=elapsed),
        "ttft_growth_s_per_s": _ttft_growth(records),
        "enable_expert_parallel": sim.config.enable_expert_parallel,
        "enable_tbo": sim.config.enable_tbo,
        "num_kv_blocks": sim.ranks[0].block_manager.num_blocks if sim.ranks else 0,
        **step_metrics(counters, num_ranks=num_ranks, policy_stats=sim.decider.stats()),
        **latency_metrics(ttft_s=ttft, tpot_s=tpot, itl_s=itl),
        "per_rank": _per_rank(sim),
        **({} if sim.experts is None else {"experts": sim.experts.summary()}),
        "sim": {"num_ticks": sim.tick, "host_s": host_s, "cpu_s": cpu_s,
                "cpu_us_per_tick": cpu_s / max(1, sim.tick) * 1e6,
                "simulated_s": sim.now_s,
                "simulated_to_cpu": sim.now_s / cpu_s if cpu_s > 0 else 0.0,
                "num_late_arrivals": sum(r.num_late_arrivals for r in sim.ranks),
                # where the simulated time went: the cost model's parts, summed over the steps
                "compute_s": sum(cost.compute_s for _, cost in sim.step_log),
                "ep_s": sum(cost.ep_s for _, cost in sim.step_log),
                "tick_s": sum(cost.tick_s for _, cost in sim.step_log)},
        "timeline": _timeline(sim.samples),
    }


def _ttft_growth(records) -> float | None:
    """The least-squares slope of TTFT over arrival time (seconds of wait per second of
    arrivals); None with fewer than 4 requests or one arrival time."""
    points = [(r.arrival_s, r.token_times_s[0] - r.arrival_s) for r in records if r.token_times_s]
    if len(points) < 4 or len({a for a, _ in points}) < 2:
        return None
    arrivals, ttfts = zip(*points)
    return statistics.linear_regression(arrivals, ttfts).slope


def overload_note(result: dict) -> str | None:
    """A note when the run was overloaded, else None.

    Overloaded: the wait for a first token grew by more than :data:`OVERLOAD_TTFT_GROWTH`
    seconds per second of arrivals (the slope of TTFT over arrival time, kept in the result as
    ``ttft_growth_s_per_s``); the latencies of such a run measure its queue and grow with the
    run's length. How much faster requests came than the deployment served them is said with
    one figure, the arrival rate over the served rate (:func:`rate_metrics`: the two rates
    :func:`run_header` prints).
    """
    growth = result.get("ttft_growth_s_per_s")
    if growth is None or growth <= OVERLOAD_TTFT_GROWTH:
        return None
    rate, served = result.get("arrival_rate_per_s"), result.get("served_rate_per_s")
    pace = (f"{rate / served:.1f}x as fast as this deployment served them ({rate:.2f}/s "
            f"against {served:.2f}/s)" if rate and served else
            "faster than this deployment served them")
    return (f"overloaded: requests arrived {pace}: the latencies measure the queue and grow "
            f"with the run's length")


def format_ms(value_ms: float) -> str:
    """A latency with its unit: ``781 ms`` below 10 s, ``134.1 s`` from there up."""
    if value_ms >= _SECONDS_FROM_MS:
        return f"{value_ms / 1e3:.1f} s"
    return f"{value_ms:.0f} ms"


def run_header(result: dict, *, workload: str | None = None) -> list[str]:
    """What a simulated run ran, in lines: the workload and its load, the deployment, the
    profile, and the :func:`overload_note` when there is one."""
    rate, served = result.get("arrival_rate_per_s"), result.get("served_rate_per_s")
    load = (f"arriving over {result['arrival_span_s']:.1f} s ({rate:.2f}/s)" if rate else
            "arriving at once")
    served_text = f", served at {served:.2f}/s" if served else ""
    lines = [f"workload {workload or result.get('workload', '?')}: {result['num_requests']} "
             f"requests {load}{served_text}",
             f"deployment: DP {result['dp_size']}, prefill policy {result['prefill_policy']}"
             f"{_interval(result)}, EP {_on(result.get('enable_expert_parallel'))}, TBO "
             f"{_on(result.get('enable_tbo'))}, {result.get('num_kv_blocks', '?')} KV blocks a "
             f"rank; profile {result.get('profile') or '(given)'}"]
    note = overload_note(result)
    return [wrapped for line in lines + ([note] if note else []) for wrapped in wrap(line)]


def wrap(text: str) -> list[str]:
    """``text`` in lines of at most :data:`TEXT_WIDTH` columns, continuations indented."""
    return textwrap.wrap(text, TEXT_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _on(flag) -> str:
    return "on" if flag else "off"


def _interval(result: dict) -> str:
    interval = result.get("prefill_decode_interval") or 0
    return f", decode interval {interval}" if interval else ""


def _per_rank(sim) -> list[dict]:
    out = []
    for rank, counters in zip(sim.ranks, sim.counters):
        mine = [r for r in sim.records if r.dp_rank == rank.dp_rank]
        out.append({"dp_rank": rank.dp_rank, "num_requests": len(mine),
                    "num_real_steps": counters.num_real_steps,
                    "num_dummy_steps": counters.num_dummy_steps,
                    "num_preemptions": rank.scheduler.num_preemptions,
                    "prefix_cache_hit_rate": _hit_rate(rank.block_manager)})
    return out


def _hit_rate(bm) -> float:
    return bm.prefix_cache_hits / bm.prefix_cache_queries if bm.prefix_cache_queries else 0.0


def _timeline(samples: list) -> dict:
    """Per-rank load (running + waiting sequences) and KV usage, downsampled."""
    step = max(1, -(-len(samples) // MAX_TIMELINE_POINTS))
    picked = samples[::step]
    return {"tick": [s[0] for s in picked], "time_s": [round(s[1], 6) for s in picked],
            "load": [s[2] for s in picked],
            "kv_usage": [[round(u, 4) for u in s[3]] for s in picked]}


def format_table(results: list[dict]) -> str:
    """The results as a Markdown table, one column per run; with several runs of one workload
    (a ``workload`` key, when present, is the same for all), a last row gives each run's
    throughput as a ratio to the first's."""
    def latency(r: dict, key: str) -> str:
        return (f"{format_ms(r[key]['mean'])} / {format_ms(r[key]['p90'])}" if r[key] else "-")

    rows = [("configuration", [r["name"] for r in results]),
            ("output tok/s", [f"{r['output_tokens_per_s']:.1f}" for r in results]),
            ("forward steps (TBO)", [f"{r['num_steps']} ({r['num_tbo_steps']})" for r in results]),
            ("spec (verify) steps", [f"{r.get('num_spec_steps', 0)}" for r in results]),
            ("prefill / mixed steps", [f"{r['num_prefill_steps']} / {r['num_mixed_prefill_steps']}"
                                       for r in results]),
            ("mixed-step fraction", [f"{r['mixed_step_fraction']:.3f}" for r in results]),
            ("prefill-step fraction", [f"{r['prefill_step_fraction']:.3f}" for r in results]),
            ("dummy-step fraction", [f"{r['dummy_step_fraction']:.3f}" for r in results]),
            ("hold rate (longest run)", [f"{r['hold_rate']:.3f} ({r['max_consecutive_holds']})"
                                         for r in results]),
            ("TTFT mean / p90", [latency(r, "ttft_ms") for r in results]),
            ("TPOT mean / p90", [latency(r, "tpot_ms") for r in results]),
            ("elapsed (s)", [f"{r['elapsed_s']:.1f}" for r in results])]
    if len(results) > 1 and len({r.get("workload") for r in results}) == 1:
        base = results[0]["output_tokens_per_s"] or 1.0
        rows.append((f"tok/s vs {results[0]['name']}",
                     [f"{r['output_tokens_per_s'] / base:.2f}x" for r in results]))
    return _markdown(rows)


def _markdown(rows: list[tuple[str, list[str]]]) -> str:
    """Rows of ``(label, values)`` as a Markdown table, values right-aligned."""
    width = max(len(label) for label, _ in rows)
    num_columns = len(rows[0][1])
    cols = [max(12, *(len(values[i]) for _, values in rows)) for i in range(num_columns)]
    return "\n".join(f"| {label:<{width}} | " + " | ".join(f"{v:>{c}}" for v, c in zip(values, cols))
                     + " |" for label, values in rows)


def format_sweep(results: list[dict]) -> str:
    """A sweep's results: per workload, its load per DP size, then a table with one row per
    run (DP size, policy, throughput and its ratio to the first policy's at the same DP size,
    step fractions, hold rate, TTFT p50 / p90, mean TPOT, elapsed, overloaded or not). Only
    runs of one workload and one DP size are compared; a row fits in 120 columns."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in results):
        runs = [r for r in results if r["workload"] == workload]
        first = {}
        for r in runs:
            first.setdefault(r["dp_size"], r)
        loads = "; ".join(f"DP {dp}: {r['num_requests']} requests"
                          + (f" at {r['arrival_rate_per_s']:.2f}/s"
                             if r.get("arrival_rate_per_s") else " at once")
                          for dp, r in first.items())
        baseline = runs[0]["prefill_policy"]
        header = ["DP", "policy", "tok/s", f"vs {baseline}"[:10], "mixed", "dummy",
                  "hold (run)", "TTFT p50", "TTFT p90", "TPOT", "elapsed", "overload"]
        rows = []
        for r in runs:
            base = first[r["dp_size"]]["output_tokens_per_s"] or 1.0
            ttft, tpot = r["ttft_ms"], r["tpot_ms"]
            rows.append([str(r["dp_size"]), r["prefill_policy"],
                         f"{r['output_tokens_per_s']:.1f}",
                         f"{r['output_tokens_per_s'] / base:.2f}x",
                         f"{r['mixed_step_fraction']:.3f}", f"{r['dummy_step_fraction']:.3f}",
                         f"{r['hold_rate']:.2f} ({r['max_consecutive_holds']})",
                         format_ms(ttft["p50"]) if ttft else "-",
                         format_ms(ttft["p90"]) if ttft else "-",
                         format_ms(tpot["mean"]) if tpot else "-",
                         f"{r['elapsed_s']:.1f} s",
                         "yes" if overload_note(r) else "no"])
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [*wrap(f"workload {workload} ({loads}); ratios vs {baseline} at the same "
                       f"DP size"),
                 "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
                 "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += ["| " + " | ".join(v.rjust(w) if i not in (1, 11) else v.ljust(w)
                                   for i, (v, w) in enumerate(zip(row, widths))) + " |"
                  for row in rows]
        out.append("\n".join(lines))
    note = ("overload yes: the wait for a first token grew more than "
            f"{OVERLOAD_TTFT_GROWTH} s per second of arrivals (requests came faster than the "
            "deployment served them; its latencies grow with the run's length)")
    if any(overload_note(r) for r in results):
        out.append("\n".join(wrap(note)))
    return "\n\n".join(out)
