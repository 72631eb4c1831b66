"""A dead rank of ``atom serve --data-parallel-size 2 --moe-split-experts 4
--enable-expert-parallel`` under the default ``--on-rank-failure shrink``: the front end starts
a group of the one surviving slot (all four experts on it: the placement is recomputed from
the weights), resumes all 16 in-flight streams, and their greedy text equals the undisturbed
run's (the split model is the dense model's function, so its text is the dense one's too);
at shutdown the summary line says the group shrank.
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
    start_streams,
    wait_no_kv_in_use,
)
from tests.entrypoints.remote_server import API_KEY, RemoteServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("ep-shrink") / "stderr.log"
    with open(log, "w") as stderr:
        srv = RemoteServer("--moe-split-experts", "4", "--enable-expert-parallel",
                           "--engine-hang-timeout-s", "4", "--num-kv-blocks", "64",
                           "--max-model-len", "256", api_key=API_KEY, data_parallel_size=2,
                           stderr=stderr)
    srv.log = log
    yield srv
    assert srv.stop() == 0


def test_dead_rank_with_expert_parallelism_shrinks_and_every_stream_completes(server):
    reference = reference_texts(server, PROMPTS)
    streams = start_streams(server, PROMPTS)
    fault_s = kill_signal(engine_cores(server)[1], signal.SIGKILL)
    check_resumed(streams, reference, fault_s=fault_s)
    status, body = health(server)
    assert status == 200 and (body["generation"], body["dp_size"]) == (1, 1), body
    assert [f["dp_rank"] for f in body["rank_failures"]] == [1], body
    assert len(wait_no_kv_in_use(server)) == 1  # one rank left, none of its blocks in use
    check_serves_new_requests(server)
    assert server.stop() == 0
    text = server.log.read_text()
    summary = [line for line in text.splitlines() if line.startswith("atom: DP ")]
    assert len(summary) == 1 and summary[0].startswith(
        "atom: DP 1 (2 at start: rank failures shrank the group; counters since), EP 4 "
        "experts (4 a rank), TBO off; per rank: requests "), text[-3000:]
