"""DP router policies (pure Python): round robin, least requests (charge/release once, ties
rotate, bursts split evenly), rank hints; cache_aware's every branch from hand-made inputs and
the router over a KV cache index fed with in-memory events (no sockets, no processes)."""

from __future__ import annotations

import pytest

import atom.dp.router as router_module
from atom.core.block_manager import hash_block
from atom.dp.router import (CACHE_HIT, GUARD_FALLBACK, LEAST_LOAD, REASONS, SESSION,
                            CacheAwareSettings, DPRouter, LoadGuard, cache_aware_choice,
                            least_loaded)
from atom.kv_events import stored_event
from atom.engine.kv_subscriber import KVCacheIndex, wire_block_hashes


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


# ----- cache_aware: the pure decision, every branch from hand-made inputs -----

SETTINGS = CacheAwareSettings(min_match_ratio=0.5, guard=LoadGuard(abs_threshold=2, rel_threshold=1.5))


def choose(loads, matches, *, num_blocks=10, session_rank=None, rotation=0, settings=SETTINGS,
           new_session=False):
    return cache_aware_choice(loads, matches, num_blocks=num_blocks, session_rank=session_rank,
                              settings=settings, rotation=rotation, new_session=new_session)


def test_least_loaded_ties_prefer_the_session_then_rotate():
    assert least_loaded([1, 0, 0], 0) == 1
    assert least_loaded([0, 0, 0], 2) == 2 and least_loaded([0, 0, 0], 4) == 1  # modulo
    assert least_loaded([0, 0, 0], 1, prefer=2) == 2
    assert least_loaded([0, 5, 0], 0, prefer=1) == 0  # not tied: no preference
    assert least_loaded([3, 1, 1], 0, among=[0, 2]) == 2


@pytest.mark.parametrize("loads, rank, trips", [
    ([3, 0], 0, True),    # 3 over, and > 1.5 x 0
    ([2, 0], 0, False),   # only 2 over: within abs_threshold
    ([10, 7], 0, False),  # 3 over, but 10 <= 1.5 x 7
    ([12, 7], 0, True),   # 5 over and 12 > 10.5
    ([6, 2], 1, False),   # the least-loaded rank never trips
])
def test_load_guard_needs_both_thresholds(loads, rank, trips):
    assert SETTINGS.guard.trips(loads, rank) is trips


def test_longest_cached_prefix_wins():
    assert choose([0, 0, 0], {0: 5, 1: 8, 2: 6}) == (1, CACHE_HIT)


def test_a_prefix_below_the_ratio_is_no_hit():
    # 4 of 10 blocks (a shared system prompt): least load decides, the rotation breaks ties
    assert choose([0, 0], {0: 4, 1: 0}, rotation=1) == (1, LEAST_LOAD)
    assert choose([0, 0], {0: 4}, session_rank=0, rotation=1) == (0, SESSION)
    assert choose([0, 0], {0: 5}, rotation=1) == (0, CACHE_HIT)  # exactly half: a hit
    assert choose([0, 0], {0: 0, 1: 0}, num_blocks=0, rotation=1) == (1, LEAST_LOAD)


def test_equal_prefixes_go_to_the_session_rank_never_rotated_away():
    # rank 0 is next in the rotation and both ranks hold the prefix: the session keeps rank 1
    assert choose([0, 0], {0: 7, 1: 7}, session_rank=1, rotation=0) == (1, CACHE_HIT)
    # even when the session rank is busier (within the guard)
    assert choose([0, 2], {0: 7, 1: 7}, session_rank=1, rotation=0) == (1, CACHE_HIT)
    # no session: the less loaded, then the rotation
    assert choose([1, 0], {0: 7, 1: 7}) == (1, CACHE_HIT)
    assert choose([0, 0], {0: 7, 1: 7}, rotation=1) == (1, CACHE_HIT)


def test_a_longer_prefix_elsewhere_beats_the_session():
    assert choose([0, 0], {0: 6, 1: 9}, session_rank=0) == (1, CACHE_HIT)


def test_session_without_a_hit():
    assert choose([0, 1], {}, session_rank=1) == (1, SESSION)


def test_no_hit_no_session_is_least_load():
    assert choose([2, 1, 1], {}, rotation=0) == (1, LEAST_LOAD)
    assert choose([2, 1, 1], {}, rotation=2) == (2, LEAST_LOAD)


def test_guard_falls_back_from_a_cache_hit_and_from_a_session():
    assert choose([6, 2], {0: 9}) == (1, GUARD_FALLBACK)
    assert choose([6, 2], {}, session_rank=0) == (1, GUARD_FALLBACK)


def test_a_new_session_goes_to_the_least_loaded_rank_a_hit_breaks_ties():
    assert choose([1, 0], {0: 9}, new_session=True) == (1, LEAST_LOAD)  # within the guard
    assert choose([0, 0], {0: 9}, new_session=True, rotation=1) == (0, LEAST_LOAD)  # the hit
    assert choose([0, 0, 0], {0: 6, 2: 9}, new_session=True) == (2, LEAST_LOAD)  # the longest
    assert choose([0, 0], {0: 4}, new_session=True, rotation=1) == (1, LEAST_LOAD)  # no hit
    assert choose([1, 0], {0: 9}) == (0, CACHE_HIT)  # no session id: the hit, as before


def test_guard_fallback_ties_keep_the_session_rank():
    # rank 0 holds the prefix but is overloaded; ranks 1 and 2 tie on load: the session's wins
    assert choose([6, 1, 1], {0: 9}, session_rank=2, rotation=1) == (2, GUARD_FALLBACK)


# ----- cache_aware: the router (loads, sessions, counters) over an index fed in memory -----

BLOCK = 4


def cache_aware_router(num_ranks=2, index=None):
    return DPRouter("cache_aware", num_ranks, cache_aware=SETTINGS, index=index)


def cache(index: KVCacheIndex, rank: int, tokens: list[int]) -> list[int]:
    """Store ``tokens``' full blocks on ``rank`` as the block manager's events would; returns
    the prompt's wire hashes."""
    hashes, parent = [], None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hash_block(parent, tokens[start:start + BLOCK])
        hashes.append(parent)
    index.apply(rank, [stored_event(hashes, None, tokens[:len(hashes) * BLOCK], BLOCK)])
    return wire_block_hashes(tokens, BLOCK)


def test_cache_aware_needs_its_settings():
    with pytest.raises(ValueError, match="CacheAwareSettings"):
        DPRouter("cache_aware", 2)


def test_sessions_stick_and_loads_return_to_zero():
    r = cache_aware_router()
    assert r.dispatch("a", session_id="s") == 0  # least load
    assert r.dispatch("b", session_id="t") == 1  # least load
    assert r.dispatch("c", session_id="s") == 0  # session
    assert r.session_rank("s") == 0 and r.session_rank("u") is None
    for x in "abc":
        r.release(x)
    stats = r.rank_stats()
    assert [s["dp_router_load"] for s in stats] == [0, 0]
    assert stats[0]["dp_router_decisions_least_load"] == 1
    assert stats[0]["dp_router_decisions_session"] == 1
    assert stats[1]["dp_router_decisions_least_load"] == 1
    assert set(stats[0]) == {"dp_router_load"} | {f"dp_router_decisions_{x}" for x in REASONS}


def test_a_hint_wins_and_moves_the_session():
    r = cache_aware_router()
    r.dispatch("a", session_id="s")
    assert r.dispatch("b", 1, session_id="s") == 1
    assert r.session_rank("s") == 1
    assert r.rank_stats()[1]["dp_router_decisions_hint"] == 1


def test_identical_prompts_at_once_spread_behind_the_guard():
    index = KVCacheIndex([0, 1])
    hashes = cache(index, 0, list(range(32)))  # the prompt is cached on rank 0 only
    r = cache_aware_router(index=index)
    ranks = [r.dispatch(str(i), block_hashes=hashes) for i in range(8)]
    assert ranks == [0, 0, 0, 1, 0, 1, 0, 1]  # 5 / 3: the guard allows rank 0 two over
    assert r.rank_stats()[1]["dp_router_decisions_guard_fallback"] == 3


def test_guard_sends_no_affinity_request_to_a_rank_with_3x_the_load():
    index = KVCacheIndex([0, 1])
    hashes = cache(index, 0, list(range(32)))
    r = cache_aware_router(index=index)
    r.dispatch("s0", 0, session_id="s")  # two sessions last sent to rank 0
    r.dispatch("t0", 0, session_id="t")
    for i in range(10):
        r.dispatch(f"p0-{i}", 0)
    for i in range(4):
        r.dispatch(f"p1-{i}", 1)
    assert r.loads == [12, 4]
    ranks = [r.dispatch("c0", block_hashes=hashes), r.dispatch("c1", session_id="s"),
             r.dispatch("c2", block_hashes=hashes), r.dispatch("c3", session_id="t")]
    assert ranks == [1, 1, 1, 1]
    assert r.rank_stats()[1]["dp_router_decisions_guard_fallback"] == 4


def test_sessions_sharing_a_system_prompt_cached_on_one_rank_split_evenly():
    """6 sessions x 3 turns at DP 2, every turn's 6 requests at once, the system prompt cached
    on rank 0 first: new sessions split 3 / 3 (not 4 / 2, the guard's limit), later turns stay
    on their session's rank (the longest prefix: the system prompt and their own history)."""
    index = KVCacheIndex([0, 1])
    system = list(range(1000, 1040))  # 10 blocks, most of a first turn
    cache(index, 0, system)
    r = cache_aware_router(index=index)
    history = {s: list(system) for s in range(6)}
    sent: list[list[int]] = []
    for turn in range(3):
        prompts = {s: history[s] + [2000 + 10 * s + turn] * BLOCK for s in range(6)}
        sent.append([r.dispatch(f"{turn}-{s}", session_id=f"s{s}",
                                block_hashes=wire_block_hashes(prompts[s], BLOCK))
                     for s in range(6)])
        for s in range(6):
            r.release(f"{turn}-{s}")
            cache(index, sent[turn][s], prompts[s])  # the turn's KV stays on its rank
            history[s] = prompts[s]
    assert sorted(sent[0]) == [0, 0, 0, 1, 1, 1]
    assert sent[1] == sent[2] == sent[0]  # every session stays on its rank
    decisions = r.rank_stats()
    assert sum(d["dp_router_decisions_cache_hit"] for d in decisions) == 12


def test_sessions_are_forgotten_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(router_module, "_MAX_SESSIONS", 2)
    r = cache_aware_router()
    for i, session in enumerate("abac"):
        r.dispatch(str(i), session_id=session)
    assert r.session_rank("b") is None and r.session_rank("a") is not None


def test_reset_releases_every_charged_request_once_and_resizes():
    r = DPRouter("cache_aware", 3, cache_aware=CacheAwareSettings(0.5, LoadGuard(2, 1.5)))
    for i in range(5):
        r.dispatch(str(i), session_id="s")
    r.release("0")
    assert r.reset(2) == 4  # the released one is not released again
    assert r.loads == [0, 0] and r.rank_of("1") is None and r.session_rank("s") is None
    assert r.release("1") is None  # idempotent after the reset
    assert len(r.rank_stats()) == 2 and r.rank_stats()[0]["dp_router_decisions_session"] > 0
    assert r.dispatch("1") in (0, 1) and sum(r.loads) == 1
    with pytest.raises(ValueError):
        r.reset(0)
