"""The DP engine under a launcher: ``atom launch`` (2 ranks on one node, and 2 nodes × 1 rank
over loopback) and ``torchrun`` running ``atom generate`` as two ranks (rank 0's child is the
front end), greedy text equal to one rank's; a killed rank ends every process (front end
included) with a report naming it; a rank that skips a collective inside the DP loop makes every
process exit with the collective histories, not hang.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from atom.dp.sync import BATCH_SHAPE_VECTOR_LEN, CONTROL_VECTOR_LEN
from tests.utils import launcher_env


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
    proc = _run([str(BIN / "atom"), "launch", "--nproc-per-node", "2", SKIPPING, *GENERATE,
                 "--dp-group-timeout-s", "10"], ATOM_TEST_SKIP_TICK="3")
    assert proc.returncode != 0
    assert proc.stdout == ""
    err = proc.stderr
    assert "CollectiveError" in err and "out of step" in err, err[-3000:]
    # the histories of both ranks, with the first differing collective marked
    pattern = (rf"! #\d+\s+all_gather int64\[{BATCH_SHAPE_VECTOR_LEN}\]\s+"
               rf"all_gather int64\[{CONTROL_VECTOR_LEN}\]")
    assert re.search(pattern, err), err[-3000:]
    assert re.search(r"rank \d \(node 0, pid \d+\) failed with exit code 1", err), err[-3000:]


def test_two_nodes_one_rank_each_over_loopback(one_rank_text):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    node = [str(BIN / "atom"), "launch", "--nnodes", "2", "--master-addr", "127.0.0.1",
            "--master-port", port, "--nproc-per-node", "1"]
    node1 = subprocess.Popen([*node, "--node-rank", "1", *GENERATE], cwd=REPO,
                             env=launcher_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node0 = _run([*node, "--node-rank", "0", *GENERATE])
        out1, err1 = node1.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        node1.kill()
    assert node0.returncode == 0 and node1.returncode == 0, (node0.stderr[-3000:], err1[-3000:])
    assert node0.stdout == one_rank_text and out1 == ""  # the front end runs on node 0
    ticks = dict(TICKS.findall(node0.stderr + err1))
    assert set(ticks) == {"0", "1"} and ticks["0"] == ticks["1"], ticks


def _descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)],
                                  capture_output=True, text=True).stdout.split()
        frontier += [int(c) for c in children]
        found.update(int(c) for c in children)
    return found


def test_killed_rank_ends_every_process_with_a_report_naming_it():
    cmd = [str(BIN / "atom"), "launch", "--nproc-per-node", "2", *GENERATE[:-6],
           "--prompt", "Tell me a long story.", "--max-tokens", "4000", "--ignore-eos",
           "--max-model-len", "4096", "--num-kv-blocks", "300"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    watchdog = threading.Timer(RUN_TIMEOUT_S, os.killpg, (launcher.pid, signal.SIGKILL))
    watchdog.start()  # liveness: the stderr read below must not block the suite forever
    try:
        lines = []
        for line in launcher.stderr:  # both ranks are stepping once rank 1 logs its groups
            lines.append(line)
            if "[dp1] process groups ready" in line:
                break
        processes = _descendants(launcher.pid)  # 2 ranks + the front end
        assert len(processes) >= 3, "".join(lines)
        ranks = [p for p in processes if _env_of(p).get("RANK") == "1"
                 and "ATOM_FRONT_END_FD" not in _env_of(p)]
        assert len(ranks) == 1, processes
        time.sleep(1.0)  # let the ranks run a few ticks
        killed_at = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 30, "processes outlived the 30 s limit"
    finally:
        watchdog.cancel()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0
    assert re.search(r"rank 1 \(node 0, pid \d+\) failed with exit code -9 \(SIGKILL", err), err
    left = [p for p in processes if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
    assert not left, f"processes left behind: {left}"


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"
