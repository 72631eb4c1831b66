"""Rank failures on a real ``atom serve --data-parallel-size 2 --on-rank-failure replace``:
a hung rank (SIGSTOP) and then a dead one (SIGKILL) during streaming requests. Each time the
front end starts a fresh group of two ranks and resumes every in-flight request from its
prompt plus the tokens already streamed: every stream completes, its greedy text equals an
undisturbed run's, no request waits for the group timeout (600 s), new requests succeed,
``/health`` reports the new membership, and no KV block stays in use. Each new group logs
the membership change at its tick 0 on every rank: in the lockstep check's log line and as an
event in its own folder of the per-tick trace (the lost group's trace is kept). A rank killed
while nothing is in flight is replaced without waiting for a request.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from atom.dp.dp_trace import generation_folder, read_trace
from tests.entrypoints.fault_streams import (
    PROMPTS,
    check_resumed,
    check_serves_new_requests,
    engine_cores,
    health,
    kill_signal,
    reference_texts,
    samples,
    start_streams,
    wait_no_kv_in_use,
)
from tests.entrypoints.remote_server import API_KEY, RemoteServer

HANG_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("rank_failure")


@pytest.fixture(scope="module")
def server(folder):
    with open(folder / "server.stderr", "w") as stderr:
        srv = RemoteServer("--on-rank-failure", "replace", "--engine-hang-timeout-s",
                           str(HANG_TIMEOUT_S), "--num-kv-blocks", "64", "--max-model-len",
                           "256", "--dp-trace", str(folder / "trace"), api_key=API_KEY,
                           data_parallel_size=2, stderr=stderr)
        yield srv
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference(server):
    return reference_texts(server, PROMPTS)


def _check_recovered(server, streams, reference, *, fault_s: float, generation: int,
                     kind: str, dp_rank: int) -> None:
    check_resumed(streams, reference, fault_s=fault_s)
    status, body = health(server)
    assert status == 200 and body["status"] == "serving", body
    assert body["generation"] == generation and body["dp_size"] == 2, body
    assert len(body["ranks"]) == 2 and all(r["pid"] for r in body["ranks"]), body
    last = body["rank_failures"][-1]
    assert (last["dp_rank"], last["kind"], last["generation"]) == (dp_rank, kind, generation - 1)
    assert wait_no_kv_in_use(server)  # 0 blocks in use on every rank, router load 0
    check_serves_new_requests(server)


def test_hung_rank_is_replaced_and_every_stream_completes(server, reference):
    streams = start_streams(server, PROMPTS[:8])
    fault_s = kill_signal(engine_cores(server)[1], signal.SIGSTOP)
    _check_recovered(server, streams, reference[:8], fault_s=fault_s, generation=1,
                     kind="hung", dp_rank=1)
    assert {labels["kind"]: v for labels, v in samples(server, "atom:rank_failures_total")} == \
        {"dead": 0, "hung": 1}


def test_dead_rank_is_replaced_and_every_stream_completes(server, reference):
    streams = start_streams(server, PROMPTS)
    fault_s = kill_signal(engine_cores(server)[0], signal.SIGKILL)
    _check_recovered(server, streams, reference, fault_s=fault_s, generation=2, kind="dead",
                     dp_rank=0)
    resumed = samples(server, "atom:resumed_requests_total")[0][1]
    assert resumed >= 2, resumed  # streams were in flight at both faults
    assert samples(server, "atom:rank_recoveries_total")[0][1] == 2
    assert samples(server, "atom:dp_size")[0][1] == 2


def test_each_new_group_logs_the_membership_change_at_tick_0_on_every_rank(server, folder):
    """After the two recoveries above: generations 1 and 2 (two ranks each) each logged it
    once per rank, at tick 0, in the log and in their trace; generation 0's trace is kept."""
    log = (folder / "server.stderr").read_text()
    # a set: a lost rank's stderr tail, quoted in the failure's messages, repeats its lines
    changes = set(re.findall(r"\[dp(\d)\] membership change at tick (\d+): generation (\d+) "
                             r"runs (\d+) rank\(s\); the lockstep check agrees", log))
    assert changes == {("0", "0", "1", "2"), ("0", "0", "2", "2"), ("1", "0", "1", "2"),
                       ("1", "0", "2", "2")}, changes
    trace = folder / "trace"
    assert [t.events for t in read_trace(trace)] == [[], []]  # the first group's, not overwritten
    for generation in (1, 2):
        ranks = read_trace(generation_folder(trace, generation))
        assert [t.header["generation"] for t in ranks] == [generation] * 2
        for t in ranks:
            (event,) = t.events
            assert (event["event"], event["tick"], event["generation"], event["dp_size"]) == \
                ("membership_change", 0, generation, 2), event
            assert t.rows and t.rows[0]["tick"] == 0, t.rows[:1]
        assert len({t.events[0]["num_collectives"] for t in ranks}) == 1  # the same on both


def test_a_rank_killed_while_the_server_is_idle_is_replaced_before_any_request(server, folder):
    """Nothing in flight and nothing sent after the kill (behind a load balancer that routes
    only to healthy backends, no request would ever come): the idle engine thread notices the
    failure by itself, and ``/health`` then reports the new group."""
    log = folder / "server.stderr"
    kill_signal(engine_cores(server)[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "rank failure in generation 2" not in log.read_text():
        assert time.monotonic() < deadline, "no request came and the failure went unnoticed"
        time.sleep(0.2)
    deadline = time.monotonic() + 300
    while (body := health(server)[1])["status"] != "serving":
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    assert body["generation"] == 3 and body["dp_size"] == 2, body
    last = body["rank_failures"][-1]
    assert (last["dp_rank"], last["kind"], last["generation"]) == (1, "dead", 2), last
    check_serves_new_requests(server)
