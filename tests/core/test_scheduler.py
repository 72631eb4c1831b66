"""Unit tests of the scheduler with fake model outputs (pure Python, no torch, no model).

A :class:`Driver` plays the model: each step it calls ``schedule()``, checks the batch against
the budgets, "samples" scripted tokens for sequences that reach their end, calls
``update_from_output`` and checks the block pool's invariants.
"""

from __future__ import annotations

import random

import pytest

from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.block_manager import BlockManager
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.scheduler_output import AdmissionPreview, SchedulerOutput
from atom.core.sequence import FinishReason, Sequence, SequenceStatus

BS = 4
EOS = 2


# ----- factories and the fake model -----

def make_scheduler(*, num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 128, chunked: bool = True, prefix: bool = True,
                   group_windows: tuple[int | None, ...] = (None,)) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix, group_windows=group_windows)
    return Scheduler(config, bm, eos_token_ids=(EOS,))


def prompt(length: int, start: int = 1000) -> list[int]:
    return list(range(start, start + length))


def make_seq(tokens: list[int], request_id: str = "r", *, index: int = 0, **params) -> Sequence:
    params.setdefault("max_tokens", 4)
    return Sequence(request_id, list(tokens), SamplingParams(**params), index=index)


def scripted(seq: Sequence) -> int:
    """Default fake sampler: a token that depends only on (request, choice, output position)."""
    return 100 + 10 * seq.index + seq.num_output_tokens


class Driver:
    """Runs scheduler steps with scripted tokens and checks every step.

    Before each step it also checks that ``preview_admission`` has no side effects and predicts
    the prefills (admissions and partial-prefill chunks) the step schedules and their tokens;
    the prediction's count is kept in ``admittable``, its tokens in ``admittable_tokens``.
    """

    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.script = script or {}  # request_id -> tokens to sample, by output position
        self.outputs: list[SchedulerOutput] = []
        self.admittable: list[int] = []
        self.admittable_tokens: list[int] = []

    def sample(self, seq: Sequence) -> int:
        tokens = self.script.get(seq.request_id)
        return tokens[seq.num_output_tokens] if tokens is not None else scripted(seq)

    def step(self, *, allow_prefill: bool = True) -> SchedulerOutput:
        sched, cfg = self.sched, self.sched.config
        before = snapshot(sched)
        preview = sched.preview_admission()
        assert snapshot(sched) == before
        waiting = {s.seq_id for s in sched.waiting}
        partial = {s.seq_id for s in sched.running if s.is_prefill}
        out = sched.schedule(allow_prefill=allow_prefill)
        check_pool(sched)
        started = [(seq, n) for seq, n in out.scheduled
                   if seq.seq_id in waiting or seq.seq_id in partial]
        if allow_prefill:
            assert len(started) == preview.num_prefills, (preview, ids(out))
            assert sum(n for _, n in started) == preview.num_prefill_tokens, (preview, ids(out))
        else:
            assert started == []
        self.admittable.append(preview.num_prefills)
        self.admittable_tokens.append(preview.num_prefill_tokens)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert len({seq.seq_id for seq, _ in out.scheduled}) == len(out.scheduled)
        sampled = {}
        for seq, num_new in out.scheduled:
            assert seq.status is SequenceStatus.RUNNING and num_new >= 1
            end = seq.num_computed_tokens + num_new
            assert end <= len(seq.token_ids)
            for table in sched.block_manager.tables(seq):  # blocks cover what is computed
                assert len(table) * BS >= end and table[(end - 1) // BS] is not None
            if not seq.is_prefill:  # a decode: exactly the last (sampled) token
                assert num_new == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1
                assert seq.num_computed_tokens >= seq.num_prompt_tokens  # never mid-prompt
            if end == len(seq.token_ids):
                sampled[seq.seq_id] = self.sample(seq)
        sched.update_from_output(out, ModelRunnerOutput.from_tokens(sampled))
        check_pool(sched)
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 200) -> int:
        for num_steps in range(max_steps):
            if not self.sched.has_unfinished():
                return num_steps
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")


def check_pool(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING and seq.block_table
    # ref count of each block == number of running sequences holding it
    holders: dict[int, int] = {}
    for seq in sched.running:
        for table in bm.tables(seq):  # every KV cache group's (released blocks are None)
            for b in table:
                if b is not None:
                    holders[b] = holders.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block.block_id


def snapshot(sched: Scheduler) -> tuple:
    """Everything preview_admission must leave untouched."""
    bm = sched.block_manager
    seqs = [*sched.waiting, *sched.running]
    return (
        [s.seq_id for s in sched.waiting], [s.seq_id for s in sched.running],
        [(s.status, s.num_computed_tokens, [list(t) for t in bm.tables(s)], list(s.token_ids),
          s.num_cached_tokens) for s in seqs],
        list(bm.free_queue),
        [(b.ref_count, b.block_hash, b.token_ids, b.parent, b.generation) for b in bm.blocks],
        dict(bm.hash_to_block), list(bm.events), dict(bm._num_hashed_blocks),
        bm.prefix_cache_queries, bm.prefix_cache_hits, sched.num_preemptions,
    )


def ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in out.scheduled]


def add_all(sched: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    for seq in seqs:
        assert sched.add(seq)
    return seqs


# ----- budgets -----

def test_max_num_seqs_limits_admissions():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = add_all(sched, [make_seq(prompt(5), "a", max_tokens=2),
                              make_seq(prompt(5, 2000), "b", max_tokens=3),
                              make_seq(prompt(5, 3000), "c", max_tokens=1)])
    d = Driver(sched)
    assert ids(d.step()) == [("a", 5), ("b", 5)]
    assert list(sched.waiting) == [c]
    assert ids(d.step()) == [("a", 1), ("b", 1)]  # a finishes (2 tokens)
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [100, 101]
    assert ids(d.step()) == [("b", 1), ("c", 5)]
    assert c.is_finished and b.is_finished and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 64


def test_max_num_batched_tokens_with_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=10)
    add_all(sched, [make_seq(prompt(6), "a"), make_seq(prompt(6, 2000), "b"), make_seq(prompt(3, 3000), "c")])
    d = Driver(sched)
    assert ids(d.step()) == [("a", 6), ("b", 4)]  # b gets a chunk, c waits (budget spent)
    assert ids(d.step()) == [("a", 1), ("b", 2), ("c", 3)]
    d.run()


def test_max_num_batched_tokens_without_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=10, chunked=False)
    add_all(sched, [make_seq(prompt(6), "a"), make_seq(prompt(6, 2000), "b"), make_seq(prompt(3, 3000), "c")])
    d = Driver(sched)
    assert ids(d.step()) == [("a", 6)]  # b does not fit whole; c waits behind it (FCFS)
    assert ids(d.step()) == [("a", 1), ("b", 6), ("c", 3)]
    d.run()


def test_chunked_prefill_splits_a_long_prompt_and_never_decodes_mid_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_seq(prompt(9), "a", max_tokens=2)
    sched.add(a)
    d = Driver(sched)
    assert ids(d.step()) == [("a", 4)]
    assert a.num_computed_tokens == 4 and a.output_token_ids == [] and a.is_prefill
    assert ids(d.step()) == [("a", 4)]
    # one prompt token left: still a prefill chunk, not a decode
    assert a.num_computed_tokens == 8 and len(a) == 9 and a.is_prefill
    assert sched.has_pending_prefill()
    assert ids(d.step()) == [("a", 1)]
    assert a.output_token_ids == [100] and not a.is_prefill
    assert ids(d.step()) == [("a", 1)]
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [100, 101]


def test_last_prompt_token_chunk_is_held_when_prefill_is_not_allowed():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_seq(prompt(9), "a")
    sched.add(a)
    d = Driver(sched)
    d.step()
    d.step()
    assert a.num_computed_tokens == 8
    out = d.step(allow_prefill=False)
    assert out.is_empty and sched.has_pending_prefill() and a.num_computed_tokens == 8
    assert ids(d.step()) == [("a", 1)] and a.output_token_ids == [100]


def test_decodes_go_first_and_a_partial_prefill_continues_in_later_steps():
    sched = make_scheduler(max_num_batched_tokens=6)
    a = make_seq(prompt(3), "a", max_tokens=10)
    sched.add(a)
    d = Driver(sched)
    d.step()
    b = make_seq(prompt(13, 2000), "b", max_tokens=1)
    sched.add(b)
    assert ids(d.step()) == [("a", 1), ("b", 5)]
    assert ids(d.step()) == [("a", 1), ("b", 5)]
    assert ids(d.step()) == [("a", 1), ("b", 3)]
    assert b.finish_reason is FinishReason.LENGTH and b.output_token_ids == [100]
    assert b.num_cached_tokens == 0


# ----- requests that can never run -----

@pytest.mark.parametrize("tokens, kwargs, message", [
    ([], {}, "the prompt is empty"),
    (prompt(33), {}, "more than max_model_len=32"),
    (prompt(21), {"num_blocks": 5}, "needs 6 KV blocks but the whole pool has 5"),
    (prompt(11), {"chunked": False}, "more than max_num_batched_tokens=10 with chunked prefill off"),
])
def test_a_request_that_can_never_run_fails_at_add_and_others_still_run(tokens, kwargs, message):
    sched = make_scheduler(max_model_len=32, max_num_batched_tokens=10, **kwargs)
    bad = make_seq(tokens, "bad")
    assert sched.add(bad) is False
    assert bad.is_finished and bad.finish_reason is FinishReason.ERROR
    assert message in bad.error_message and bad.block_table == []
    assert sched.num_waiting == 0
    good = make_seq(prompt(8), "good", max_tokens=3)
    assert sched.add(good)
    Driver(sched).run()
    assert good.finish_reason is FinishReason.LENGTH and good.output_token_ids == [100, 101, 102]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_chunked_prefill_accepts_a_prompt_bigger_than_the_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_seq(prompt(25), "a", max_tokens=1)
    assert sched.add(a)
    d = Driver(sched)
    assert d.run() == 3
    assert [ids(o) for o in d.outputs] == [[("a", 10)], [("a", 10)], [("a", 5)]]


# ----- stopping -----

def run_one(seq: Sequence, script: list[int], **sched_kwargs) -> Sequence:
    sched = make_scheduler(**sched_kwargs)
    sched.add(seq)
    Driver(sched, {seq.request_id: script}).run()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return seq


def test_eos_stops_and_is_kept_as_the_last_output_token():
    seq = run_one(make_seq(prompt(5), max_tokens=10), [7, 8, EOS, 9, 9])
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason is None
    assert seq.output_token_ids == [7, 8, EOS]


def test_ignore_eos_generates_up_to_max_tokens():
    seq = run_one(make_seq(prompt(5), max_tokens=4, ignore_eos=True), [EOS, 8, EOS, 9, 9])
    assert seq.finish_reason is FinishReason.LENGTH and seq.output_token_ids == [EOS, 8, EOS, 9]


def test_stop_token_ids_stop_with_the_id_as_stop_reason():
    seq = run_one(make_seq(prompt(5), max_tokens=10, stop_token_ids=[55, 66]), [7, 66, 55])
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason == 66
    assert seq.output_token_ids == [7, 66]


def test_max_tokens_stops_with_length():
    seq = run_one(make_seq(prompt(5), max_tokens=3), [7, 8, 9, 10])
    assert seq.finish_reason is FinishReason.LENGTH and seq.stop_reason is None
    assert seq.output_token_ids == [7, 8, 9]


def test_min_tokens_ignores_eos_and_stop_ids_until_reached():
    seq = run_one(make_seq(prompt(5), max_tokens=10, min_tokens=3, stop_token_ids=[55]),
                  [EOS, 55, EOS, EOS, 9])
    # min_tokens=3 output tokens come before the stopping EOS
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == [EOS, 55, EOS, EOS]
    seq = run_one(make_seq(prompt(5), max_tokens=10, min_tokens=2, stop_token_ids=[55]), [7, 8, 55])
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason == 55


def test_reaching_max_model_len_finishes_with_length():
    seq = run_one(make_seq(prompt(9), max_tokens=None), [7] * 20, max_model_len=12)
    assert seq.finish_reason is FinishReason.LENGTH
    assert len(seq) == 12 and seq.output_token_ids == [7, 7, 7]


def test_prompt_of_exactly_max_model_len_gets_one_token():
    seq = run_one(make_seq(prompt(12), max_tokens=None), [7] * 20, max_model_len=12)
    assert seq.finish_reason is FinishReason.LENGTH and seq.output_token_ids == [7]


# ----- abort and finish from outside -----

def abort(sched: Scheduler, request_id: str) -> list[Sequence]:
    """What EngineCore.abort_requests does: finish every unfinished sequence of the request."""
    seqs = [s for s in (*sched.waiting, *sched.running) if s.request_id == request_id]
    for seq in seqs:
        sched.finish(seq, FinishReason.ABORT)
    return seqs


def test_abort_frees_blocks_of_running_and_waiting_sequences():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = add_all(sched, [make_seq(prompt(10), "a", max_tokens=20), make_seq(prompt(5), "b")])
    d = Driver(sched)
    d.step()
    assert a.block_table == [0, 1, 2] and sched.block_manager.num_free_blocks == 5
    assert abort(sched, "a") == [a]
    check_pool(sched)
    assert a.finish_reason is FinishReason.ABORT and a.block_table == []
    assert sched.block_manager.num_free_blocks == 8
    assert list(sched.block_manager.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert abort(sched, "b") == [b] and b.finish_reason is FinishReason.ABORT
    assert not sched.has_unfinished() and abort(sched, "b") == []


def test_finish_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a = make_seq(prompt(5), "a", max_tokens=5)
    sched.add(a)
    Driver(sched).step()
    out = sched.schedule()
    sched.finish(a, FinishReason.STOP, stop_reason="###")
    assert sched.update_from_output(out, ModelRunnerOutput.from_tokens({a.seq_id: 7})) == []
    assert a.output_token_ids == [100] and a.stop_reason == "###"
    check_pool(sched)
    assert sched.block_manager.num_free_blocks == 64


# ----- prefix cache through the scheduler -----

def test_same_prompt_in_the_same_step_gets_no_hit_a_step_later_it_does():
    sched = make_scheduler()
    p = prompt(13)
    a, b = add_all(sched, [make_seq(p, "a", max_tokens=3), make_seq(p, "b", max_tokens=3)])
    d = Driver(sched)
    assert ids(d.step()) == [("a", 13), ("b", 13)]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6, 7]
    c = make_seq(p, "c", max_tokens=3)
    sched.add(c)
    assert ids(d.step()) == [("a", 1), ("b", 1), ("c", 1)]
    assert c.num_cached_tokens == 12 and c.block_table == [0, 1, 2, 8]
    assert [sched.block_manager.blocks[i].ref_count for i in range(9)] == [2, 2, 2, 1, 1, 1, 1, 1, 1]
    d.run()
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids == [100, 101, 102]
    assert sched.block_manager.num_free_blocks == 64


# ----- preemption -----

def run_pair(num_blocks: int, *, chunked: bool = True, prefix: bool = True,
             max_num_batched_tokens: int = 64) -> tuple[Scheduler, Driver, list[Sequence]]:
    sched = make_scheduler(num_blocks=num_blocks, chunked=chunked, prefix=prefix,
                           max_num_batched_tokens=max_num_batched_tokens)
    seqs = add_all(sched, [make_seq(prompt(7), "a", max_tokens=10),
                           make_seq(prompt(7, 2000), "b", max_tokens=10)])
    script = {"a": list(range(300, 310)), "b": list(range(400, 410))}
    return sched, Driver(sched, script), seqs


def test_preemption_by_recompute_keeps_outputs_and_matches_an_unpressured_run():
    sched_ref, d_ref, (a_ref, b_ref) = run_pair(64)
    d_ref.run()
    assert sched_ref.num_preemptions == 0
    sched, d, (a, b) = run_pair(6)
    # 2 blocks each after prefill; each grows to 16 tokens of KV (4 blocks): 8 > 6
    preempted_seen = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = d.step()
        if out.preempted:
            assert out.preempted == [b]
            assert sched.waiting[0] is b and b.status is SequenceStatus.WAITING
            assert b.block_table == [] and b.num_computed_tokens == 0
            assert b.num_output_tokens > 0  # keeps what it generated
            assert all(seq is not b for seq, _ in out.scheduled)
            preempted_seen.append(list(b.output_token_ids))
    assert preempted_seen and sched.num_preemptions == len(preempted_seen)
    assert b.num_preemptions == len(preempted_seen) and a.num_preemptions == 0
    assert a.output_token_ids == a_ref.output_token_ids == list(range(300, 310))
    assert b.output_token_ids == b_ref.output_token_ids == list(range(400, 410))
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 6


@pytest.mark.parametrize("prefix", [True, False])
def test_preempted_sequence_longer_than_the_budget_resumes_with_chunking_off(prefix):
    # chunking off, budget 10: b is preempted with 12 tokens; it must still resume (in chunks)
    sched, d, (a, b) = run_pair(6, chunked=False, prefix=prefix, max_num_batched_tokens=10)
    d.run()
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert max(n for o in d.outputs for s, n in o.scheduled if s is b) <= 10
    assert b.output_token_ids == list(range(400, 410))
    assert sched.block_manager.num_free_blocks == 6


def test_resumed_sequence_reuses_its_own_cached_blocks():
    sched, d, (a, b) = run_pair(6)
    bm = sched.block_manager
    for _ in range(7):
        d.step()
    out = d.outputs[-1]
    # b held [2, 3, 5] (13 tokens, 12 computed): freed 5, 3, 2 to the tail; a took 5 at once
    assert out.preempted == [b] and a.block_table == [0, 1, 4, 5]
    assert list(bm.free_queue) == [3, 2]
    for _ in range(3):
        assert ids(d.step()) == [("a", 1)]  # b waits: it needs 4 blocks
    assert a.is_finished
    hits_before = bm.prefix_cache_hits
    assert ids(d.step()) == [("b", 5)]  # its first two blocks come back from the cache
    assert b.block_table == [2, 3, 5, 4] and bm.prefix_cache_hits - hits_before == 8
    assert b.num_cached_tokens == 0  # reported for the first admission only
    d.run()
    assert b.output_token_ids == list(range(400, 410))


def test_a_sequence_bigger_than_the_whole_pool_finishes_when_alone():
    sched = make_scheduler(num_blocks=3, max_model_len=64)
    a = make_seq(prompt(10), "a", max_tokens=20)
    sched.add(a)
    d = Driver(sched)
    d.run()
    assert a.finish_reason is FinishReason.LENGTH and "KV pool is full" in a.error_message
    assert len(a) == 13  # KV for 12 tokens fits 3 blocks; the 13th cannot be computed
    assert sched.block_manager.num_free_blocks == 3
    assert any(a in o.preempted for o in d.outputs)


def test_every_block_is_free_after_a_mixed_workload():
    sched = make_scheduler(num_blocks=9, max_num_seqs=3, max_num_batched_tokens=9)
    seqs = [make_seq(prompt(3 + 2 * i, 1000 + 7 * (i % 3)), f"r{i}", max_tokens=4 + 3 * (i % 4))
            for i in range(8)]
    add_all(sched, seqs)
    d = Driver(sched)
    d.run()
    bm = sched.block_manager
    assert sched.num_preemptions == 2 and bm.prefix_cache_hits == 40  # both paths exercised
    for i, seq in enumerate(seqs):
        assert seq.finish_reason is FinishReason.LENGTH and seq.error_message is None
        assert seq.output_token_ids == [100 + j for j in range(4 + 3 * (i % 4))]
    assert bm.num_free_blocks == 9 and all(b.ref_count == 0 for b in bm.blocks)
    assert bm.reset_prefix_cache() and bm.hash_to_block == {}


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_every_invariant(seed):
    """Arrivals, n > 1, aborts, shared prefixes, tight pools, chunking on and off: the driver
    checks budgets, pool invariants and preview_admission every step; outputs match the script."""
    run_random_workload(seed)


def run_random_workload(seed: int, group_windows: tuple[int | None, ...] = (None,)) -> None:
    """:func:`test_random_workloads_keep_every_invariant`'s workload on a pool of
    ``group_windows`` KV cache groups (tests/core/test_kv_cache_groups.py: a hybrid pool)."""
    rng = random.Random(seed)
    max_model_len = 40
    extra = 4 * (len(group_windows) - 1)  # the sliding groups' blocks
    sched = make_scheduler(num_blocks=rng.randint(6, 14) + extra, max_num_seqs=rng.randint(1, 5),
                           max_num_batched_tokens=rng.randint(8, 24), max_model_len=max_model_len,
                           chunked=rng.random() < 0.6, prefix=rng.random() < 0.8,
                           group_windows=group_windows)
    bases = [prompt(30, 1000 * k) for k in range(3)]
    d = Driver(sched)
    seqs: list[Sequence] = []
    for _ in range(500):
        if rng.random() < 0.4 and len(seqs) < 12:
            tokens = rng.choice(bases)[:rng.randint(1, 20)] + [rng.randint(0, 9)]
            max_tokens = rng.randint(1, 16)
            for index in range(rng.choice([1, 1, 1, 2, 3])):
                seqs.append(make_seq(tokens, f"q{len(seqs)}", index=index, max_tokens=max_tokens))
                sched.add(seqs[-1])
        if seqs and rng.random() < 0.03:
            abort(sched, rng.choice(seqs).request_id)
        if sched.has_unfinished():
            d.step()
        elif len(seqs) >= 12:
            break
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    for seq in seqs:
        assert seq.is_finished
        assert seq.output_token_ids == [100 + 10 * seq.index + j for j in range(seq.num_output_tokens)]
        if seq.finish_reason is FinishReason.LENGTH and seq.error_message is None:
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or len(seq) == max_model_len


# ----- allow_prefill=False: the cross-rank hold -----

def test_holding_admits_nothing_and_schedules_no_prefill_chunks_but_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(prompt(3), "a", max_tokens=10)
    sched.add(a)
    d = Driver(sched)
    d.step()  # a: prefilled, now decoding
    b = make_seq(prompt(20, 2000), "b")
    sched.add(b)
    assert ids(d.step()) == [("a", 1), ("b", 7)]  # b: mid-prompt
    c = make_seq(prompt(3, 3000), "c")
    sched.add(c)
    for _ in range(2):
        out = d.step(allow_prefill=False)
        assert ids(out) == [("a", 1)] and sched.has_pending_prefill()
        assert b.num_computed_tokens == 7 and list(sched.waiting) == [c]
    out = d.step()
    assert ids(out) == [("a", 1), ("b", 7)]
    assert ids(d.step()) == [("a", 1), ("b", 6), ("c", 1)]


def test_holding_keeps_a_waiting_sequence_queued():
    sched = make_scheduler()
    assert sched.schedule(allow_prefill=False).is_empty
    sched.add(make_seq(prompt(3)))
    out = sched.schedule(allow_prefill=False)
    assert out.is_empty and sched.has_pending_prefill() and sched.num_waiting == 1


# ----- preview_admission: a side-effect-free dry run of admission -----

def check_admittable(d: Driver) -> int:
    """One step; returns the previewed number of prefills, checked by the driver (count and
    tokens) against what was scheduled."""
    d.step()
    return d.admittable[-1]


def test_preview_admission_budget_limited():
    for chunked, expected in ((False, 2), (True, 3)):
        sched = make_scheduler(max_num_batched_tokens=16, chunked=chunked)
        add_all(sched, [make_seq(prompt(6, 1000 * i), f"r{i}") for i in range(4)])
        d = Driver(sched)
        assert check_admittable(d) == expected
        check_admittable(d)
        check_admittable(d)


def test_preview_admission_block_limited():
    sched = make_scheduler(num_blocks=5)
    add_all(sched, [make_seq(prompt(8, 1000 * i), f"r{i}", max_tokens=1) for i in range(1, 4)])
    d = Driver(sched)
    assert check_admittable(d) == 2
    assert check_admittable(d) == 1


def test_preview_admission_seq_limited():
    sched = make_scheduler(max_num_seqs=3)
    add_all(sched, [make_seq(prompt(3), "run", max_tokens=10)])
    d = Driver(sched)
    d.step()
    add_all(sched, [make_seq(prompt(3, 1000 * i), f"r{i}") for i in range(1, 5)])
    assert check_admittable(d) == 2
    assert check_admittable(d) == 0  # 3 running: seq-limited


def test_preview_admission_counts_partial_prefills():
    sched = make_scheduler(max_num_batched_tokens=8)
    add_all(sched, [make_seq(prompt(20), "long"), make_seq(prompt(3, 2000), "short")])
    d = Driver(sched)
    assert check_admittable(d) == 1  # long gets all 8 tokens
    assert check_admittable(d) == 1  # long continues: a partial prefill
    assert check_admittable(d) == 2  # long's last 4 tokens + short
    assert check_admittable(d) == 0  # both decoding


def test_preview_admission_tokens_are_chunks_within_the_budget_left_by_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    add_all(sched, [make_seq(prompt(3), "dec", max_tokens=10)])
    d = Driver(sched)
    d.step()  # dec decodes from now on: one token of each step's budget
    add_all(sched, [make_seq(prompt(20, 2000), "long")])
    assert sched.preview_admission() == AdmissionPreview(num_prefills=1, num_prefill_tokens=7)
    d.step()
    assert sched.preview_admission() == AdmissionPreview(1, 7)  # the partial's next chunk
    d.step()
    assert sched.preview_admission() == AdmissionPreview(1, 6)  # its remaining 6 tokens
    d.step()
    assert sched.preview_admission() == AdmissionPreview(0, 0)
    assert d.admittable_tokens == [3, 7, 7, 6]  # dec's prompt first


def test_preview_admission_tokens_exclude_prefix_cache_hits():
    sched = make_scheduler()
    p = prompt(12)
    add_all(sched, [make_seq(p + [1], "warm", max_tokens=1)])
    d = Driver(sched)
    d.run()  # the prompt's 3 full blocks are cached
    add_all(sched, [make_seq(p + [2, 3], "hit", max_tokens=1)])
    assert sched.preview_admission() == AdmissionPreview(1, 2)  # 14 tokens, 12 cached
    d.step()


def test_waiting_age_counts_steps_since_entering_the_queue():
    sched = make_scheduler(num_blocks=5)
    a, b = add_all(sched, [make_seq(prompt(8), "a", max_tokens=8),
                           make_seq(prompt(8, 2000), "b", max_tokens=8)])
    assert sched.oldest_waiting_age_steps() == 0 and sched.num_running_decodes() == 0
    d = Driver(sched)
    d.step(allow_prefill=False)
    d.step(allow_prefill=False)
    assert sched.oldest_waiting_age_steps() == 2
    d.step()  # both admitted: 4 of 5 blocks
    assert sched.oldest_waiting_age_steps() == 0 and sched.num_running_decodes() == 2
    c = make_seq(prompt(2, 3000), "c")
    sched.add(c)
    d.step()  # both decodes need a third block: b is preempted, its age starts over
    assert list(sched.waiting) == [b, c] and sched.num_running_decodes() == 1
    assert (b.waiting_since_step, c.waiting_since_step) == (4, 3)
    assert sched.oldest_waiting_age_steps() == 1  # c's


def test_partial_prefill_is_not_a_running_decode():
    sched = make_scheduler(max_num_batched_tokens=8)
    add_all(sched, [make_seq(prompt(20), "long")])
    d = Driver(sched)
    d.step()
    assert sched.has_partial_prefill() and sched.num_running_decodes() == 0
    d.step()
    d.step()
    assert not sched.has_partial_prefill() and sched.num_running_decodes() == 1


def test_preview_admission_accounts_for_decode_blocks():
    # a's decode needs a new block this step: one fewer block for admissions
    sched = make_scheduler(num_blocks=4)
    add_all(sched, [make_seq(prompt(7), "a", max_tokens=5)])
    d = Driver(sched)
    d.step()  # a: 8 tokens, 2 blocks; its next decode computes token 8 -> needs block 3
    d.step()
    assert len(sched.running[0]) == 9 and len(sched.running[0].block_table) == 2
    add_all(sched, [make_seq(prompt(5, 2000), "b")])  # needs 2 blocks; only 1 left after a's
    assert check_admittable(d) == 0
    assert sched.num_waiting == 1


def test_preview_admission_counts_a_shared_cached_prefix_once():
    sched = make_scheduler(num_blocks=7)
    p = prompt(12)
    add_all(sched, [make_seq(p + [1], "warm", max_tokens=1)])
    d = Driver(sched)
    d.run()  # blocks 0-2 cached and free
    add_all(sched, [make_seq(p + [2], "a", max_tokens=1), make_seq(p + [3], "b", max_tokens=1)])
    # a: 3 revived + 1 new; b: 1 new (a revived the prefix) -> 5 <= 7
    assert check_admittable(d) == 2


def test_preview_admission_sees_evictions_by_earlier_admissions():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=28, chunked=False)
    bm = sched.block_manager
    d = Driver(sched)
    add_all(sched, [make_seq(prompt(8) + [1], "warm", max_tokens=1)])
    d.run()  # blocks 0, 1 cached (2: partial)
    add_all(sched, [make_seq(prompt(28, 5000), "z", max_tokens=1)])
    d.run()  # z used 3..9: the cached blocks are now at the head of the free queue
    assert list(bm.free_queue) == [2, 1, 0, 9, 8, 7, 6, 5, 4, 3]
    sched.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=11, max_model_len=128,
                                   enable_chunked_prefill=False)
    # x takes blocks 2 and 1, evicting block 1: y then hits block 0 only and has 5 tokens to
    # compute, more than the 3 left (it would have had 1 with both hits)
    x, y = add_all(sched, [make_seq(prompt(8, 7000), "x", max_tokens=3),
                           make_seq(prompt(8) + [2], "y", max_tokens=1)])
    assert check_admittable(d) == 1
    assert x.block_table == [2, 1] and list(sched.waiting) == [y]
    # x's decode takes block 0 (the free-queue head) first, evicting y's last hit: the dry run
    # must see that too
    assert bm.find_cached_blocks(y) == [0]
    assert check_admittable(d) == 1
    assert x.block_table == [2, 1, 0] and y.num_cached_tokens == 0


def test_preview_admission_waits_for_a_sibling_in_prefill():
    sched = make_scheduler()
    p = prompt(9)
    add_all(sched, [make_seq(p, "n2", index=0), make_seq(p, "n2", index=1)])
    d = Driver(sched)
    assert check_admittable(d) == 1
    assert check_admittable(d) == 1


def test_preview_admission_is_zero_when_a_decode_must_preempt():
    sched = make_scheduler(num_blocks=5)
    a, b = add_all(sched, [make_seq(prompt(8), "a"), make_seq(prompt(8, 2000), "b")])
    d = Driver(sched)
    d.step()  # 4 blocks used, 1 free; both decodes need a third block next step
    c = make_seq(prompt(2, 3000), "c")  # would fit the free block
    sched.add(c)
    assert sched.block_manager.num_free_blocks == 1
    assert check_admittable(d) == 0
    out = d.outputs[-1]
    assert out.preempted == [b] and ids(out) == [("a", 1)] and list(sched.waiting) == [b, c]
    assert a.block_table == [0, 1, 4] and list(sched.block_manager.free_queue) == [3, 2]


# ----- n > 1 -----

def test_siblings_wait_for_the_first_choice_prefill_then_hit_the_prefix_cache():
    sched = make_scheduler(max_num_batched_tokens=8)
    p = prompt(13)
    seqs = add_all(sched, [make_seq(p, "n", index=i, max_tokens=3) for i in range(3)])
    d = Driver(sched)
    assert [(s.index, n) for s, n in d.step().scheduled] == [(0, 8)]
    assert [s.index for s in sched.waiting] == [1, 2]
    assert [(s.index, n) for s, n in d.step().scheduled] == [(0, 5)]  # index 0 still in prefill
    out = d.step()
    assert [(s.index, n) for s, n in out.scheduled] == [(0, 1), (1, 1), (2, 1)]
    s0, s1, s2 = seqs
    assert s1.num_cached_tokens == s2.num_cached_tokens == 12
    assert s1.block_table[:3] == s2.block_table[:3] == s0.block_table[:3] == [0, 1, 2]
    assert [sched.block_manager.blocks[i].ref_count for i in range(3)] == [3, 3, 3]
    d.run()
    assert [s.output_token_ids for s in seqs] == [[100, 101, 102], [110, 111, 112], [120, 121, 122]]
