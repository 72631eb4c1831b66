"""Run results: the metrics and step counters of ``scripts/dp_experiment.py``, for real and
simulated runs alike, as one JSON-ready dict per run, and the table that prints them.

Keys (both kinds of run): ``name``, ``prefill_policy``, ``num_requests``,
``num_output_tokens``, ``elapsed_s`` (first arrival to last finish), ``output_tokens_per_s``,
the group's step counters (``num_steps``, ``num_prefill_steps``, ``num_mixed_prefill_steps``,
``num_tbo_steps``; ``num_dummy_steps`` summed over the ranks) and their fractions, the prefill
policy's counters (``hold_rate``, ``max_consecutive_holds``, ``prefill_policy_stats``),
``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` summaries (mean, p50, p90, p99) and ``per_rank``. A
simulated run adds ``sim`` (ticks; wall-clock and CPU seconds of the host; CPU µs per tick;
simulated seconds and their ratio to the CPU seconds) and ``timeline`` (per-rank load and KV usage over time, at most
:data:`MAX_TIMELINE_POINTS` points).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MAX_TIMELINE_POINTS = 500


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
        **step_metrics(counters, num_ranks=num_ranks, policy_stats=sim.decider.stats()),
        **latency_metrics(ttft_s=ttft, tpot_s=tpot, itl_s=itl),
        "per_rank": _per_rank(sim),
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
    """The results as a Markdown table, one column per run (the first is the baseline of the
    last row's throughput ratio)."""
    def cell(r: dict, key: str, stat: str) -> str:
        return f"{r[key][stat]:.0f}" if r[key] else "-"

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
            ("TTFT mean / p90 (ms)", [f"{cell(r, 'ttft_ms', 'mean')} / {cell(r, 'ttft_ms', 'p90')}"
                                      for r in results]),
            ("TPOT mean / p90 (ms)", [f"{cell(r, 'tpot_ms', 'mean')} / {cell(r, 'tpot_ms', 'p90')}"
                                      for r in results]),
            ("elapsed (s)", [f"{r['elapsed_s']:.1f}" for r in results])]
    base = results[0]["output_tokens_per_s"] or 1.0
    rows.append((f"tok/s vs {results[0]['name']}",
                 [f"{r['output_tokens_per_s'] / base:.2f}x" for r in results]))
    width = max(len(label) for label, _ in rows)
    cols = [max(12, *(len(values[i]) for _, values in rows)) for i in range(len(results))]
    return "\n".join(f"| {label:<{width}} | " + " | ".join(f"{v:>{c}}" for v, c in zip(values, cols))
                     + " |" for label, values in rows)
