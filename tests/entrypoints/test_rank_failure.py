"""Rank failures on a real ``atom serve --data-parallel-size 2 --on-rank-failure replace``:
a hung rank (SIGSTOP) and then a dead one (SIGKILL) during streaming requests. Each time the
front end starts a fresh group of two ranks and resumes every in-flight request from its
prompt plus the tokens already streamed: every stream completes, its greedy text equals an
undisturbed run's, no request waits for the group timeout (600 s), new requests succeed,
``/health`` reports the new membership, and no KV block stays in use.
"""

from __future__ import annotations

import signal

import pytest

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
def server():
    srv = RemoteServer("--on-rank-failure", "replace", "--engine-hang-timeout-s",
                       str(HANG_TIMEOUT_S), "--num-kv-blocks", "64", "--max-model-len", "256",
                       api_key=API_KEY, data_parallel_size=2)
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
