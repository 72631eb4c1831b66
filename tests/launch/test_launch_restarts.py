"""``atom launch --max-restarts`` in one process: the flag and its validation, what each start
of the group gets in its environment and where it logs, when a failed group is started again,
and how the front end that outlives the restarts is stopped at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from atom.dp.groups import RankInfo
from atom.launch import restarts
from atom.launch.launcher import LaunchConfig, parse_config, worker_specs
from atom.launch.supervisor import Outcome
from atom.launch.workers import WorkerFailure

FAILURE = WorkerFailure(rank=1, node_rank=0, pid=123, exit_code=-9, details="")


def test_flag_and_validation():
    assert parse_config(["--max-restarts", "2", "serve"]).max_restarts == 2
    assert parse_config(["serve"]).max_restarts == 0
    with pytest.raises(ValueError, match="must be 0 or more"):
        LaunchConfig(command=("serve",), max_restarts=-1)
    with pytest.raises(ValueError, match="needs a single node"):
        LaunchConfig(command=("serve",), nnodes=2, node_rank=0, master_port=29500,
                     max_restarts=1)


def test_each_start_has_its_count_and_its_own_logs(tmp_path):
    config = LaunchConfig(command=("serve",), nproc_per_node=2, max_restarts=1)
    first, second = (worker_specs(config, master_port=1, log_dir=str(tmp_path),
                                  restart_count=k) for k in (0, 1))
    info = RankInfo.from_env(second[1].env)
    assert (info.restart_count, info.max_restarts) == (1, 1)
    assert RankInfo.from_env(first[0].env).restart_count == 0
    assert second[0].env["ATOM_FRONT_END_PID_FILE"] == str(tmp_path / "front_end.pid")
    assert [os.path.basename(s.log_path) for s in first + second] == [
        "rank0.stderr.log", "rank1.stderr.log", "rank0.restart1.stderr.log",
        "rank1.restart1.stderr.log"]
    plain = worker_specs(LaunchConfig(command=("serve",)), master_port=1, log_dir=str(tmp_path))
    assert "TORCHELASTIC_RESTART_COUNT" not in plain[0].env  # no restarts: nothing new


def test_a_rank_failure_restarts_while_restarts_and_the_front_end_are_left(tmp_path):
    log_dir = str(tmp_path)
    failed = Outcome(failure=FAILURE)
    assert restarts.should_restart(failed, restart_count=0, max_restarts=1, log_dir=log_dir)
    assert not restarts.should_restart(failed, restart_count=1, max_restarts=1, log_dir=log_dir)
    assert not restarts.should_restart(Outcome(failure=FAILURE, signal=signal.SIGTERM),
                                       restart_count=0, max_restarts=1, log_dir=log_dir)
    assert not restarts.should_restart(Outcome(), restart_count=0, max_restarts=1,
                                       log_dir=log_dir)
    (tmp_path / "front_end.pid").write_text(f"{os.getpid()}\n")  # a front end that runs
    assert restarts.should_restart(failed, restart_count=0, max_restarts=1, log_dir=log_dir)
    (tmp_path / "front_end.pid").write_text("999999999\n")  # one that has exited
    assert not restarts.should_restart(failed, restart_count=0, max_restarts=1, log_dir=log_dir)


def test_the_front_end_is_stopped_at_the_end(tmp_path):
    front_end = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
    (tmp_path / "front_end.pid").write_text(f"{front_end.pid}\n")
    try:
        assert restarts.front_end_pid(str(tmp_path)) == front_end.pid
        restarts.stop_front_end(str(tmp_path), clean=False, term_timeout_s=10.0)
        assert front_end.wait(10) == -signal.SIGTERM
        assert restarts.front_end_pid(str(tmp_path)) is None
        restarts.stop_front_end(str(tmp_path), clean=True, term_timeout_s=1.0)  # gone: no-op
    finally:
        front_end.kill()
