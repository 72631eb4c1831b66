"""Launcher pieces in one process: config and env contract, error files, env helpers, endpoint
exchange and the launchers' store protocol (an in-process TCPStore on an ephemeral port)."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import io
import json
import signal
import sys
import threading

import pytest
import torch.distributed as dist

from atom.dp.groups import RankInfo, rendezvous_store
from atom.dp.rank_contract import hosts_store
from atom.launch import env as launch_env
from atom.launch.endpoints import endpoint_key, lookup_endpoint, publish_endpoint
from atom.launch.errors import read_error_file, record_errors, write_error_file
from atom.launch.launcher import CLI_MODULE, LaunchConfig, parse_config, worker_argv, worker_env
from atom.launch.rendezvous import LaunchStore, NodeWatch, StopRecord
from atom.launch.supervisor import Outcome, StopSignals, lost_node_record, wait_for_other_nodes
from atom.launch.workers import (
    WorkerFailure,
    WorkerProcess,
    WorkerSpec,
    describe_exit_code,
    exit_status,
)

# --- command line and env contract -------------------------------------------------------------


def test_parse_config_strips_the_separator_and_keeps_the_command_intact():
    cfg = parse_config(["--nproc-per-node", "2", "--", "generate", "--nproc-per-node", "3"])
    assert cfg.nproc_per_node == 2 and cfg.command == ("generate", "--nproc-per-node", "3")
    cfg = parse_config(["--nproc_per_node", "2", "--master_port", "29500", "w.py", "--", "x"])
    assert (cfg.master_port, cfg.command) == (29500, ("w.py", "--", "x"))


@pytest.mark.parametrize("kwargs, match", [
    ({"command": ()}, "no command given"),
    ({"nproc_per_node": 0}, "at least 1"),
    ({"node_rank": 1}, "--node-rank 1 must be in"),
    ({"nnodes": 2, "node_rank": 1}, "--master-port 0 leaves the other nodes"),
    ({"master_port": 70000}, "not a TCP port"),
    ({"term_timeout_s": 0}, "must be positive"),
])
def test_invalid_config_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(**{"command": ("generate",), **kwargs})


def test_bad_option_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--nnodes", "2", "generate"], prog="atom launch")
    assert exc.value.code == 2
    assert "atom launch: error: --master-port 0" in capsys.readouterr().err


def test_worker_argv_forms():
    assert worker_argv(LaunchConfig(command=("generate", "--prompt", "hi"))) == [
        sys.executable, "-m", CLI_MODULE, "generate", "--prompt", "hi"]
    assert worker_argv(LaunchConfig(command=("w.py", "a"))) == [sys.executable, "w.py", "a"]
    assert worker_argv(LaunchConfig(command=("echo", "a"), no_python=True)) == ["echo", "a"]


def test_worker_env_is_the_rank_contract():
    cfg = LaunchConfig(command=("generate",), nproc_per_node=2, nnodes=3, node_rank=1,
                       master_addr="10.0.0.1", master_port=29500)
    env = worker_env(cfg, local_rank=1, master_port=29500, error_path="/e", num_cpus=8,
                     base_env={"PATH": "/bin", "RANK": "stale"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
                                "OMP_NUM_THREADS", "ATOM_ERROR_FILE", "PATH")} == {
        "RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1", "NNODES": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": "4", "ATOM_ERROR_FILE": "/e", "PATH": "/bin"}
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    info = RankInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_world_size) == (3, 6, 2)
    assert env["ATOM_LAUNCHER_PID"] and "TORCHELASTIC_RUN_ID" not in env
    assert not hosts_store(info, env)  # the launcher hosts it: rank 0 too joins as a client
    # a user's OMP_NUM_THREADS wins; one core still gives every rank a thread
    assert worker_env(cfg, local_rank=0, master_port=1, error_path="/e", num_cpus=8,
                      base_env={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    assert worker_env(cfg, local_rank=0, master_port=1, error_path="/e", num_cpus=1,
                      base_env={})["OMP_NUM_THREADS"] == "1"


def test_rank_env_detection():
    contract = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                "MASTER_PORT": "1"}
    assert launch_env.rank_env_present(contract)
    assert not launch_env.rank_env_present({**contract, "MASTER_PORT": ""})
    assert not launch_env.rank_env_present({"ATOM_LAUNCHER_PID": "1"})  # no contract


def test_rank_0_hosts_the_store_without_an_agent():
    info = RankInfo(rank=0, world_size=2, local_rank=0, local_world_size=2,
                    master_addr="127.0.0.1", master_port=29500)
    assert hosts_store(info, {})
    assert not hosts_store(dataclasses.replace(info, rank=1, local_rank=1), {})
    assert not hosts_store(info, {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    with pytest.raises(ValueError, match="timeout_s"):
        rendezvous_store(info, timeout_s=0)


def test_exit_code_descriptions():
    assert describe_exit_code(3) == "exit code 3"
    abort = describe_exit_code(-signal.SIGABRT)
    assert abort.startswith("exit code -6 (SIGABRT: ") and "collective size mismatch" in abort
    assert "SIGKILL" in describe_exit_code(-9) and "out-of-memory" in describe_exit_code(-9)
    assert (exit_status(3), exit_status(-6)) == (3, 1)
    failure = WorkerFailure(rank=1, node_rank=0, pid=42, exit_code=-6, details="a\nb")
    text = failure.describe()
    assert text.startswith("rank 1 (node 0, pid 42) failed with exit code -6 (SIGABRT")
    assert text.endswith("\n  a\n  b")
    blank = WorkerFailure(rank=1, node_rank=0, pid=42, exit_code=-9, details="\n  \n",
                          log_path="/tmp/rank1.log").describe()  # a tail of blank lines
    assert blank.endswith("failed with " + describe_exit_code(-9) + "\n  its stderr: /tmp/rank1.log")


# --- error files -------------------------------------------------------------------------------


def test_error_file_round_trip_in_torchelastic_layout(tmp_path):
    path = str(tmp_path / "err.json")
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        assert write_error_file(e, path) == path
    record = json.loads((tmp_path / "err.json").read_text())
    assert record["message"]["message"] == "RuntimeError: boom"
    text = read_error_file(path)
    assert text.startswith("Traceback (most recent call last):") and "RuntimeError: boom" in text
    assert read_error_file(str(tmp_path / "missing.json")) is None
    (tmp_path / "plain.json").write_text('{"message": "from C++"}')
    assert read_error_file(str(tmp_path / "plain.json")) == "from C++"
    (tmp_path / "bad.json").write_text("not json")
    assert read_error_file(str(tmp_path / "bad.json")) is None


def test_record_errors_writes_exceptions_but_not_system_exit(tmp_path, monkeypatch):
    path = tmp_path / "err.json"
    monkeypatch.setenv("ATOM_ERROR_FILE", str(path))

    @record_errors
    def fails(exc):
        raise exc

    with pytest.raises(SystemExit):
        fails(SystemExit(2))
    assert not path.exists()
    with pytest.raises(ValueError):
        fails(ValueError("bad value"))
    assert "ValueError: bad value" in read_error_file(str(path))


# --- endpoints ---------------------------------------------------------------------------------


def test_endpoint_exchange_through_a_store():
    store = dist.HashStore()
    remote = dict(master_addr="10.0.0.1")
    publish_endpoint(store, "engine_core/1/input", "tcp://10.0.0.2:5555", **remote)
    assert store.get("atom/endpoint/engine_core/1/input") == b"tcp://10.0.0.2:5555"
    assert lookup_endpoint(store, "engine_core/1/input", timeout_s=1, **remote) == "tcp://10.0.0.2:5555"
    local = dict(master_addr="127.0.0.1")  # every node is this machine: ipc goes
    publish_endpoint(store, "engine_core/1/input", "ipc:///tmp/atom-1", **local)  # replaces it
    assert lookup_endpoint(store, "engine_core/1/input", timeout_s=1, **local) == "ipc:///tmp/atom-1"
    with pytest.raises(TimeoutError, match="atom/endpoint/engine_core/2/input"):
        lookup_endpoint(store, "engine_core/2/input", timeout_s=0.2, **remote)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://127.1.2.3:5555",
                                     "tcp://localhost:5555", "tcp://[::1]:5555",
                                     "ipc:///tmp/atom-1", "inproc://front"])
def test_an_endpoint_other_hosts_cannot_reach_is_refused_when_the_master_is_remote(address):
    store = dist.HashStore()
    with pytest.raises(ValueError, match="local to one host, but MASTER_ADDR=10.0.0.1 is not "
                                         "loopback"):
        publish_endpoint(store, "dp/front_end/output", address, master_addr="10.0.0.1")
    assert not store.check(["atom/endpoint/dp/front_end/output"])
    # a node started with a loopback --master-addr publishes it; its remote peers refuse it
    publish_endpoint(store, "dp/front_end/output", address, master_addr="127.0.0.1")
    with pytest.raises(ValueError, match="'dp/front_end/output' is local to one host"):
        lookup_endpoint(store, "dp/front_end/output", timeout_s=1, master_addr="10.0.0.1")
    assert lookup_endpoint(store, "dp/front_end/output", timeout_s=1,
                           master_addr="localhost") == address


@pytest.mark.parametrize("key, address, match", [
    ("k", "10.0.0.1:5555", "expected a ZMQ address"),
    ("k", "tcp://*:5555", "wildcard"),
    ("k", "tcp://0.0.0.0:5555", "wildcard"),
    ("bad key", "tcp://h:1", "endpoint key"),
    ("", "tcp://h:1", "endpoint key"),
])
def test_endpoint_validation(key, address, match):
    with pytest.raises(ValueError, match=match):
        publish_endpoint(dist.HashStore(), key, address, master_addr="10.0.0.1")


def test_endpoint_key_prefix():
    assert endpoint_key("a/b") == "atom/endpoint/a/b"


# --- the launchers' store protocol -------------------------------------------------------------


def _join_all(stores_and_sizes, timeout_s=20):
    errors = {}

    def join(s, n):
        try:
            s.join(n, timeout_s=timeout_s)
        except (ValueError, TimeoutError) as e:
            errors[s.node_rank] = e

    threads = [threading.Thread(target=join, args=sn) for sn in stores_and_sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return errors


def test_launch_store_join_stop_and_exit_barrier():
    host = LaunchStore.open(master_addr="127.0.0.1", master_port=0, node_rank=0, nnodes=2,
                            timeout_s=10)
    assert host.port != 0 and host.multi_node
    node1 = LaunchStore.open(master_addr="127.0.0.1", master_port=host.port, node_rank=1,
                             nnodes=2, timeout_s=10)
    assert _join_all([(host, 2), (node1, 2)]) == {}
    with pytest.raises(ValueError, match="--node-rank 1 is already taken"):
        LaunchStore(node1.store, node_rank=1, nnodes=2, address="x").join(2, timeout_s=1)

    assert host.remote_stop() is None
    node1.publish_stop(StopRecord(node_rank=1, reason="rank 1 failed", rank=1, exit_code=3))
    node1.publish_stop(StopRecord(node_rank=1, reason="later"))  # the first record wins
    assert host.remote_stop() == StopRecord(node_rank=1, reason="rank 1 failed", rank=1,
                                            exit_code=3)
    assert node1.remote_stop() is None  # its own record

    assert not host.all_done()
    node1.mark_done()
    host.mark_done()
    assert host.all_done()

    del host
    gc.collect()  # the server goes with its owner: node 1 now reports the store as lost
    lost = node1.remote_stop()
    assert lost is not None and "lost the rendezvous store" in lost.reason


def _three_node_stores():
    host = LaunchStore.open(master_addr="127.0.0.1", master_port=0, node_rank=0, nnodes=3,
                            timeout_s=10)
    others = [LaunchStore.open(master_addr="127.0.0.1", master_port=host.port, node_rank=r,
                               nnodes=3, timeout_s=10) for r in (1, 2)]
    return host, others


def test_node_watch_finds_the_node_whose_heartbeat_stopped():
    host, (node1, node2) = _three_node_stores()
    watch = NodeWatch(host, node_timeout_s=10.0, now=100.0)  # times are node 0's clock
    node1.beat()
    node2.beat()
    assert watch.lost(now=105.0) == []
    node2.beat()  # node 1 goes silent at 105, node 2 keeps beating
    assert watch.lost(now=114.0) == []  # 9 s of silence: not yet
    node2.beat()
    assert watch.lost(now=116.0) == [(1, 11.0)]
    record = lost_node_record(watch, 0, now=116.5)
    assert (record.node_rank, record.lost_node) == (0, 1)
    assert record.reason.startswith("node 1 is lost: its launcher has not been heard from for "
                                    "12s (--node-timeout-s 10)")
    node1.mark_done()  # a node that finished is silent, not lost
    assert watch.lost(now=200.0) == [(2, 84.0)]
    host.publish_stop(record)
    assert node2.remote_stop() == record  # the others stop, reading why


def test_node_zero_waits_for_the_others_but_not_for_a_lost_one():
    host, (node1, node2) = _three_node_stores()
    watch = NodeWatch(host, node_timeout_s=3.5, now=0.0)  # long ago: both are silent
    node1.mark_done()
    with StopSignals() as signals:
        lost = wait_for_other_nodes(host, signals, timeout_s=30.0, watch=watch)
    assert lost is not None and lost.lost_node == 2
    assert node1.remote_stop() == lost


def test_a_stop_asked_of_another_node_is_a_requested_stop_here_too():
    asked = Outcome(remote=StopRecord(node_rank=0, reason="SIGTERM to the launcher of node 0",
                                      signal=signal.SIGTERM))
    assert asked.exit_code == 128 + signal.SIGTERM
    failed = Outcome(remote=StopRecord(node_rank=0, reason="rank 0 failed", rank=0, exit_code=3))
    assert failed.exit_code == 3
    lost = Outcome(lost=StopRecord(node_rank=0, reason="node 1 is lost", lost_node=1))
    assert lost.stopping and lost.exit_code == 1
    assert StopRecord.from_bytes(asked.remote.to_bytes()) == asked.remote


def test_launch_store_refuses_unequal_node_sizes():
    host = LaunchStore.open(master_addr="127.0.0.1", master_port=0, node_rank=0, nnodes=2,
                            timeout_s=10)
    node1 = LaunchStore.open(master_addr="127.0.0.1", master_port=host.port, node_rank=1,
                             nnodes=2, timeout_s=10)
    errors = _join_all([(host, 2), (node1, 1)])
    assert set(errors) == {0, 1}
    assert all("different --nproc-per-node" in str(e) for e in errors.values())


def test_launch_store_join_times_out_naming_the_missing_node():
    host = LaunchStore.open(master_addr="127.0.0.1", master_port=0, node_rank=0, nnodes=2,
                            timeout_s=10)
    with pytest.raises(TimeoutError, match=r"node\(s\) \[1\] did not join"):
        host.join(1, timeout_s=0.3)


def test_hosting_a_taken_port_says_what_to_do():
    taken = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    with pytest.raises(RuntimeError, match="Pick another --master-port"):
        LaunchStore.open(master_addr="127.0.0.1", master_port=taken.port, node_rank=0,
                         nnodes=1, timeout_s=5)


# --- local worker processes (plain shell commands, no torch) ----------------------------------


def _run_worker(tmp_path, rank: int, script: str, console) -> WorkerProcess:
    spec = WorkerSpec(rank=rank, local_rank=rank, argv=("sh", "-c", script), env={},
                      log_path=str(tmp_path / f"rank{rank}.log"),
                      error_path=str(tmp_path / f"rank{rank}.error.json"))
    w = WorkerProcess(spec, console=console)
    w.popen.wait()
    while w.pump():  # the writer has exited: this reaches end of file without blocking long
        pass
    return w


def test_worker_stderr_is_teed_with_a_rank_prefix_and_blame_prefers_signals(tmp_path):
    console = io.StringIO()
    exited = _run_worker(tmp_path, 0, "echo first >&2; printf 'no newline' >&2; exit 1", console)
    aborted = _run_worker(tmp_path, 1, "echo dying >&2; kill -ABRT $$", console)
    try:
        assert (tmp_path / "rank0.log").read_text() == "first\nno newline"  # unchanged
        # an unterminated last line is emitted at end of file
        assert console.getvalue() == "[rank0] first\n[rank0] no newline\n[rank1] dying\n"
        failure = exited.failure(node_rank=2)
        assert (failure.rank, failure.node_rank, failure.exit_code) == (0, 2, 1)
        assert failure.details == "first\nno newline"
        assert aborted.poll() == -signal.SIGABRT
        # seen exiting together, the rank killed by a signal is the likely root cause
        assert sorted([exited, aborted], key=WorkerProcess.blame_order) == [aborted, exited]
        # a recorded traceback replaces the stderr tail in the report
        (tmp_path / "rank0.error.json").write_text('{"message": "recorded"}')
        assert exited.failure(node_rank=0).details == "recorded"
    finally:
        exited.close()
        aborted.close()
