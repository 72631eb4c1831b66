"""Speculative decoding in the scheduler and block manager, with a fake deterministic model.

The fake target's greedy next token is a function of the whole sequence (mostly a copy of the
token five back, so the n-gram proposer finds matches, with an edit every seventh position and
EOS at some positions). A speculative run must produce exactly the non-speculative run's tokens
and finishes, whatever the proposer guessed: the verifier here is greedy verification against
that function. Every step checks the budgets, the reserved slots, the pool's invariants and
that no hashed block holds a token that is not the sequence's own; every run ends with every
block back in the pool. Pure Python (no torch, no model).
"""

from __future__ import annotations

import pytest

from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.block_manager import BlockManager, hash_block
from atom.core.ngram_proposer import NgramProposer
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import FinishReason, Sequence

BS = 4
EOS = 2
K = 3


def target(tokens: list[int]) -> int:
    """The fake model's greedy next token after ``tokens``."""
    n = len(tokens)
    if n % 23 == 0:
        return EOS
    if n % 7 == 0:
        return 10 + (tokens[-1] * 3) % 40
    return tokens[n - 5]


def make_scheduler(*, spec: str | None, num_blocks: int = 64, max_num_batched_tokens: int = 64,
                   max_model_len: int = 128, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len,
                             num_speculative_tokens=K if spec else 0)
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3) if spec == "ngram" else None
    return Scheduler(config, BlockManager(num_blocks, BS), eos_token_ids=(EOS,), proposer=proposer)


def make_seqs(specs: list[dict]) -> list[Sequence]:
    seqs = []
    for i, spec in enumerate(specs):
        spec = dict(spec)
        length = spec.pop("prompt_len", 9)
        tokens = [20 + (i * 5 + j) % 13 for j in range(length)]
        seqs.append(Sequence(f"r{i}", tokens, SamplingParams(**spec)))
    return seqs


def verify(seq: Sequence) -> list[int]:
    """Greedy verification of ``seq``'s drafts against the fake target."""
    context, out = list(seq.token_ids), []
    for draft in seq.spec_token_ids:
        token = target(context)
        out.append(token)
        if token != draft:
            return out
        context.append(draft)
    return out + [target(context)]


def check_step(sched: Scheduler, out, *, draft_fn=None) -> None:
    """Budgets and reservations of one scheduled step (before the drafts of a model-based
    proposer are set: ``draft_fn`` plays that proposer)."""
    cfg, bm = sched.config, sched.block_manager
    assert out.num_batched_tokens + out.num_spec_tokens <= cfg.max_num_batched_tokens
    for seq, n in out.scheduled:
        budget = out.spec_budget.get(seq.seq_id, 0)
        if budget:
            assert not seq.is_prefill and n == 1
            assert budget <= K
            if seq.sampling_params.max_tokens is not None:
                assert seq.num_output_tokens + budget + 1 <= seq.sampling_params.max_tokens
            assert len(seq.block_table) == bm.num_required_blocks(len(seq.token_ids) + budget)
    if draft_fn is not None:
        seqs = [s for s, _ in out.scheduled if s.seq_id in out.spec_budget]
        sched.set_spec_tokens(out, seqs, [draft_fn(s, out.spec_budget[s.seq_id]) for s in seqs])
    for seq, _ in out.scheduled:
        assert len(seq.spec_token_ids) == out.spec_budget.get(seq.seq_id, 0)


def check_hashed_blocks(sched: Scheduler) -> None:
    """Every hashed block of a running sequence holds that sequence's own (accepted) tokens."""
    bm = sched.block_manager
    bm.check_invariants()
    for seq in sched.running:
        for i, block_id in enumerate(seq.block_table):
            block = bm.blocks[block_id]
            if block.block_hash is not None:
                assert (i + 1) * BS <= seq.num_computed_tokens
                assert block.token_ids == tuple(seq.token_ids[i * BS:(i + 1) * BS])


def run(sched: Scheduler, seqs: list[Sequence], *, draft_fn=None, abort_at: dict | None = None,
        max_steps: int = 2000) -> list[tuple[list[int], FinishReason | None]]:
    """Run ``seqs`` to the end; returns (output tokens, finish reason) per sequence."""
    for seq in seqs:
        sched.add(seq)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < max_steps
        preview = sched.preview_admission()
        out = sched.schedule()
        prefills = [(s, n) for s, n in out.scheduled if s.is_prefill]
        if not out.preempted:
            assert preview.num_prefills == len(prefills)
            assert preview.num_prefill_tokens == sum(n for _, n in prefills)
        check_step(sched, out, draft_fn=draft_fn)
        for seq in list(sched.running):  # abort with drafts outstanding (slots reserved)
            if abort_at and abort_at.get(seq.request_id, max_steps) <= steps \
                    and seq.seq_id in out.spec_budget:
                sched.finish(seq, FinishReason.ABORT)
        sampled = {}
        for seq in out.sampled_seqs():
            if seq.is_finished:
                continue
            sampled[seq.seq_id] = verify(seq) if seq.seq_id in out.spec_budget else target(seq.token_ids)
        sched.update_from_output(out, ModelRunnerOutput.from_tokens(sampled))
        check_hashed_blocks(sched)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    for event in bm.take_events():  # no event names a block holding a draft that was rejected
        for block_hash in getattr(event, "block_hashes", []):
            assert _to_unsigned(block_hash) in _all_block_hashes(seqs), event
    return [(seq.output_token_ids, seq.finish_reason) for seq in seqs]


def _to_unsigned(h: int) -> int:
    return h % 2**64


def _all_block_hashes(seqs: list[Sequence]) -> set[int]:
    hashes: set[int] = set()
    for seq in seqs:
        parent = None
        for i in range(len(seq.token_ids) // BS):
            parent = hash_block(parent, seq.token_ids[i * BS:(i + 1) * BS])
            hashes.add(parent)
    return hashes


REQUESTS = [
    {"max_tokens": 40, "ignore_eos": True},
    {"max_tokens": 30},  # EOS mid-run
    {"max_tokens": 30, "min_tokens": 20},  # EOS masked until 20 tokens: later EOS
    {"max_tokens": 17, "ignore_eos": True, "prompt_len": 14},  # max_tokens mid-run
    {"max_tokens": 25, "stop_token_ids": [31], "ignore_eos": True},
    {"max_tokens": 60, "ignore_eos": True, "prompt_len": 30},  # max_model_len cut
]


def reference() -> list[tuple[list[int], FinishReason | None]]:
    return run(make_scheduler(spec=None), make_seqs(REQUESTS))


def test_ngram_speculation_emits_exactly_the_non_speculative_tokens():
    ref = reference()
    sched = make_scheduler(spec="ngram")
    assert run(sched, make_seqs(REQUESTS)) == ref
    reasons = {reason for _, reason in ref}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}  # the cuts were exercised


def test_target_as_draft_accepts_everything_and_reserves_k_plus_one_slots():
    ref = reference()
    verifies = []

    def perfect_draft(seq: Sequence, num: int) -> list[int]:
        context = list(seq.token_ids)
        for _ in range(num):
            context.append(target(context))
        verifies.append(num)
        return context[len(seq.token_ids):]

    sched = make_scheduler(spec="draft")
    assert run(sched, make_seqs(REQUESTS), draft_fn=perfect_draft) == ref
    assert verifies.count(K) > len(verifies) // 2


def test_speculation_under_kv_pressure_preempts_and_leaks_nothing():
    ref = reference()
    sched = make_scheduler(spec="ngram", num_blocks=24)
    assert run(sched, make_seqs(REQUESTS)) == ref
    assert sched.num_preemptions > 0


def test_abort_with_drafts_outstanding_frees_every_block():
    sched = make_scheduler(spec="ngram")
    seqs = make_seqs(REQUESTS[:2])
    results = run(sched, seqs, abort_at={"r0": 12})
    assert results[0][1] is FinishReason.ABORT
    assert results[1] == reference()[1]


@pytest.mark.parametrize("tokens,expected", [
    ([5, 6, 7, 8, 5, 6], [7, 8, 5]),  # the 2-gram [5, 6] matched: what followed it
    ([1, 2, 3, 1, 9, 3], [1, 9, 3]),  # only the 1-gram [3]: its latest earlier occurrence
    ([1, 2, 3, 4], []),  # no earlier occurrence
    ([4, 4, 4, 4], [4]),  # the match just before the suffix: one token follows it
])
def test_ngram_proposer(tokens, expected):
    assert NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2).propose_one(tokens, 3) == expected


def test_ngram_proposer_rejects_bad_lengths():
    with pytest.raises(ValueError):
        NgramProposer(prompt_lookup_min=3, prompt_lookup_max=2)


@pytest.mark.parametrize("options,match", [
    ({"speculative_method": "medusa"}, "not supported"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"speculative_method": "draft"}, "draft_model .* or draft_num_layers"),
    ({"speculative_method": "draft", "draft_model": "x.gguf", "draft_num_layers": 0}, "must be >= 1"),
    # a method's options without it did nothing, silently
    ({"draft_num_layers": 3}, "draft_num_layers is for speculative decoding: use "
                              "--speculative-method draft"),
    ({"draft_model": "x.gguf"}, "--speculative-method draft"),
    ({"num_speculative_tokens": 4}, "--speculative-method ngram|draft"),
    ({"speculative_method": "ngram", "draft_num_layers": 3}, "--speculative-method draft"),
    ({"speculative_method": "draft", "draft_num_layers": 3, "prompt_lookup_max": 4},
     "prompt_lookup_max is for .* --speculative-method ngram"),
])
def test_speculative_options_are_checked(options, match):
    from atom.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)
