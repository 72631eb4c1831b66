"""Workloads: the JSON-lines trace format (round trip, errors with line numbers), the
generators (seeded, the experiment's draws, the clocks) and their sizing per DP size."""

from __future__ import annotations

import json

import pytest

from atom.dp.sim import workload as W
from atom.dp.sim.workload import TraceRequest, read_workload, workload_clock, write_workload


def test_trace_file_round_trip_and_prompt_len(tmp_path):
    path = tmp_path / "w.jsonl"
    requests = W.sessions(num_sessions=2, num_turns=2, turn_interval=3, clock="tick")
    write_workload(path, requests)
    assert read_workload(path) == requests
    path.write_text(json.dumps({"request_id": "a", "prompt_len": 5, "output_len": 2,
                                "arrival_s": 0.5, "dp_rank": 1}) + "\n\n")
    (req,) = read_workload(path)
    assert req.prompt_token_ids == W.synthetic_prompt("a", 5) and req.dp_rank == 1
    assert req.arrival == 0.5 and workload_clock([req]) == "time"


@pytest.mark.parametrize("line, message", [
    ({"request_id": "a", "output_len": 2, "arrival_s": 0}, "prompt_token_ids, prompt_len"),
    ({"request_id": "a", "prompt_len": 3, "output_len": 0, "arrival_s": 0}, "output_len"),
    ({"request_id": "a", "prompt_len": 3, "output_len": 1}, "arrival_tick, arrival_s"),
    ({"request_id": "a", "prompt_len": 3, "output_len": 1, "arrival_tick": 1, "arrival_s": 1},
     "arrival_tick, arrival_s"),
    ({"request_id": "a", "prompt_len": 3, "output_len": 1, "arrival_s": 0, "colour": 1},
     "colour"),
])
def test_bad_lines_name_their_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    good = {"request_id": "g", "prompt_len": 3, "output_len": 1, "arrival_s": 0}
    path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=f"w.jsonl:2: .*{message}"):
        read_workload(path)


def test_one_clock_and_unique_ids(tmp_path):
    with pytest.raises(ValueError, match="one clock"):
        workload_clock([TraceRequest("a", (1,), 1, arrival_tick=0),
                        TraceRequest("b", (1,), 1, arrival_s=0.0)])
    path = tmp_path / "w.jsonl"
    line = json.dumps({"request_id": "a", "prompt_len": 3, "output_len": 1, "arrival_s": 0})
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(ValueError, match="duplicate request_id"):
        read_workload(path)


def test_dp_experiment_workload_is_the_scripts():
    """The script's draws (seeded random.Random(0)): 3 pinned pressure prompts of 160 tokens,
    then 6 bursts of 4 routed ones; the tick clock changes only the arrivals."""
    timed = W.dp_experiment()
    ticked = W.dp_experiment(clock="tick", burst_interval=8)
    assert len(timed) == 27 and [r.dp_rank for r in timed[:4]] == [0, 0, 0, None]
    assert [r.prompt_len for r in timed[:3]] == [160] * 3
    assert [r.arrival_s for r in timed[3::4]] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r.arrival_tick for r in ticked[3::4]] == [0, 8, 16, 24, 32, 40]
    assert [(r.request_id, r.prompt_token_ids, r.output_len) for r in timed] == [
        (r.request_id, r.prompt_token_ids, r.output_len) for r in ticked]
    assert W.dp_experiment(seed=1) != timed


def test_generators_and_scaling():
    skewed = W.scaled("kv_skewed", dp_size=8)
    assert len(skewed) == 480
    pinned = [r for r in skewed if r.dp_rank is not None]
    assert pinned and all(r.dp_rank == 0 and r.prompt_len >= 1024 for r in pinned)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(skewed, skewed[1:]))
    bursts = W.scaled("bursty", dp_size=4, burst_interval=5, clock="tick")
    assert len(bursts) == 160 and {r.arrival_tick for r in bursts} == set(range(0, 50, 5))
    chats = W.scaled("sessions", dp_size=1, num_turns=3)
    by_session = {}
    for r in chats:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        for earlier, later in zip(turns, turns[1:]):  # each turn extends the conversation
            assert later.prompt_token_ids[:earlier.prompt_len] == earlier.prompt_token_ids
            assert later.prompt_token_ids[earlier.prompt_len] == W.SIM_OUTPUT_TOKEN_ID
    assert W.scaled("bursty", dp_size=2) == W.scaled("bursty", dp_size=2)
    with pytest.raises(ValueError, match="unknown workload"):
        W.scaled("nope", dp_size=2)
