"""The DP engine under a launcher: ``atom launch`` and ``torchrun`` running ``atom generate`` as
two ranks (rank 0's child is the front end), greedy text equal to one rank's; a rank that skips
a collective inside the DP loop makes every process exit with the collective histories, not hang.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.utils import launcher_env

pytestmark = pytest.mark.xdist_group("multiproc")

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
SKIPPING = str(pathlib.Path(__file__).with_name("skip_collective_rank.py"))
GENERATE = ["generate", "--dtype", "float32", "--num-kv-blocks", "64", "--max-tokens", "10",
            "--temperature", "0", "--log-level", "INFO",
            "--prompt", "The capital of France is",
            "--prompt", "Write a short poem about the sea. It should rhyme and mention boats.",
            "--prompt", "1, 2, 3,"]
RUN_TIMEOUT_S = 240  # liveness only: a hang fails here instead of blocking the suite
TICKS = re.compile(r"\[dp(\d)\] every rank asked to shut down: exiting after (\d+) ticks")


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO,
                          env=launcher_env(**env), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def one_rank_text() -> str:
    proc = _run([str(BIN / "atom"), *GENERATE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
    return proc.stdout


def _assert_two_ranks_stepped_together(stderr: str) -> None:
    ticks = dict(TICKS.findall(stderr))
    assert set(ticks) == {"0", "1"}, stderr[-3000:]
    assert ticks["0"] == ticks["1"] and int(ticks["0"]) > 0, ticks


@pytest.mark.parametrize("launcher", ["atom launch", "torchrun"])
def test_generate_under_a_launcher_matches_one_rank(launcher, one_rank_text):
    prefix = ([str(BIN / "atom"), "launch", "--nproc-per-node", "2"] if launcher == "atom launch"
              else [str(BIN / "torchrun"), "--nproc-per-node", "2", "-m", "atom.entrypoints.cli"])
    proc = _run([*prefix, *GENERATE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == one_rank_text  # printed once, by the front end
    _assert_two_ranks_stepped_together(proc.stderr)


def test_rank_skipping_a_collective_in_the_dp_loop_stops_every_rank_with_the_histories():
    # rank 1 skips its 3rd batch-shape exchange: rank 0 waits in it on the device group while
    # rank 1 waits in the next control sync on the control group; nothing pairs, so both fail
    # at the group timeout with the collective histories, and the launcher stops everything.
    proc = _run([str(BIN / "atom"), "launch", "--nproc-per-node", "2", SKIPPING, *GENERATE],
                ATOM_TEST_SKIP_TICK="3", ATOM_DP_GROUP_TIMEOUT_S="10")
    assert proc.returncode != 0
    assert proc.stdout == ""
    err = proc.stderr
    assert "CollectiveError" in err and "out of step" in err, err[-3000:]
    # the histories of both ranks, with the first differing collective marked
    assert re.search(r"! #\d+\s+all_gather int64\[6\]\s+all_gather int64\[11\]", err), err[-3000:]
    assert re.search(r"rank \d \(node 0, pid \d+\) failed with exit code 1", err), err[-3000:]
