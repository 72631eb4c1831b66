"""The front end's start-up: an ``LLM`` over its spawned engine-core process, from the first import
to ready (wall seconds), and what the front-end process itself spent (CPU seconds, peak RSS,
whether torch was loaded). The engine-core process loads the model meanwhile, so the wall time
includes it; the CPU and RSS are the front end's own.

``--baseline-checkout PATH`` measures another checkout of atom (e.g. ``git worktree add
/tmp/old <rev>``) in the same run, rounds alternating: its front end runs from PATH (this
venv's packages; its engine core from this checkout, through the editable install, since the
front end's start is what is compared).

    .venv/bin/python scripts/bench_front_end_start.py --rounds 3 [--baseline-checkout /tmp/old]
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import statistics
import subprocess
import sys

_MEASURE = """
import resource, sys, time
t0 = time.perf_counter()
from atom import LLM
llm = LLM(max_model_len=128, num_kv_blocks=8, block_size=16)
ready_s = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print({"ready_wall_s": ready_s, "front_end_cpu_s": ru.ru_utime + ru.ru_stime,
       "front_end_max_rss_mib": ru.ru_maxrss / 1024, "torch_loaded": "torch" in sys.modules})
llm.shutdown()
"""

# run from another checkout: drop the editable finder, map atom.dp / .kernels / .launch there
_FROM_CHECKOUT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
sys.path.insert(0, {path!r})
import atom
atom.__path__.append({path!r})
"""


def measure(checkout: str | None) -> dict:
    code = (_FROM_CHECKOUT.format(path=checkout) if checkout else "") + _MEASURE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/tmp", check=True)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-checkout", default=None)
    parser.add_argument("--output-json", default="results/bench_front_end_start.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"this": []}
    if args.baseline_checkout:
        runs["baseline"] = []
    for _ in range(args.rounds):
        for name in runs:
            runs[name].append(measure(args.baseline_checkout if name == "baseline" else None))
    print(f"{'checkout':<10}{'ready wall s':>14}{'front-end CPU s':>17}{'RSS MiB':>9}  torch")
    summary = {}
    for name, rows in runs.items():
        summary[name] = {k: statistics.median(r[k] for r in rows)
                         for k in ("ready_wall_s", "front_end_cpu_s", "front_end_max_rss_mib")}
        summary[name]["torch_loaded"] = any(r["torch_loaded"] for r in rows)
        s = summary[name]
        print(f"{name:<10}{s['ready_wall_s']:>14.2f}{s['front_end_cpu_s']:>17.2f}"
              f"{s['front_end_max_rss_mib']:>9.0f}  {s['torch_loaded']}")
    if "baseline" in summary:
        ratio = summary["baseline"]["front_end_cpu_s"] / summary["this"]["front_end_cpu_s"]
        print(f"front-end CPU: the baseline's is {ratio:.2f}x this checkout's")
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, "median": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
