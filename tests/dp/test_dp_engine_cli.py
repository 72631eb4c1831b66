"""``atom generate --data-parallel-size 2`` prints the same greedy text as one rank; the README's
DP/EP command runs as pasted and ends with the ranks' summary line (issue 38)."""

from __future__ import annotations

import pathlib
import re
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


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
_SUMMARY = re.compile(r"atom: DP 2, EP 4 experts \(2 a rank\), TBO on; per rank: requests 1 / 1, "
                      r"steps (\d+) / \1, dummy \d+ / \d+, TBO (\d+) / \2; prefill policy "
                      r"delayer: \d+ holds \(hold rate \d\.\d\d, longest \d+ ticks\)")


def test_readme_dp_ep_command_runs_as_pasted_and_ends_with_its_summary_line():
    (command,) = [line for line in README.read_text().splitlines()
                  if line.startswith(".venv/bin/atom generate --data-parallel-size 2")]
    proc = subprocess.run(["bash", "-c", command], cwd=README.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("[1/2]\n") and "Paris" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    match = _SUMMARY.fullmatch(last)
    assert match, last
    assert int(match[2]) >= 1  # the prefill step ran as two micro-batches on both ranks
