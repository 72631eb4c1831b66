"""The launcher on real processes: ``python -m atom.launch`` (and torchrun) running ``worker.py``.

World size 2 throughout, one torch thread per rank, the store on an ephemeral port. The failure
tests leave the healthy ranks blocked on a store key nobody sets (for far longer than any
deadline here), so only the launcher can end them; liveness deadlines are generous on purpose
(2 shared cores), and nothing waits on a sleep.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import launcher_env


REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
RUN_DEADLINE_S = 90  # a whole launcher run, start-up included (a hang fails the test here)
EXIT_WITHIN_S = 30  # after a rank fails, every process must be gone within this
GONE_WITHIN_S = 5  # a SIGKILLed grandchild (not the launcher's child) must vanish within this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_launcher(tmp_path: Path, *opts: str, env: dict[str, str], name: str = "node0",
                    own_log_dir: bool = False, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``own_log_dir``: no --log-dir (the launcher makes a temporary one); ``extra_args`` go
    after the worker's own (it ignores them)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    log_dir = () if own_log_dir else ("--log-dir", str(tmp_path / name))
    cmd = [sys.executable, "-m", "atom.launch", *opts, *log_dir,
           "--", str(WORKER), str(out), *extra_args]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def _finish(proc: subprocess.Popen, deadline: float) -> tuple[int, str, str]:
    """Wait for a launcher; on a hang kill its group and fail with what it printed."""
    try:
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired as e:
        err = e.stderr or b""
        try:  # let the launcher clean up (SIGTERM), then force it
            proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=15)[1]
        except subprocess.TimeoutExpired as e2:
            err = e2.stderr or err
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                err = proc.communicate(timeout=5)[1]
            except subprocess.TimeoutExpired:  # something left behind still holds the pipes
                proc.stdout.close()
                proc.stderr.close()
        pytest.fail(f"the launcher (exit code {proc.poll()}) or a process it started did not "
                    f"exit in time\n{err.decode()[-6000:]}")
    return proc.returncode, out.decode(), err.decode()


def _results(tmp_path: Path, world_size: int = 2) -> list[dict]:
    return [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())
            for r in range(world_size)]


def _pids(tmp_path: Path, pattern: str) -> list[int]:
    return [int(p.read_text()) for p in sorted((tmp_path / "out").glob(pattern))]


def _is_gone(pid: int) -> bool:
    """No such process, or only its zombie (dead; waiting for a parent that may never reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _assert_all_gone(pids: list[int]) -> None:
    # SIGKILL is delivered asynchronously to processes that are not our children, so this is a
    # bounded liveness check, not synchronization: it returns as soon as all are gone.
    deadline = time.monotonic() + GONE_WITHIN_S
    while not all(_is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [p for p in pids if not _is_gone(p)]
    assert not alive, f"processes left behind: {alive}"


def _assert_gathered_ranks(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["world_size"] == 2
        assert [row[0] for row in r["gathered"]] == [0, 1]
        assert r["endpoints"] == ["tcp://127.0.0.1:40000", "tcp://127.0.0.1:40001"]
        assert r["rank_env_present"]


def test_two_ranks_on_one_node(tmp_path):
    env = launcher_env()
    del env["OMP_NUM_THREADS"]  # the launcher picks cores ÷ local ranks
    proc = _start_launcher(tmp_path, "--nproc-per-node", "2", env=env)
    rc, _, err = _finish(proc, time.monotonic() + RUN_DEADLINE_S)
    assert rc == 0, err
    results = _results(tmp_path)
    _assert_gathered_ranks(results)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for local_rank, r in enumerate(results):
        assert r["local_rank"] == local_rank and r["local_world_size"] == 2
        assert r["node_rank"] == "0" and r["launcher_pid"]
        assert not r["torchrun_run_id"]
        assert r["omp_num_threads"] == str(threads) and r["torch_threads"] == threads
    assert "all 2 ranks exited cleanly" in err


def test_two_nodes_one_rank_each_over_loopback(tmp_path):
    port = str(_free_port())
    common = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    deadline = time.monotonic() + RUN_DEADLINE_S
    node1 = _start_launcher(tmp_path, *common, "--node-rank", "1", env=launcher_env(), name="node1")
    node0 = _start_launcher(tmp_path, *common, "--node-rank", "0", env=launcher_env(), name="node0")
    (rc0, _, err0), (rc1, _, err1) = _finish(node0, deadline), _finish(node1, deadline)
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    results = _results(tmp_path)
    _assert_gathered_ranks(results)
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in results] == [
        ("0", 0, 1), ("1", 0, 1)]


@pytest.mark.parametrize("mode, exit_code, status, details", [
    ("exit", 3, "exit code 3", "rank failing on purpose (exit)"),
    ("raise", 1, "exit code 1", "RuntimeError: injected failure for the launcher test"),
    ("abort", 1, "exit code -6 (SIGABRT: gloo aborts a rank on a collective size mismatch",
     "Fatal Python error: Aborted"),
], ids=["exit3", "raise", "abort"])
def test_a_failing_rank_stops_every_rank_and_is_reported(tmp_path, mode, exit_code, status,
                                                         details):
    """Rank 1 fails; rank 0 waits where no error reaches it. In the exit3 case rank 0 also
    ignores SIGTERM, so the launcher must escalate to SIGKILL after --term-timeout-s."""
    ignore_sigterm = mode == "exit"
    env = launcher_env(ATOM_TEST_FAIL_RANK="1", ATOM_TEST_FAIL_MODE=mode,
               ATOM_TEST_IGNORE_SIGTERM="1" if ignore_sigterm else "0")
    proc = _start_launcher(tmp_path, "--nproc-per-node", "2", "--term-timeout-s", "2", env=env)
    rc, _, err = _finish(proc, time.monotonic() + RUN_DEADLINE_S)
    ended = time.time()
    assert rc == exit_code, err
    fail_time = float((tmp_path / "out" / "rank1.fail_time").read_text())
    assert ended - fail_time < EXIT_WITHIN_S
    report = err[err.index("[atom.launch] rank 1 (node 0, pid"):]
    assert f"failed with {status}" in report.splitlines()[0]
    assert details in report
    if mode == "raise":  # the traceback comes from the error file, not stderr's last lines
        assert "Traceback (most recent call last):" in report and 'in _fail' in report
    # the healthy rank was stopped by the launcher: SIGTERM, or SIGKILL when it ignores that
    assert f"exit codes: rank 0: {-9 if ignore_sigterm else -15}, rank 1: " in report
    assert str(tmp_path / "node0" / "rank1.stderr.log") in report
    assert details in (tmp_path / "node0" / "rank1.stderr.log").read_text()
    assert not (tmp_path / "out" / "rank0.json").exists()
    _assert_all_gone(_pids(tmp_path, "rank[0-9].pid"))


def test_a_failing_rank_on_one_node_stops_the_other_node(tmp_path):
    port = str(_free_port())
    common = ("--nnodes", "2", "--master-port", port)
    env = launcher_env(ATOM_TEST_FAIL_RANK="1", ATOM_TEST_FAIL_MODE="exit")
    deadline = time.monotonic() + RUN_DEADLINE_S
    node0 = _start_launcher(tmp_path, *common, "--node-rank", "0", env=env, name="node0")
    node1 = _start_launcher(tmp_path, *common, "--node-rank", "1", env=env, name="node1")
    (rc0, _, err0), (rc1, _, err1) = _finish(node0, deadline), _finish(node1, deadline)
    ended = time.time()
    assert rc1 == 3 and "rank 1 (node 1, pid" in err1, err1
    assert rc0 == 3, err0
    assert "stopped because another node stopped: rank 1 (node 1, pid" in err0
    assert "exit code 3" in err0 and "exit codes: rank 0: -15" in err0
    assert ended - float((tmp_path / "out" / "rank1.fail_time").read_text()) < EXIT_WITHIN_S
    _assert_all_gone(_pids(tmp_path, "rank[0-9].pid"))


def _read_stdout_until(proc: subprocess.Popen, num_ready: int, deadline: float) -> str:
    """``proc``'s stdout until ``num_ready`` READY lines have arrived."""
    out = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while out.count(b"READY ") < num_ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                proc.send_signal(signal.SIGTERM)  # the launcher's own clean-up, if it lives
                _, _, err = _finish(proc, time.monotonic() + EXIT_WITHIN_S)
                pytest.fail(f"the ranks never got ready; stdout: {out!r}\n{err}")
            if sel.select(remaining):
                out += os.read(proc.stdout.fileno(), 4096)
    return out.decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_to_the_launcher_leaves_no_process_behind(tmp_path, sig):
    """Every rank runs a child of its own (like rank 0's front end); SIGTERM or Ctrl-C's SIGINT
    to the launcher must take down the ranks and their children."""
    proc = _start_launcher(tmp_path, "--nproc-per-node", "2", env=launcher_env(ATOM_TEST_BLOCK="1"),
                           own_log_dir=True, extra_args=("two words",))
    deadline = time.monotonic() + RUN_DEADLINE_S
    _read_stdout_until(proc, 2, deadline)
    pids = _pids(tmp_path, "rank[0-9].pid") + _pids(tmp_path, "rank[0-9].child.pid")
    assert len(pids) == 4
    proc.send_signal(sig)
    rc, _, err = _finish(proc, time.monotonic() + EXIT_WITHIN_S)
    assert rc == 128 + sig, err
    assert f"stopped by {sig.name}" in err
    _assert_all_gone(pids)
    # the echoed command keeps its quoting; a stop the user asked for leaves no log folder
    assert "'two words'" in err, err
    log_dir = re.search(r"logs (\S+)\): ", err).group(1)
    assert not Path(log_dir).exists(), log_dir


def test_under_torchrun_each_process_is_one_rank(tmp_path):
    (tmp_path / "out").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(WORKER), str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, env=launcher_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    rc, _, err = _finish(proc, time.monotonic() + RUN_DEADLINE_S)
    assert rc == 0, err
    results = _results(tmp_path)
    _assert_gathered_ranks(results)
    assert all(r["torchrun_run_id"] and not r["launcher_pid"] for r in results)


def test_default_command_is_an_atom_subcommand(tmp_path):
    cmd = [sys.executable, "-m", "atom.launch", "--log-dir", str(tmp_path), "--", "--help"]
    done = subprocess.run(cmd, env=launcher_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_DEADLINE_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: atom ")  # python -m atom.entrypoints.cli --help
