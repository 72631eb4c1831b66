"""Time accuracy of the simulator: ``scripts/dp_experiment.py``'s workload replayed
time-clocked (seconds) on real 2-rank deployments, 3 runs each, against the simulator with
this machine's calibration profile, plus the ablation (the cost model without the
slowest-rank rule: the mean rank instead; without the dummy batches' cost; without the
ranks' contention for the shared memory).

Configurations: the dense model and model (a) with its experts over the ranks (expert
parallelism), the prefill policy off (``none``) and on (``delayer``). Metrics: the wall time
from the first arrival to the last finish, mean TTFT and mean TPOT; error = simulated ÷
median of the real runs − 1. Step counters are printed beside them (time-clocked, so the real
runs' counts move with the machine's speed; the exact step-for-step comparison is the
tick-clocked test, tests/dp/sim/test_sim_parity.py).

    python scripts/sim_accuracy.py                       # the committed profiles
    python scripts/sim_accuracy.py --calibrate           # calibrate each model first

Other processes on the machine, or the host under a VM, change the real runs' speed, and the
model cannot know it: the load average is printed before and after, and the machine's speed is
probed before the first run of a configuration and after each
(:func:`atom.dp.sim.calibrate.machine_speed`: three calibration grid points timed again, ÷
their calibration seconds; 1.2 = 20 % slower). "Error at the calibration's speed" divides each
real run's metric by its speed (the mean of the probes around it) before the median: the
model's error with the machine's drift taken out, to first order (a TTFT's queueing does not
scale exactly with the step time). The JSON (``--output-json``) keeps every run and probe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys

from atom.config import EngineConfig
from atom.dp.sim import default_profile_name, load_profile, simulate
from atom.dp.sim import workload as W
from atom.dp.sim.calibrate import machine_info, machine_speed
from atom.dp.sim.replay import run_real

BASE = EngineConfig(data_parallel_size=2, dtype="float32", num_threads=1, num_kv_blocks=32,
                    max_num_seqs=8, max_model_len=1024, enable_prefix_caching=False)
MOE = dict(moe_split_experts=4, enable_expert_parallel=True)
# configuration name (MODEL-POLICY: one shell word each, for --configs) -> its options
CONFIGS = {"dense-none": dict(prefill_policy="none"),
           "dense-delayer": dict(prefill_policy="delayer"),
           "ep-none": dict(prefill_policy="none", **MOE),
           "ep-delayer": dict(prefill_policy="delayer", **MOE)}
METRICS = (("wall time (s)", lambda r: r["elapsed_s"]),
           ("mean TTFT (ms)", lambda r: r["ttft_ms"]["mean"]),
           ("mean TPOT (ms)", lambda r: r["tpot_ms"]["mean"]))
# the error with each real run's metric divided by the machine's speed then (machine_speed)
AT_SPEED = "error at the calibration's speed"
# the ablation: simulate() options, and the coefficients set to 0
VARIANTS = {"model": ({}, ()), "no slowest-rank rule": ({"slowest_rank": False}, ()),
            "no dummy cost": ({"dummy_cost": False}, ()),
            "no contention": ({}, ("contention",))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="the configurations to measure: model (dense, or ep: model (a) with "
                        "its experts over the ranks) and prefill policy")
    p.add_argument("--runs", type=int, default=3, help="real runs per configuration")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate this machine (each model just before its real runs) instead "
                        "of reading the committed profiles")
    p.add_argument("--profile-dir", default="results/sim_accuracy_profiles",
                   help="with --calibrate: where the fresh profiles go")
    p.add_argument("--output-json", default="results/sim_accuracy.json")
    p.add_argument("--trace-dir", help="keep each real run's per-tick trace "
                   "(--dp-trace) in TRACE_DIR/<configuration>/run<i>")
    return p.parse_args(argv)


def profile_for(model: str, args: argparse.Namespace):
    """The profile of ``model`` ("dense" or "EP"): fresh with ``--calibrate`` (measured right
    before that model's real runs, so the machine's speed has little time to drift), else the
    committed one."""
    config = dataclasses.replace(BASE, **(MOE if model == "EP" else {}))
    if not args.calibrate:
        return load_profile(default_profile_name(config))
    from atom.dp.sim.calibrate import calibrate

    print(f"calibrating ({model}) ...", file=sys.stderr, flush=True)
    profile = calibrate(config)
    folder = pathlib.Path(args.profile_dir)
    folder.mkdir(parents=True, exist_ok=True)
    profile.save(folder / f"{model}.json")
    return profile


def without(profile, names: tuple[str, ...]):
    """``profile`` with the coefficients ``names`` set to 0."""
    coefficients = dataclasses.replace(profile.coefficients, **{n: 0.0 for n in names})
    return dataclasses.replace(profile, coefficients=coefficients)


def measure(name: str, args: argparse.Namespace, profile) -> dict:
    config = dataclasses.replace(BASE, **CONFIGS[name])
    requests = W.dp_experiment()
    real, probes = [], [machine_speed(config, profile)]
    for i in range(args.runs):
        print(f"{name}: real run {i + 1} of {args.runs} ...", file=sys.stderr, flush=True)
        trace = None
        if args.trace_dir:
            trace = str(pathlib.Path(args.trace_dir) / name / f"run{i + 1}")
        real.append(run_real(requests, dataclasses.replace(config, dp_trace=trace), name=name))
        probes.append(machine_speed(config, profile))
    # each run's speed: the mean of the probes just before and just after it
    speeds = [(a + b) / 2 for a, b in zip(probes, probes[1:])]
    sims = {variant: simulate(requests, config, without(profile, zeroed), name=name, **options)
            for variant, (options, zeroed) in VARIANTS.items()}
    rows = []
    for label, get in METRICS:
        values = [get(r) for r in real]
        median = statistics.median(values)
        at_speed = statistics.median(v / s for v, s in zip(values, speeds))
        rows.append({"metric": label, "real": values, "real_median": median,
                     **{variant: get(sim) for variant, sim in sims.items()},
                     **{f"error, {variant}": get(sim) / median - 1 for variant, sim in
                        sims.items()},
                     AT_SPEED: get(sims["model"]) / at_speed - 1})
    steps = {"real": [r["num_steps"] for r in real], "sim": sims["model"]["num_steps"],
             "real mixed": [r["num_mixed_prefill_steps"] for r in real],
             "sim mixed": sims["model"]["num_mixed_prefill_steps"]}
    return {"config": name, "rows": rows, "steps": steps, "real_runs": real,
            "machine_speed_probes": probes, "machine_speed_by_run": speeds,
            "sim": sims["model"]}


def print_table(results: list[dict]) -> None:
    ablations = [v for v in VARIANTS if v != "model"]
    print("| configuration | metric | real (median of runs; all) | simulated | error | "
          "error at the calibration's speed | "
          + " | ".join(f"error without {v.removeprefix('no ')}" for v in ablations) + " |")
    print("|---" * (6 + len(ablations)) + "|")
    for result in results:
        for row in result["rows"]:
            runs = ", ".join(f"{v:.0f}" if v > 100 else f"{v:.1f}" for v in row["real"])
            print(f"| {result['config']} | {row['metric']} | {row['real_median']:.1f} ({runs}) | "
                  f"{row['model']:.1f} | {row['error, model']:+.1%} | "
                  f"{row[AT_SPEED]:+.1%} | "
                  + " | ".join(f"{row[f'error, {v}']:+.1%}" for v in ablations) + " |")
    for result in results:
        s = result["steps"]
        probes = ", ".join(f"{v:.2f}" for v in result["machine_speed_probes"])
        print(f"{result['config']}: forward steps real {s['real']} vs simulated {s['sim']}; "
              f"mixed {s['real mixed']} vs {s['sim mixed']}; machine speed probes "
              f"(seconds ÷ the calibration's, around the runs) {probes}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    chosen, results = {}, []
    for name in args.configs:
        model = "EP" if name.startswith("ep-") else "dense"
        if model not in chosen:
            chosen[model] = profile_for(model, args)
        results.append(measure(name, args, chosen[model]))
    load_after = os.getloadavg()
    print(f"machine: {machine_info(1)}; load average before {load_before[0]:.1f}, after "
          f"{load_after[0]:.1f}")
    print_table(results)
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load_average": [load_before, load_after],
                               "profiles": {k: p.to_json() for k, p in chosen.items()},
                               "results": results}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
