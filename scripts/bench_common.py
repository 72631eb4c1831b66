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


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` line's value in ``/proc/cpuinfo`` (None: no such line / file)."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith(name)), None)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    return set((_cpuinfo_field("flags") or "").split())


def cpu_description() -> str:
    """The CPU's model name, core count and the SIMD flags our kernels care about."""
    model = _cpuinfo_field("model name") or "unknown CPU"
    flags = cpu_flags()
    wanted = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
              if f in flags]
    return f"{model}, {os.cpu_count()} cores, flags {' '.join(wanted)}"
