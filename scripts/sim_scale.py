"""Scale of the simulator: 10,000 requests at DP = 32 (the bursty workload sized for 32 ranks:
bursts of 128 requests every 2 s, prompts of 64-512 tokens, 16-256 output tokens), the
delayer, the committed dense profile, one process (one core). Prints the host's wall-clock
and CPU seconds (the CPU seconds reproduce on shared cores; the wall clock includes the time
other processes took), the ticks and CPU µs per tick, the simulated seconds and their ratio to
the CPU seconds; writes JSON.

    python scripts/sim_scale.py
    python scripts/sim_scale.py --num-requests 2000 --dp-size 8 --policy coalescer
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from atom.config import EngineConfig
from atom.dp.sim import simulate
from atom.dp.sim import workload as W
from atom.dp.sim.calibrate import machine_info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--dp-size", type=int, default=32)
    p.add_argument("--policy", default="delayer")
    p.add_argument("--profile", help="default: the committed profile for the model")
    p.add_argument("--output-json", default="results/sim_scale.json")
    args = p.parse_args(argv)
    requests = W.scaled("bursty", dp_size=args.dp_size, num_requests=args.num_requests)
    config = EngineConfig(data_parallel_size=args.dp_size, prefill_policy=args.policy,
                          dtype="float32")
    load_before = os.getloadavg()[0]
    result = simulate(requests, config, args.profile, name=f"{args.num_requests} requests, "
                      f"DP {args.dp_size}, {args.policy}")
    sim = result["sim"]
    print(f"{args.num_requests} requests at DP {args.dp_size} ({args.policy}): "
          f"{sim['num_ticks']} ticks, {result['num_output_tokens']} output tokens")
    print(f"host: {sim['host_s']:.1f} s wall clock, {sim['cpu_s']:.1f} s CPU "
          f"({sim['cpu_us_per_tick']:.0f} CPU µs per tick); simulated {sim['simulated_s']:.0f} s "
          f"= {sim['simulated_to_cpu']:.1f}x the CPU time")
    print(f"machine: {machine_info(1)['cpu']}; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.pop("timeline")
    out.write_text(json.dumps({"args": vars(args), "load_average": [load_before,
                                                                     os.getloadavg()[0]],
                               "result": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
