"""A hung (SIGSTOPped) rank of ``atom serve --data-parallel-size 2 --on-rank-failure stop``, with
the default ``--engine-hang-timeout-s`` (10 s): ``/health`` answers within 2 s all along (it
never waits on the engine thread, which waits on the stopped rank) and turns 503 naming the
rank within the timeout + 10 s; every in-flight stream ends with an error event naming the rank
as fast (not the 600 s group timeout); a new request gets 503 at once; the server still exits 0
on SIGTERM.
"""

from __future__ import annotations

import signal
import time

from atom.config import EngineConfig
from tests.entrypoints.fault_streams import (
    PROMPTS,
    engine_cores,
    health,
    kill_signal,
    start_streams,
    wait_streams,
)
from tests.entrypoints.remote_server import API_KEY, MODEL, RemoteServer

HANG_TIMEOUT_S = EngineConfig().engine_hang_timeout_s  # the default
HEALTH_ANSWER_S = 2.0  # a load balancer's probe timeout: /health must answer within it


def test_hung_rank_fails_every_request_fast_and_the_server_answers_503():
    server = RemoteServer("--on-rank-failure", "stop", "--num-kv-blocks", "64",
                          "--max-model-len", "256", api_key=API_KEY, data_parallel_size=2)
    try:
        streams = start_streams(server, PROMPTS[:8])
        fault_s = kill_signal(engine_cores(server)[1], signal.SIGSTOP)
        while True:  # each probe answers within 2 s (httpx raises past it), the rank silent
            status, body = health(server, timeout_s=HEALTH_ANSWER_S)
            if status == 503:
                break
            assert time.monotonic() - fault_s < HANG_TIMEOUT_S + 10, body
            time.sleep(0.5)
        assert body["status"] in ("unresponsive", "dead") and "dp rank 1" in body["message"], body
        wait_streams(streams)
        for s in streams:
            assert s.status == 200 and s.error is not None, s
            assert "dp rank 1 is hung" in s.error["message"], s.error
            assert s.end_time_s - fault_s < HANG_TIMEOUT_S + 10, s.end_time_s - fault_s
        sent_s = time.monotonic()
        r = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                 "max_tokens": 2}, timeout=30.0)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "dp rank 1 is hung" in r.json()["error"]["message"]
        assert time.monotonic() - sent_s < 5.0  # at once: it never reaches the engine
        status, body = health(server)
        assert status == 503 and body["status"] == "dead", body
        assert "dp rank 1 is hung: no heartbeat" in body["message"], body
    finally:
        assert server.stop() == 0
