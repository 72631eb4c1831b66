"""The worker's side of structured outputs: the grammar's bitmask applied to the logits before
sampling, greedy and random, in the sampler and in the speculative verifier."""

from __future__ import annotations

import numpy as np
import torch

from atom.core.sequence import Sequence
from atom.sampling_params import SamplingParams, StructuredOutputsParams
from atom.worker.rejection_sampler import RejectionSampler
from atom.worker.sampler import Sampler, apply_token_bitmask

VOCAB = 70  # not a multiple of 32: the last word is partly past the vocabulary


def bitmask(allowed: list[int]) -> np.ndarray:
    words = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.array(1 << (t % 32), dtype=np.uint32).view(np.int32)
    return words


def seq(temperature: float, request_id: str = "r", seed: int | None = None) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(
        temperature=temperature, seed=seed, structured_outputs={"regex": "x"}))


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens():
    logits = torch.randn(VOCAB)
    kept = [0, 5, 31, 32, 63, 64, 69]  # word edges, the sign bit, the partial last word
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask(kept))
    assert torch.isfinite(masked).nonzero().flatten().tolist() == kept
    assert torch.equal(masked[kept], logits[kept])


def test_greedy_and_random_sampling_pick_only_allowed_tokens():
    logits = torch.randn(3, VOCAB)
    logits[:, 10] = 50.0  # the unmasked favourite, disallowed below
    greedy, hot, free = seq(0.0), seq(1.0, "hot"), Sequence("free", [1], SamplingParams(temperature=0))
    masks = {greedy.seq_id: bitmask([3, 4]), hot.seq_id: bitmask([40, 41, 42])}
    sampler = Sampler(seed=0)
    out = sampler(logits, [greedy, hot, free], token_bitmask=masks)
    assert out.token_ids[0] == 3 + int(logits[0, 4] > logits[0, 3])
    assert out.token_ids[1] in (40, 41, 42)
    assert out.token_ids[2] == 10  # no mask: untouched
    draws = {sampler(logits[1:2], [hot], token_bitmask={hot.seq_id: masks[hot.seq_id]}).token_ids[0]
             for _ in range(30)}
    assert draws <= {40, 41, 42} and len(draws) > 1
    # logprobs stay those of the raw distribution (vLLM's default)
    raw = torch.log_softmax(logits[0], -1)[out.token_ids[0]]
    assert abs(out.sampled_logprobs[0] - float(raw)) < 1e-5


def test_the_verifier_masks_a_constrained_sequence_without_drafts():
    logits = torch.randn(4, VOCAB)
    logits[:, 10] = 50.0
    drafting = Sequence("d", [1, 2], SamplingParams(temperature=0))
    constrained = seq(0.0)
    out = RejectionSampler(Sampler(seed=0))(
        logits, [drafting, constrained], [[10, 10], []],
        token_bitmask={constrained.seq_id: bitmask([7])})
    assert out.token_ids == [[10, 10, 10], [7]]
