"""DP router policies (pure Python): round robin, least requests (charge/release once, ties
rotate, bursts split evenly), rank hints."""

from __future__ import annotations

import pytest

from atom.dp.router import DPRouter


def test_round_robin_cycles():
    r = DPRouter("round_robin", 3)
    assert [r.dispatch(str(i)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_requests_burst_splits_evenly():
    r = DPRouter("least_requests", 2)
    ranks = [r.dispatch(str(i)) for i in range(10)]
    assert ranks.count(0) == ranks.count(1) == 5
    assert r.loads == [5, 5]


def test_least_requests_prefers_the_least_loaded_and_ties_rotate():
    r = DPRouter("least_requests", 3)
    assert [r.dispatch(x) for x in "abc"] == [0, 1, 2]
    assert r.release("b") == 1
    assert r.dispatch("d") == 1  # the only least-loaded rank
    for x in "acd":
        r.release(x)
    # all equal again: the rotation continues after the previous pick (1), not from 0
    assert [r.dispatch(x) for x in "efg"] == [2, 0, 1]


def test_release_exactly_once():
    r = DPRouter("least_requests", 2)
    r.dispatch("a")
    assert r.release("a") == 0
    assert r.release("a") is None  # a finish after an abort (or twice) does not double-release
    assert r.release("unknown") is None
    assert r.loads == [0, 0]


def test_rank_hint_wins_and_is_charged():
    r = DPRouter("least_requests", 2)
    assert [r.dispatch(str(i), rank_hint=1) for i in range(3)] == [1, 1, 1]
    assert r.loads == [0, 3]
    assert r.dispatch("x") == 0 and r.dispatch("y") == 0
    assert r.rank_of("x") == 0 and r.rank_of("0") == 1


@pytest.mark.parametrize("hint", [-1, 2, True])
def test_bad_hint(hint):
    with pytest.raises(ValueError, match="data_parallel_rank"):
        DPRouter("round_robin", 2).dispatch("a", rank_hint=hint)


def test_duplicate_id_and_bad_policy():
    r = DPRouter("round_robin", 2)
    r.dispatch("a")
    with pytest.raises(ValueError, match="already running"):
        r.dispatch("a")
    with pytest.raises(ValueError, match="policy"):
        DPRouter("random", 2)
    with pytest.raises(ValueError):
        DPRouter("round_robin", 0)
