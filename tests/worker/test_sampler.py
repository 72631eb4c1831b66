"""Sampler unit tests on small logits tensors, and min_tokens with a scripted model.

The scripted model is a fake logits source driven through the real Scheduler, BlockManager and
Sampler (no weights): it always prefers to stop, so every extra token is min_tokens' doing.
"""

from __future__ import annotations

import math

import pytest
import torch

from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.block_manager import BlockManager
from atom.worker.sampler import (Sampler, apply_penalties, filter_probs, rank_stream_seed,
                                 top_logprobs)
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import Sequence

EOS = 2
STOP_ID = 7
FILLER = 11
VOCAB = 32


# ----- penalties and filters: exact values -----

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    apply_penalties(logits, [0], [1, 1, 2], presence_penalty=0.0, frequency_penalty=0.0,
                    repetition_penalty=2.0)
    # seen (prompt or output): 0, 1, 2; token 3 (unseen) and 4 keep their logits
    assert logits.tolist() == [1.0, -2.0, 0.25, 3.0, 0.0]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    apply_penalties(logits, [0, 3], [1, 1, 2], presence_penalty=0.25, frequency_penalty=0.5,
                    repetition_penalty=1.0)
    # token 1: two occurrences -> -1 - 2*0.5 - 0.25; token 2: one -> 0.5 - 0.5 - 0.25;
    # prompt tokens 0 and 3 are untouched
    assert logits.tolist() == [2.0, -2.25, -0.25, 3.0, 0.0]


def test_all_penalties_compose_in_vllm_order():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    apply_penalties(logits, [0], [1, 1, 2], presence_penalty=0.25, frequency_penalty=0.5,
                    repetition_penalty=2.0)
    # repetition first: [1, -2, 0.25, 3, 0]; then frequency and presence on output tokens
    assert logits.tolist() == [1.0, -3.25, -0.5, 3.0, 0.0]


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_filter_probs_off_is_softmax():
    out = filter_probs(_logits_of(PROBS), top_k=0, top_p=1.0, min_p=0.0)
    torch.testing.assert_close(out, torch.tensor(PROBS))


def test_min_p_drops_tokens_below_fraction_of_top_probability():
    # threshold 0.2 * 0.5 = 0.1: 0.05 goes, the rest is renormalized by 0.95
    out = filter_probs(_logits_of(PROBS), top_k=0, top_p=1.0, min_p=0.2)
    torch.testing.assert_close(out, torch.tensor([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]))


def test_min_p_keeps_tokens_exactly_at_the_threshold():
    out = filter_probs(_logits_of([0.5, 0.25, 0.25]), top_k=0, top_p=1.0, min_p=0.5)
    torch.testing.assert_close(out, torch.tensor([0.5, 0.25, 0.25]))


def test_top_k_and_top_p():
    top_k = filter_probs(_logits_of(PROBS), top_k=2, top_p=1.0, min_p=0.0)
    torch.testing.assert_close(top_k, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    # top_p=0.7: 0.5 (mass before 0), 0.3 (mass before 0.5 < 0.7) stay; 0.15 (0.8) goes
    top_p = filter_probs(_logits_of(PROBS), top_k=0, top_p=0.7, min_p=0.0)
    torch.testing.assert_close(top_p, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    only_top = filter_probs(_logits_of(PROBS), top_k=0, top_p=0.4, min_p=0.0)
    torch.testing.assert_close(only_top, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_temperature_scales_logits_before_filters():
    logits = _logits_of(PROBS)
    # temperature 0.5 squares the probabilities (0.25, 0.09, 0.0225, 0.0025, unnormalized);
    # min_p=0.3 then keeps those >= 0.3 * 0.25 = 0.075: tokens 0 and 1. At temperature 1 the
    # same min_p keeps token 2 (0.15 >= 0.15) as well.
    expected = filter_probs(logits / 0.5, top_k=0, top_p=1.0, min_p=0.3)
    torch.testing.assert_close(expected, torch.tensor([0.25, 0.09, 0.0, 0.0]) / (0.25 + 0.09))
    seq = _seq(SamplingParams(temperature=0.5, min_p=0.3, seed=0))
    sampler = Sampler()
    draws = {sampler(logits.unsqueeze(0), [seq]).token_ids[0] for _ in range(50)}
    assert draws == {0, 1}


def test_logit_bias_and_near_zero_temperature_is_greedy():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    seq = _seq(SamplingParams(temperature=1e-7, logit_bias={0: 5.0}))
    assert Sampler()(logits, [seq]).token_ids == [0]


# ----- logprobs -----

def test_top_logprobs_adds_the_sampled_token_when_outside_the_top_k():
    logprobs = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), dim=-1)
    inside = top_logprobs(logprobs, 1, 2)
    assert list(inside) == [0, 1]
    outside = top_logprobs(logprobs, 3, 2)
    assert list(outside) == [0, 1, 3]  # k entries in descending order, then the sampled one
    assert outside[3] == pytest.approx(float(logprobs[3]))
    assert list(top_logprobs(logprobs, 2, 0)) == [2]


def test_sampler_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    # a penalty changes the sampled token, not the reported (raw) logprobs
    seq = _seq(SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 10.0}))
    out = Sampler()(logits, [seq])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [0]
    assert list(out.logprobs[0]) == [3, 2, 0]
    assert out.logprobs[0][0] == pytest.approx(float(raw[0]))
    assert out.sampled_logprobs[0] == pytest.approx(float(raw[0]))


# ----- seeded sampling -----

def _seq(params: SamplingParams, *, index: int = 0, prompt=(5, 6, 7)) -> Sequence:
    return Sequence("r", list(prompt), params, index=index)


def _draw(sampler: Sampler, rows: torch.Tensor, seqs: list[Sequence], steps: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        out = sampler(rows, seqs)
        for i, t in enumerate(out.token_ids):
            tokens[i].append(t)
    return tokens


def test_seeded_sequence_ignores_its_batch_mates():
    torch.manual_seed(0)
    row = torch.randn(1, VOCAB)
    others = torch.randn(5, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1234)
    (alone,) = _draw(Sampler(seed=1), row, [_seq(params)], steps=20)
    seqs = [_seq(SamplingParams(temperature=1.0)) for _ in range(5)]
    mixed = _draw(Sampler(seed=2), torch.cat([others[:2], row, others[2:]]),
                  seqs[:2] + [_seq(params)] + seqs[2:], steps=20)
    assert mixed[2] == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_choices_derive_their_own_streams_from_the_seed():
    row = torch.zeros(3, VOCAB)  # uniform: the draws are the noise alone
    params = SamplingParams(temperature=1.0, seed=7, n=3)
    a = _draw(Sampler(), row, [_seq(params, index=i) for i in range(3)], steps=10)
    b = _draw(Sampler(), row, [_seq(params, index=i) for i in range(3)], steps=10)
    assert a == b
    assert len({tuple(t) for t in a}) == 3
    # choice i uses seed + i, so choice 1 of seed 7 is choice 0 of seed 8
    (c,) = _draw(Sampler(), row[:1], [_seq(SamplingParams(temperature=1.0, seed=8))], steps=10)
    assert c == a[1]


# ----- min_tokens with a scripted model -----

def _scripted_run(params: SamplingParams, preferred: list[int]) -> Sequence:
    """Run one request through Scheduler + Sampler with fake logits ranking ``preferred`` first."""
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      bm, eos_token_ids=(EOS,))
    sampler = Sampler((EOS,))
    seq = _seq(params)
    sched.add(seq)
    row = torch.zeros(VOCAB)
    row[FILLER] = 1.0
    for rank, token in enumerate(preferred):
        row[token] = 10.0 - rank
    for _ in range(20):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sampled = [s for s, n in out.scheduled if s.num_computed_tokens + n == len(s.token_ids)]
        result = sampler(row.expand(len(sampled), VOCAB), sampled)
        sched.update_from_output(out, ModelRunnerOutput.from_tokens({s.seq_id: t for s, t in zip(sampled, result.token_ids)}))
    assert seq.is_finished and bm.num_free_blocks == bm.num_blocks
    return seq


def test_scripted_model_stops_at_once_without_min_tokens():
    seq = _scripted_run(SamplingParams(temperature=0.0, max_tokens=10), [EOS])
    assert seq.output_token_ids == [EOS] and seq.finish_reason.value == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos(temperature):
    params = SamplingParams(temperature=temperature, max_tokens=10, min_tokens=4, seed=0)
    seq = _scripted_run(params, [EOS])
    # with EOS masked the runner-up is FILLER (1.0 vs 0.0) under greedy; sampled tokens vary
    assert EOS not in seq.output_token_ids[:4]
    assert len(seq.output_token_ids) >= 5 and seq.finish_reason.value == "stop"
    if temperature == 0.0:
        assert seq.output_token_ids == [FILLER] * 4 + [EOS] and seq.stop_reason is None


def test_min_tokens_masks_stop_token_ids():
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[STOP_ID])
    seq = _scripted_run(params, [STOP_ID, EOS])
    assert seq.output_token_ids == [FILLER] * 3 + [STOP_ID]
    assert seq.finish_reason.value == "stop" and seq.stop_reason == STOP_ID


def test_ignore_eos_keeps_generating_eos_until_max_tokens():
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2, ignore_eos=True)
    seq = _scripted_run(params, [EOS])
    # ignore_eos: EOS is neither masked nor a stop
    assert seq.output_token_ids == [EOS] * 5 and seq.finish_reason.value == "length"


# ----- streams (issue 38: ranks built from one config never share one) -----

def test_each_dp_rank_draws_from_its_own_stream_and_seeded_requests_from_theirs():
    assert rank_stream_seed(0, 0) != rank_stream_seed(0, 1) != rank_stream_seed(1, 0)
    assert rank_stream_seed(3, 1) == rank_stream_seed(3, 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        rank_stream_seed(-1, 0)
    logits = torch.zeros(1, 1000)  # uniform: every draw is the noise's argmax

    def draws(params: SamplingParams, dp_rank: int) -> list[int]:
        sampler, seq = Sampler(seed=0, dp_rank=dp_rank), _seq(params)
        return [sampler(logits, [seq]).token_ids[0] for _ in range(8)]

    unseeded = SamplingParams(temperature=1.0)
    assert draws(unseeded, 0) != draws(unseeded, 1)
    assert draws(unseeded, 1) == draws(unseeded, 1)
    seeded = SamplingParams(temperature=1.0, seed=7)
    assert draws(seeded, 0) == draws(seeded, 1)
