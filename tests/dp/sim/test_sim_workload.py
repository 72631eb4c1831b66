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


def test_token_ids_are_drawn_inside_the_models_vocabulary():
    """A large vocabulary gives the draws every run made before (embedded: 49152 tokens); a
    small one cuts the range at its size; one too small for any id is a one-line error."""
    assert W.dp_experiment(vocab_size=49152) == W.dp_experiment()
    assert W.bursty(num_requests=4, burst_size=2, burst_interval=1.0, vocab_size=20000) == \
        W.bursty(num_requests=4, burst_size=2, burst_interval=1.0)
    assert W.vocab_range(512) == (100, 512) and W.vocab_range(64) == (32, 64)
    small = W.dp_experiment(vocab_size=512)
    ids = [t for r in small for t in r.prompt_token_ids]
    assert min(ids) >= 100 and max(ids) < 512 and max(ids) > 400  # the whole range is used
    assert len(small) == 27 and [r.prompt_len for r in small[:3]] == [160] * 3
    for generator, args in ((W.kv_skewed, dict(num_requests=4, rate=1.0)),
                            (W.sessions, dict(num_sessions=2, num_turns=1, turn_interval=1.0))):
        assert max(t for r in generator(**args, vocab_size=300) for t in r.prompt_token_ids) < 300
    with pytest.raises(ValueError, match="a vocabulary of 3 tokens leaves no synthetic token ids"):
        W.synthetic_prompt("x", 4, vocab_size=3)


def test_a_replay_outside_the_vocabulary_is_a_one_line_error():
    from atom.dp.sim.replay import check_vocabulary

    requests = W.dp_experiment()
    check_vocabulary(requests, 20000, model=None)  # inside: nothing to say
    with pytest.raises(ValueError, match=r"^request 0's prompt has token id \d+, outside "
                                         r"tiny's vocabulary of 512 tokens: draw the workload "
                                         r"with vocab_size=512 \(atom.dp.sim.workload\)$"):
        check_vocabulary(requests, 512, model="tiny")


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
