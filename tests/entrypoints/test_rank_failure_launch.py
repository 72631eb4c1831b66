"""``atom launch --nproc-per-node 2 --max-restarts 1 serve``: a killed rank makes the launcher
restart both ranks while the front end (rank 0's child, in a session of its own) stays up and
resumes its in-flight streams on the restarted group; they complete with the undisturbed
greedy text. A second kill, with no restart left, ends everything with the launcher's report.
"""

from __future__ import annotations

import signal

import psutil

from tests.entrypoints.fault_streams import (
    PROMPTS,
    health,
    kill_signal,
    launched_ranks,
    reference_texts,
    start_streams,
    wait_streams,
)
from tests.entrypoints.remote_server import API_KEY, RemoteServer

EXIT_DEADLINE_S = 90.0  # liveness: the launcher gives up and exits within this


def test_max_restarts_restarts_the_group_once_then_fails_with_the_report(tmp_path):
    log = open(tmp_path / "launcher.stderr", "w+")
    server = RemoteServer("--engine-hang-timeout-s", "4", "--num-kv-blocks", "64",
                          "--max-model-len", "256", "--drain-timeout", "2", api_key=API_KEY,
                          data_parallel_size=2,
                          launcher=("launch", "--nproc-per-node", "2", "--max-restarts", "1",
                                    "--term-timeout-s", "3"),
                          stderr=log)
    processes = psutil.Process(server.proc.pid).children(recursive=True)
    try:
        reference = reference_texts(server, PROMPTS[:4])
        streams = start_streams(server, PROMPTS[:4])
        kill_signal(launched_ranks(server)[1], signal.SIGKILL)
        wait_streams(streams)
        assert [(s.error, s.finish_reason) for s in streams] == [(None, "length")] * 4
        assert [s.text for s in streams] == reference
        status, body = health(server)
        assert status == 200 and body["generation"] == 1, body
        processes += psutil.Process(server.proc.pid).children(recursive=True)
        kill_signal(launched_ranks(server)[1], signal.SIGKILL)  # no restart left
        assert server.proc.wait(EXIT_DEADLINE_S) == 1
    finally:
        server.stop()
    log.seek(0)
    report = log.read()
    assert "restarting every rank (restart 1 of 1)" in report, report[-3000:]
    assert report.count("rank 1 (node 0, pid") == 2, report[-3000:]  # both failures reported
    for rank in (0, 1):  # the restarted group logged its membership at tick 0 on every rank
        assert f"[dp{rank}] membership change at tick 0: generation 1 runs 2 rank(s)" in report
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)


def test_without_restarts_a_killed_rank_ends_every_stream_with_an_error_event_at_once(tmp_path):
    """No restarts: a killed rank ends the deployment; each open stream gets an SSE error event
    and ``[DONE]`` within 2 s (the front end sees the rank's pid exit, or rank 0 tells it that
    the launcher is stopping every rank), not a connection cut when the launcher's grace
    period ends."""
    log = open(tmp_path / "launcher.stderr", "w+")
    server = RemoteServer("--num-kv-blocks", "64", "--max-model-len", "256", api_key=API_KEY,
                          data_parallel_size=2, stderr=log,
                          launcher=("launch", "--nproc-per-node", "2", "--term-timeout-s", "10"))
    try:
        streams = start_streams(server, PROMPTS[:2], max_tokens=200)  # still running at the kill
        killed_s = kill_signal(launched_ranks(server)[1], signal.SIGKILL)
        wait_streams(streams)
        assert server.proc.wait(EXIT_DEADLINE_S) == 1
    finally:
        server.stop()
    for s in streams:
        assert s.status == 200 and s.done_event and s.finish_reason is None, s
        assert s.error["code"] == "engine_dead", s.error
        assert s.end_time_s - killed_s < 2.0, s.end_time_s - killed_s
