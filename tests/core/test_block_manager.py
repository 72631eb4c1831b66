"""Unit tests of the paged KV block pool and its prefix cache (pure Python, no torch).

Every test asserts exact block ids, ref counts and free-queue order, and calls
``check_invariants`` after each mutation.
"""

from __future__ import annotations

import pytest

import atom.core.block_manager as bm_module
from atom.core.block_manager import BlockManager, DryRunClaims, hash_block
from atom.kv_events import AllBlocksCleared, removed_event, stored_event, to_wire_hash
from atom.sampling_params import SamplingParams
from atom.core.sequence import Sequence

BS = 4  # block size used throughout


def make_seq(tokens: list[int], *, request_id: str = "r", **params) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(**params))


def make_bm(num_blocks: int = 8, *, prefix: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=prefix)


def check(bm: BlockManager) -> None:
    bm.check_invariants()
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def refs(bm: BlockManager, block_ids: list[int]) -> list[int]:
    return [bm.blocks[b].ref_count for b in block_ids]


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretend the model wrote KV for the first ``num_tokens`` tokens, then publish."""
    seq.num_computed_tokens = len(seq) if num_tokens is None else num_tokens
    bm.cache_computed_blocks(seq)
    check(bm)


def chain(tokens: list[int], num_blocks: int) -> list[int]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``tokens``."""
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = hash_block(parent, tuple(tokens[i * BS:(i + 1) * BS]))
        hashes.append(parent)
    return hashes


P12 = list(range(100, 112))  # 3 full blocks
P10 = list(range(200, 210))  # 2 full blocks + 2 tokens


# ----- allocation, free, eviction -----

def test_fresh_pool_allocates_in_id_order():
    bm = make_bm(8)
    a, b = make_seq(P10), make_seq(list(range(5)))
    assert bm.allocate(a) == 0
    assert bm.allocate(b) == 0
    check(bm)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert list(bm.free_queue) == [5, 6, 7]
    assert refs(bm, [0, 1, 2, 3, 4]) == [1] * 5
    assert bm.num_used_blocks == 5 and bm.kv_usage == pytest.approx(5 / 8)


def test_free_appends_blocks_in_reverse_to_the_tail():
    bm = make_bm(8)
    a, b = make_seq(P10), make_seq(list(range(5)))
    bm.allocate(a)
    bm.allocate(b)
    bm.free(a)
    check(bm)
    assert a.block_table == []
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0]
    bm.free(b)
    check(bm)
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert refs(bm, list(range(8))) == [0] * 8


def test_free_twice_is_an_invariant_violation():
    bm = make_bm(4)
    a = make_seq([1, 2, 3])
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_allocate_beyond_pool_raises_and_changes_nothing():
    bm = make_bm(2)
    with pytest.raises(RuntimeError, match="need 3 free blocks, have 2"):
        bm.allocate(make_seq(P10))
    check(bm)
    assert list(bm.free_queue) == [0, 1]


def test_eviction_is_least_recently_freed_first_with_block_removed_events():
    bm = make_bm(6)
    a = make_seq(P12 + [1])  # blocks 0,1,2 full, 3 partial
    b = make_seq(list(range(300, 305)))  # blocks 4, 5
    bm.allocate(a)
    bm.allocate(b)
    compute(bm, a)
    compute(bm, b)
    ha, hb = chain(a.token_ids, 3), chain(b.token_ids, 1)
    assert bm.hash_to_block == {ha[0]: 0, ha[1]: 1, ha[2]: 2, hb[0]: 4}
    bm.take_events()
    bm.free(a)  # -> 3 2 1 0
    bm.free(b)  # -> 3 2 1 0 5 4
    assert list(bm.free_queue) == [3, 2, 1, 0, 5, 4]
    # two new blocks: 3 (never hashed: partial) then 2 (a's last full block: evicted)
    c = make_seq(list(range(400, 406)))
    bm.allocate(c)
    check(bm)
    assert c.block_table == [3, 2]
    assert bm.take_events() == [removed_event([ha[2]])]
    assert ha[2] not in bm.hash_to_block and bm.blocks[2].block_hash is None
    # a's prefix (blocks 0, 1) is still cached and still served
    d = make_seq(P12 + [9, 9])
    assert bm.find_cached_blocks(d) == [0, 1]
    # the next eviction takes block 1 (freed before 0): the chain to block 0 survives
    e = make_seq([7])
    bm.allocate(e)
    assert e.block_table == [1]
    assert bm.take_events() == [removed_event([ha[1]])]
    assert bm.find_cached_blocks(d) == [0]
    check(bm)


def test_can_append_and_append_slots():
    bm = make_bm(3)
    a = make_seq([1, 2, 3, 4])
    bm.allocate(a)
    assert a.block_table == [0]
    a.token_ids.append(5)  # 5 tokens: needs a second block
    assert bm.can_append(a)  # room for the 5th token's KV
    assert bm.can_append(a, 8)  # tokens 5..12 -> 3 blocks
    assert not bm.can_append(a, 9)  # 13 tokens -> 4 blocks > 3
    bm.append_slots(a)
    assert a.block_table == [0, 1]
    bm.append_slots(a, 9)
    assert a.block_table == [0, 1, 2]
    assert bm.can_append(a, 8) and not bm.can_append(a, 9)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.append_slots(a, 13)
    check(bm)


# ----- prefix cache -----

def test_hashes_are_published_only_after_cache_computed_blocks():
    bm = make_bm(16)
    a = make_seq(P12 + [1])
    bm.allocate(a)
    b = make_seq(P12 + [2])
    assert bm.find_cached_blocks(b) == []  # nothing computed yet
    assert bm.take_events() == []
    compute(bm, a, 5)  # one full block computed
    h = chain(a.token_ids, 3)
    assert bm.take_events() == [stored_event([h[0]], None, P12[:4], BS)]
    assert bm.find_cached_blocks(b) == [0]
    compute(bm, a, 12)  # blocks 1, 2 computed: published with block 0's hash as parent
    assert bm.take_events() == [stored_event([h[1], h[2]], h[0], P12[4:12], BS)]
    assert bm.find_cached_blocks(b) == [0, 1, 2]
    compute(bm, a, 13)  # the partial block is never published
    assert bm.take_events() == []


def test_second_sequence_allocated_before_compute_gets_no_hit_and_later_one_does():
    bm = make_bm(16)
    a, b = make_seq(P12 + [1]), make_seq(P12 + [1])
    assert bm.allocate(a) == 0
    assert bm.allocate(b) == 0  # same "step": a's KV is not computed yet
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6, 7]
    compute(bm, a)
    compute(bm, b)  # identical blocks: first writer wins, nothing new to publish
    events = bm.take_events()
    assert len(events) == 1 and events[0].block_hashes == [to_wire_hash(h) for h in chain(P12, 3)]
    assert sorted(bm.hash_to_block.values()) == [0, 1, 2]
    c = make_seq(P12 + [1])
    assert bm.allocate(c) == 12
    assert c.block_table == [0, 1, 2, 8]
    assert refs(bm, [0, 1, 2, 3, 8]) == [2, 2, 2, 1, 1]
    assert bm.prefix_cache_queries == 39 and bm.prefix_cache_hits == 12
    check(bm)


def test_last_block_of_a_prompt_is_never_served_from_cache():
    bm = make_bm(16)
    a = make_seq(P12)  # exact multiple of the block size
    bm.allocate(a)
    compute(bm, a)
    assert len(bm.hash_to_block) == 3
    b = make_seq(P12)
    assert bm.find_cached_blocks(b) == [0, 1]  # len / bs - 1 blocks
    assert bm.allocate(b) == 8
    assert b.block_table == [0, 1, 3]
    c = make_seq(P12 + [5])  # one more token: the third block can be served
    assert bm.find_cached_blocks(c) == [0, 1, 2]
    one_block = make_seq(P12[:4])
    assert bm.find_cached_blocks(one_block) == []
    check(bm)


def test_shared_prefix_blocks_have_ref_counts_above_one():
    bm = make_bm(16)
    a = make_seq(P12 + [1])
    bm.allocate(a)
    compute(bm, a)
    b, c = make_seq(P12[:8] + [7, 7, 7]), make_seq(P12 + [9, 9])
    assert bm.allocate(b) == 8
    assert bm.allocate(c) == 12
    assert a.block_table == [0, 1, 2, 3]
    assert b.block_table == [0, 1, 4]
    assert c.block_table == [0, 1, 2, 5]
    assert refs(bm, [0, 1, 2, 3, 4, 5]) == [3, 3, 2, 1, 1, 1]
    bm.free(a)
    check(bm)
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 0]
    assert list(bm.free_queue) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3]
    bm.free(c)
    bm.free(b)
    check(bm)
    # c frees 5, 2; b frees 4, 1, 0 (shared blocks go when their last user frees them)
    assert list(bm.free_queue)[-6:] == [3, 5, 2, 4, 1, 0]


def test_reviving_a_free_cached_block_costs_a_free_block():
    bm = make_bm(6)
    a = make_seq(P12 + [1])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(P12 + [2])
    assert bm.admission_cost(b) == (1, 12)  # blocks in use: only the new tail block
    bm.free(a)
    assert bm.admission_cost(b) == (4, 12)  # 3 revived + 1 new
    assert list(bm.free_queue) == [4, 5, 3, 2, 1, 0]
    assert bm.allocate(b) == 12
    assert b.block_table == [0, 1, 2, 4]
    assert list(bm.free_queue) == [5, 3]
    assert bm.take_events() == [stored_event(chain(P12, 3), None, P12, BS)]  # no eviction
    check(bm)


def test_token_equality_guard_defeats_hash_collisions(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = make_bm(16)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute(bm, a)
    assert bm.hash_to_block == {42: 0}  # every block collides; the first writer owns the entry
    # different tokens under the same hash: no hit
    assert bm.find_cached_blocks(make_seq([5, 6, 7, 8, 1, 2, 3, 4, 0])) == []
    assert bm.find_cached_blocks(make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0])) == [0]
    # same tokens, same (colliding) hash, but at another position / after another prefix: the
    # KV of block 0 (positions 0..3) must not serve positions 4..7
    b = make_seq([1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert bm.find_cached_blocks(b) == [0]
    assert bm.allocate(b) == 4
    assert b.block_table == [0, 3, 4]
    check(bm)


def test_collision_guard_checks_the_parent_block_not_only_the_hash(monkeypatch):
    # two chains whose second blocks collide: the cached second block was computed after a
    # different first block, so it must not be served even though hash and tokens match
    real = hash_block
    monkeypatch.setattr(bm_module, "hash_block",
                        lambda parent, tokens: 7 if tuple(tokens) == (5, 5, 5, 5) else real(parent, tokens))
    bm = make_bm(16)
    a = make_seq([1, 1, 1, 1, 5, 5, 5, 5, 0])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq([1, 1, 1, 1, 5, 5, 5, 5, 0])
    assert bm.find_cached_blocks(b) == [0, 1]  # the genuine chain still hits
    c = make_seq([2, 2, 2, 2, 0])
    bm.allocate(c)
    compute(bm, c)
    d = make_seq([2, 2, 2, 2, 5, 5, 5, 5, 0])
    assert bm.find_cached_blocks(d) == [3]  # block 1 (computed after [1,1,1,1]) is not reused
    check(bm)


def test_prompt_logprobs_and_disabled_prefix_caching_get_no_hits():
    bm = make_bm(16)
    a = make_seq(P12 + [1])
    bm.allocate(a)
    compute(bm, a)
    assert bm.find_cached_blocks(make_seq(P12 + [1], prompt_logprobs=1)) == []
    off = make_bm(16, prefix=False)
    b = make_seq(P12 + [1])
    off.allocate(b)
    compute(off, b)
    assert off.hash_to_block == {} and off.take_events() == []
    assert off.find_cached_blocks(make_seq(P12 + [1])) == []
    assert off.prefix_cache_queries == 0


def test_partly_duplicate_blocks_publish_a_consistent_event():
    # b computed its first block at the same time as a (a duplicate, not published again): only
    # its second block is new, so the event names that block's parent and carries its tokens only
    bm = make_bm(16)
    a, b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0]), make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0])
    bm.allocate(a)
    bm.allocate(b)
    compute(bm, a)
    bm.take_events()
    compute(bm, b)
    hb = chain(b.token_ids, 2)
    assert bm.take_events() == [stored_event([hb[1]], hb[0], [9, 9, 9, 9], BS)]
    assert bm.hash_to_block[hb[0]] == 0 and bm.hash_to_block[hb[1]] == 4
    # b's second block was computed after b's own copy of block 0, which has a's block 0 content:
    # it is served on top of a's block 0
    assert bm.find_cached_blocks(make_seq(b.token_ids)) == [0, 4]
    assert bm.find_cached_blocks(make_seq(a.token_ids)) == [0, 1]


def test_reset_prefix_cache():
    bm = make_bm(8)
    a = make_seq(P12 + [1])
    bm.allocate(a)
    compute(bm, a)
    bm.take_events()
    assert bm.reset_prefix_cache() is False  # blocks in use
    assert len(bm.hash_to_block) == 3 and bm.take_events() == []
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    check(bm)
    assert bm.hash_to_block == {}
    assert all(b.block_hash is None and b.token_ids is None for b in bm.blocks)
    assert bm.take_events() == [AllBlocksCleared()]
    b = make_seq(P12 + [1])
    assert bm.allocate(b) == 0
    assert b.block_table == [4, 5, 6, 7]  # free-queue order kept: 4..7 then 3 2 1 0
    assert bm.take_events() == []  # no BlockRemoved for already-cleared blocks


# ----- dry-run claims (used by Scheduler.preview_admission) -----

def test_dry_run_claims_count_a_revived_block_once_and_see_evictions():
    bm = make_bm(8)
    a = make_seq(P12 + [1])
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)  # free queue: 4 5 6 7 3 2 1 0, blocks 0-2 cached
    b, c = make_seq(P12 + [2]), make_seq(P12 + [3])
    claims = DryRunClaims()
    assert bm.admission_cost(b, claims) == (4, 12)
    bm.claim(b, claims)
    assert claims.revived == {0, 1, 2} and claims.taken == {4}
    assert bm.admission_cost(c, claims) == (1, 12)  # revived by b: free for c
    # a claim that takes the cached blocks from the free-queue head evicts them for later ones
    claims2 = DryRunClaims()
    bm.claim_new_blocks(7, claims2)
    assert claims2.taken == {4, 5, 6, 7, 3, 2, 1}
    assert bm.admission_cost(c, claims2) == (4, 4)  # block 0 survives, block 1 was evicted
    # nothing real changed
    check(bm)
    assert list(bm.free_queue) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert refs(bm, list(range(8))) == [0] * 8
