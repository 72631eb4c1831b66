"""KV cache groups in the block manager and the scheduler (pure Python, fake model outputs).

A hybrid pool (:class:`atom.core.block_manager.BlockManager` with ``group_windows=(None, W)``:
gpt-oss's full and sliding layers) hands each sequence a full table and a sliding table from
one pool: exact block ids as the sliding table grows chunk by chunk and releases what falls out
of the window; the hybrid prefix-hit rule; the per-group "can never fit" bound (a tiny window
reserves a few blocks, not thousands: vLLM #54703); and, through the scheduler's
:class:`tests.core.test_scheduler.Driver` (which checks ref counts against every group's tables
after each step), a long sequence never holds more than ``ceil((W + chunk) / block) + 1``
sliding blocks and every block comes back after a finish, an abort and a preemption.
"""

from __future__ import annotations

from atom.core.block_manager import BlockManager
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import FinishReason, SequenceStatus
import pytest

from tests.core.test_scheduler import (BS, EOS, Driver, add_all, check_pool, make_seq, prompt,
                                       run_random_workload)

WINDOW = 8
CHUNK = 8


def hybrid_bm(num_blocks: int = 32, *, prefix: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=prefix, group_windows=(None, WINDOW))


def hybrid_scheduler(*, num_blocks: int = 64, max_model_len: int = 128,
                     max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK,
                             max_model_len=max_model_len, enable_chunked_prefill=True)
    return Scheduler(config, hybrid_bm(num_blocks), eos_token_ids=(EOS,))


def sliding_held(seq) -> int:
    return sum(b is not None for b in seq.group_block_tables[0]) if seq.group_block_tables else 0


def compute(bm: BlockManager, seq, num_tokens: int) -> None:
    """Play one step that computes ``num_tokens`` more tokens of ``seq``."""
    bm.append_slots(seq, seq.num_computed_tokens + num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.cache_computed_blocks(seq)
    bm.check_invariants()


def test_sliding_table_grows_by_chunk_and_releases_what_leaves_the_window():
    bm = hybrid_bm(32)
    seq = make_seq(prompt(30))
    assert bm.admission_cost(seq, token_budget=CHUNK) == (8 + 2, 0)  # 8 full, 2 sliding blocks
    assert bm.allocate(seq, token_budget=CHUNK) == 0
    assert seq.block_table == list(range(8))
    assert seq.group_block_tables == [[8, 9]]  # the first chunk's 8 tokens only
    compute(bm, seq, 8)  # next query at 8 sees keys 1..8: block 0 still needed
    assert seq.group_block_tables == [[8, 9]]
    compute(bm, seq, 8)  # next query at 16 sees 9..16: blocks 0 and 1 released
    assert seq.group_block_tables == [[None, None, 10, 11]]
    assert list(bm.free_queue)[-2:] == [8, 9]  # to the tail, oldest first
    compute(bm, seq, 8)
    assert seq.group_block_tables == [[None, None, None, None, 12, 13]]
    assert seq.block_table == list(range(8))  # the full group keeps everything
    compute(bm, seq, 6)
    bm.free(seq)
    assert bm.num_free_blocks == 32 and seq.group_block_tables == []
    bm.check_invariants()


def test_without_prefix_caching_released_blocks_are_simply_free():
    bm = hybrid_bm(16, prefix=False)
    seq = make_seq(prompt(40))
    bm.allocate(seq, token_budget=CHUNK)
    for _ in range(4):
        compute(bm, seq, 8)
    assert sliding_held(seq) == 2  # the next query (32) sees keys 25..32: blocks 6 and 7
    assert bm.num_free_blocks == 16 - 10 - 2 and not any(b.block_hash for b in bm.blocks)


def test_hybrid_prefix_hit_needs_the_full_chain_and_the_window_before_the_hit():
    bm = hybrid_bm(64)
    a = make_seq(prompt(33))
    bm.allocate(a, token_budget=CHUNK)
    for n in (8, 8, 8, 8, 1):
        compute(bm, a, n)
    full = list(a.block_table)
    # the sliding group's cached block of each full block (most released during the prefill)
    sliding = [bm._hash_index[1][h] for h in a.block_hashes[:8]]
    assert a.group_block_tables[0][:6] == [None] * 6
    bm.free(a)
    b = make_seq(prompt(32) + [7])  # 8 full blocks, the last token in a ninth
    num_hit_blocks, tables = bm.find_cached(b)
    assert num_hit_blocks == 8
    assert tables[0] == full[:8]
    # the next query (position 32) sees keys 25..32: blocks 6 and 7 of the sliding group
    assert tables[1] == [None] * 6 + sliding[6:8]
    # a sliding block of the window gone (a dry run's eviction): the hit shrinks to 7 blocks,
    # whose window (keys 21..28) needs sliding blocks 5 and 6, which are still cached
    num_hit_blocks, tables = bm.find_cached(b, taken={sliding[7]})
    assert num_hit_blocks == 7 and tables[1] == [None] * 5 + sliding[5:7]
    # the full chain broken at block 3: nothing past it, whatever the sliding group has
    assert bm.find_cached(b, taken={full[3]})[0] == 3
    assert bm.allocate(b, token_budget=CHUNK) == 32
    assert b.block_table[:8] == full[:8]
    assert b.group_block_tables[0][:8] == [None] * 6 + sliding[6:8]
    compute(bm, b, 1)
    bm.free(b)
    assert bm.num_free_blocks == 64
    bm.check_invariants()


def test_a_tiny_window_reserves_a_few_blocks_not_the_whole_sequence():
    # vLLM #54703: a sliding layer's need is its window plus one chunk, however long the prompt
    bm = BlockManager(8, 16, group_windows=(None, 1))
    assert bm.max_blocks_held(10_000, chunk_tokens=256) == 625 + 17
    assert bm.max_blocks_held(10_000, chunk_tokens=1) == 625 + 2
    assert bm.max_blocks_held(20, chunk_tokens=256) == 2 + 2  # never more than the sequence
    single = BlockManager(8, 16)
    assert single.max_blocks_held(10_000, chunk_tokens=256) == 625  # one group: as before


def test_a_long_sequence_holds_a_window_and_a_chunk_of_sliding_blocks():
    sched = hybrid_scheduler(num_blocks=64)
    long, other = add_all(sched, [make_seq(prompt(90), "long", max_tokens=30),
                                  make_seq(prompt(20, 5000), "short", max_tokens=5)])
    bm = sched.block_manager
    held: list[int] = []  # the peak of each step: after its blocks, before the release
    publish = bm.cache_computed_blocks
    bm.cache_computed_blocks = lambda seq: (held.append(sliding_held(seq)), publish(seq))[1]
    Driver(sched).run()
    bound = -(-(WINDOW + CHUNK) // BS) + 1
    assert max(held) == bound - 1  # within the bound, and near it: the count is not vacuous
    assert bm.max_blocks_held(120, chunk_tokens=CHUNK) == 30 + bound
    assert long.finish_reason is FinishReason.LENGTH and long.num_output_tokens == 30
    assert bm.num_free_blocks == bm.num_blocks
    check_pool(sched)


def test_a_pool_too_small_for_two_tables_of_the_sequence_still_runs_it():
    # 100 tokens: 25 full blocks + at most 5 sliding ones; a pool of 31 blocks would refuse it
    # if the sliding layers kept every block (50)
    sched = hybrid_scheduler(num_blocks=31)
    (seq,) = add_all(sched, [make_seq(prompt(96), max_tokens=4)])
    Driver(sched).run()
    assert seq.finish_reason is FinishReason.LENGTH and seq.error_message is None
    assert sched.block_manager.num_free_blocks == 31


def test_every_block_comes_back_after_abort_and_preemption():
    sched = hybrid_scheduler(num_blocks=16)
    seqs = add_all(sched, [make_seq(prompt(16, 1000 * (i + 1)), f"r{i}", max_tokens=24)
                           for i in range(3)])
    driver = Driver(sched)
    while sched.num_preemptions == 0:
        driver.step()
    aborted = next(s for s in seqs if s.status is SequenceStatus.RUNNING)
    sched.finish(aborted, FinishReason.ABORT)
    check_pool(sched)
    driver.run()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == 24 for s in seqs if s is not aborted)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("seed", range(20))
def test_random_hybrid_workloads_keep_every_invariant(seed):
    """The scheduler's random workloads (arrivals, n > 1, aborts, shared prefixes, tight pools,
    chunking on and off; ref counts against every group's tables and preview_admission checked
    each step) on a pool with a sliding group of window 5 (not a multiple of the block)."""
    run_random_workload(seed, group_windows=(None, 5))


def test_the_same_kv_memory_holds_about_twice_gpt_oss_tokens_at_long_context():
    """gpt-oss-20b's geometry (24 layers alternating window 128 and full, 8 KV heads of 64,
    bf16) in 1 GiB of KV cache, blocks of 16, chunks of 2048: the longest sequence the pool
    holds, with every layer's KV per block id (before) and with two groups sharing tensors."""
    from atom.config import EngineConfig
    from atom.kv_cache_spec import KVCacheSpec, kv_cache_bytes_per_block, kv_cache_groups

    specs = [KVCacheSpec(num_kv_heads=8, head_dim=64, sliding_window=None if i % 2 else 128)
             for i in range(24)]
    assert [len(g.layer_ids) for g in kv_cache_groups(specs)] == [12, 12]
    bytes_per_block = kv_cache_bytes_per_block(specs, itemsize=2, block_size=16)
    assert bytes_per_block == 12 * 2 * 8 * 64 * 2 * 16  # one group's layers, not 24
    config = EngineConfig(kv_cache_memory_bytes=1 << 30)
    before = config.resolved_num_kv_blocks(2 * bytes_per_block)  # every layer per block id
    after = config.resolved_num_kv_blocks(bytes_per_block)

    def longest(bm: BlockManager) -> int:
        num_tokens = 0
        while bm.max_blocks_held(num_tokens + 16, chunk_tokens=2048) <= bm.num_blocks:
            num_tokens += 16
        return num_tokens

    single = longest(BlockManager(before, 16))
    hybrid = longest(BlockManager(after, 16, group_windows=(None, 128)))
    assert single == before * 16
    assert 1.8 < hybrid / single < 2.0  # twice, less one window and chunk of sliding blocks


def test_events_name_the_group_only_in_a_hybrid_pool():
    """vLLM 0.32's group fields: on both groups' events of a hybrid pool (the sliding group's
    removals too), on none of a single group's (its wire bytes unchanged)."""
    bm = hybrid_bm(12)
    seq = make_seq(prompt(24))
    bm.allocate(seq)
    compute(bm, seq, 24)
    stored = bm.take_events()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, len(e.block_hashes))
            for e in stored] == [(0, "full_attention", None, 6), (1, "sliding_window", WINDOW, 6)]
    assert stored[1].block_hashes == stored[0].block_hashes  # one chain of hashes, two groups
    bm.free(seq)
    bm.allocate(make_seq(prompt(20, 5000)))  # 10 blocks: evicts cached blocks of both groups
    assert {e.group_idx for e in bm.take_events() if type(e).__name__ == "BlockRemoved"} == {0, 1}
    single = BlockManager(12, BS)
    seq = make_seq(prompt(24))
    single.allocate(seq)
    compute(single, seq, 24)
    (event,) = single.take_events()
    assert (event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
        None, None, None)
