"""Small helpers shared by the benchmark scripts (standard library only: the vLLM worker of
``bench_compare.py`` imports this in a venv without atom)."""

from __future__ import annotations

import json
import os
import pathlib

#: W1, the standard workload, shipped in the repository (``atom/data/w1_prompts.json``).
DEFAULT_DATASET = pathlib.Path(__file__).resolve().parents[1] / "atom" / "data" / "w1_prompts.json"


def write_json_report(path: pathlib.Path, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path`` (parents created) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def cpu_description() -> str:
    """The CPU's model name, core count and the SIMD flags our kernels care about."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines()
                  if l.startswith("model name")), "unknown CPU")
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), [])
    wanted = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
              if f in flags]
    return f"{model}, {os.cpu_count()} cores, flags {' '.join(wanted)}"
