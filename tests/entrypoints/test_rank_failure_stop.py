"""A hung rank of ``atom serve --data-parallel-size 2 --on-rank-failure stop``: every in-flight
stream ends with an error event naming the rank within ``--engine-hang-timeout-s`` + 10 s (not
the 600 s group timeout), a new request gets 503 at once, ``/health`` is 503 and says which
rank hung, and the server still exits 0 on SIGTERM.
"""

from __future__ import annotations

import signal
import time

from tests.entrypoints.fault_streams import (
    PROMPTS,
    engine_cores,
    health,
    kill_signal,
    start_streams,
    wait_streams,
)
from tests.entrypoints.remote_server import API_KEY, MODEL, RemoteServer

HANG_TIMEOUT_S = 4.0


def test_hung_rank_fails_every_request_fast_and_the_server_answers_503():
    server = RemoteServer("--on-rank-failure", "stop", "--engine-hang-timeout-s",
                          str(HANG_TIMEOUT_S), "--num-kv-blocks", "64", "--max-model-len", "256",
                          api_key=API_KEY, data_parallel_size=2)
    try:
        streams = start_streams(server, PROMPTS[:8])
        fault_s = kill_signal(engine_cores(server)[1], signal.SIGSTOP)
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
