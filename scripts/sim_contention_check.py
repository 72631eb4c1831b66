"""The contention term's two forms on run A's recorded data (docs/DP_EXPERIMENTS.md).

Until issue 39 a rank's compute was slowed by ``contention`` × the share of the other ranks
that computed at all in the step ("whole step"); now by the share of its compute the others
spend computing beside it ("overlap", :func:`atom.dp.sim.cost_model.overlap_shares`). Only run
A's profiles (the committed ones, fitted with the whole-step form) and real medians are kept,
not its calibration replays, so this script does not refit: the group fit is linear least
squares over the same tick-clocked replay's ticks, so it inverts it: the overlap-form
coefficients whose predictions, fitted with the whole-step form, give back the committed
profile's (on the fit's active columns; with expert parallelism the EP terms follow the same
way). That is what the calibration would have fitted if the overlap form were the truth. Then
the accuracy benchmark's four configurations are simulated both ways against run A's real
medians. Simulator only (seconds of CPU, any machine):

    python scripts/sim_contention_check.py
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np

from atom.dp.sim import default_profile_name, load_profile, simulate
from atom.dp.sim import cost_model
from atom.dp.sim.calibrate import _simulate_with_log, calibration_bursts
from atom.dp.sim.cost_model import Profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sim_accuracy import BASE, CONFIGS, METRICS, MOE, W  # noqa: E402  (the same runs)

OVERLAP = cost_model.overlap_shares
# run A's real medians (docs/DP_EXPERIMENTS.md): wall time s, mean TTFT ms, mean TPOT ms
REAL_A = {"dense, none": (13.5, 2779.0, 149.6), "dense, delayer": (15.2, 4787.0, 173.3),
          "EP, none": (32.1, 8784.6, 343.9), "EP, delayer": (31.8, 12174.8, 325.6)}


def whole_step(alone, busy):
    """The form before issue 39: every other rank that computes, for the whole step."""
    return [(sum(busy) - b) / max(1, len(alone) - 1) for b in busy]


def step_costs(config, coefficients, form, facts):
    cost_model.overlap_shares = form
    try:
        sim = _simulate_with_log(calibration_bursts(), config,  # run A's calibration workload
                                 Profile(coefficients, model_facts=facts))
        return [cost for _, cost in sim.step_log]
    finally:
        cost_model.overlap_shares = OVERLAP


def refit(profile: Profile, config) -> Profile:
    """The overlap-form coefficients the committed (whole-step) profile corresponds to."""
    c, facts = profile.coefficients, profile.model_facts
    group = dataclasses.replace(config, num_kv_blocks=config.num_kv_blocks or 64,
                                max_model_len=1024, enable_prefix_caching=False)
    grid = dataclasses.replace(c, compute_scale=1.0, contention=0.0, tick_s=0.0,
                               ep_fixed_s=0.0, ep_row_s=0.0)
    dense = dataclasses.replace(group, enable_expert_parallel=False)
    design = {form: np.array([[x.compute_s, x.compute_s * x.others_busy, 1.0]
                              for x in step_costs(dense, grid, form, facts)])
              for form in (whole_step, OVERLAP)}
    old = np.array([c.compute_scale, c.compute_scale * c.contention, c.tick_s])
    active = np.flatnonzero(old > 0)  # the columns the non-negative fit kept
    new = np.zeros(3)
    new[active] = np.linalg.solve(
        np.linalg.pinv(design[whole_step][:, active]) @ design[OVERLAP][:, active], old[active])
    out = dataclasses.replace(c, compute_scale=new[0], contention=new[1] / new[0], tick_s=new[2])
    if config.enable_expert_parallel:
        zero = dict(ep_fixed_s=0.0, ep_row_s=0.0)
        before = step_costs(group, dataclasses.replace(c, **zero), whole_step, facts)
        after = step_costs(group, dataclasses.replace(out, **zero), OVERLAP, facts)
        rows = np.array([[x.num_micro_batches * (x.max_num_tokens > 0),
                          x.num_micro_batches * x.max_num_tokens * (config.data_parallel_size - 1)]
                         for x in before])
        shift = np.array([x.total_s for x in after]) - np.array([x.total_s for x in before])
        ep = np.array([c.ep_fixed_s, c.ep_row_s]) - np.linalg.pinv(rows) @ shift
        out = dataclasses.replace(out, ep_fixed_s=float(ep[0]), ep_row_s=float(ep[1]))
    return dataclasses.replace(profile, coefficients=out)


def main() -> int:
    requests = W.dp_experiment()
    print("| configuration | metric | real (run A) | whole step (committed profile) | "
          "overlap (refitted) |")
    print("|---|---|---:|---:|---:|")
    within = {"whole step": 0, "overlap": 0}
    for model in ("dense", "EP"):
        config = dataclasses.replace(BASE, **(MOE if model == "EP" else {}))
        profile = load_profile(default_profile_name(config))
        fitted = refit(profile, config)
        a, b = profile.coefficients, fitted.coefficients
        print(f"<!-- {model}: compute_scale {a.compute_scale:.3f} -> {b.compute_scale:.3f}, "
              f"contention {a.contention:.3f} -> {b.contention:.3f}, tick_s "
              f"{a.tick_s * 1e3:.1f} -> {b.tick_s * 1e3:.1f} ms, ep_fixed_s "
              f"{a.ep_fixed_s * 1e3:.1f} -> {b.ep_fixed_s * 1e3:.1f} ms, ep_row_s "
              f"{a.ep_row_s * 1e3:.3f} -> {b.ep_row_s * 1e3:.3f} ms -->")
        for name in (n for n in CONFIGS if n.startswith(model)):
            run_config = dataclasses.replace(BASE, **CONFIGS[name])
            cost_model.overlap_shares = whole_step
            try:
                before = simulate(requests, run_config, profile, name=name)
            finally:
                cost_model.overlap_shares = OVERLAP
            after = simulate(requests, run_config, fitted, name=name)
            for (label, get), real in zip(METRICS, REAL_A[name]):
                errors = get(before) / real - 1, get(after) / real - 1
                within["whole step"] += abs(errors[0]) <= 0.15
                within["overlap"] += abs(errors[1]) <= 0.15
                print(f"| {name} | {label} | {real:.1f} | {errors[0]:+.1%} | {errors[1]:+.1%} |")
    print(f"within 15 %: whole step {within['whole step']} of 12, overlap {within['overlap']} "
          "of 12")
    return 0


if __name__ == "__main__":
    sys.exit(main())
