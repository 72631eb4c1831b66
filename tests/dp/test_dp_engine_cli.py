"""``atom generate --data-parallel-size 2`` prints the same greedy text as one rank."""

from __future__ import annotations

import pathlib
import subprocess
import sys



ATOM = str(pathlib.Path(sys.executable).parent / "atom")
ARGS = ["generate", "--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1",
        "--max-tokens", "8", "--temperature", "0",
        "--prompt", "Hello, my name is", "--prompt", "The capital of France is"]


def _run(*extra: str) -> str:
    proc = subprocess.run([ATOM, *ARGS, *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_generate_dp2_matches_one_rank():
    dp = _run("--data-parallel-size", "2", "--dp-load-balance", "round_robin")
    assert dp.strip() and dp == _run()
