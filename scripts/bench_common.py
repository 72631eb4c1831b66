"""Small helpers shared by the benchmark scripts (standard library only: the vLLM worker of
``bench_compare.py`` imports this in a venv without atom)."""

from __future__ import annotations

import json
import pathlib

#: W1, the standard workload, shipped in the repository (``atom/data/w1_prompts.json``).
DEFAULT_DATASET = pathlib.Path(__file__).resolve().parents[1] / "atom" / "data" / "w1_prompts.json"


def write_json_report(path: pathlib.Path, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path`` (parents created) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
