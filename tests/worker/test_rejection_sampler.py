"""The speculative verifier: its rejection rule keeps the target's distribution exactly.

A synthetic target over a 6-token vocabulary (the next-token distribution depends on the
previous token) generates two tokens per trial through verify steps with drafts, from a
deterministic proposer (a point mass) and from a sampled one (``q`` given). The joint
distribution of the two tokens is compared with the target's exact joint by a chi-square
goodness-of-fit test (35 degrees of freedom, 8000 trials): the rule must pass at significance
0.001 and a deliberately wrong rule (resample from ``p`` instead of ``norm(max(0, p - q))``,
which over-weights the draft) must fail the same test at 1e-6. Then the verifier on real
sampler machinery: greedy verification with logits processors equals the sampler's token at
every draft position, and a seeded request is reproducible.
"""

from __future__ import annotations

import pytest
import torch

from atom.worker.rejection_sampler import RejectionSampler, rejection_sample
from atom.worker.sampler import Sampler, sample_from
from atom.sampling_params import SamplingParams
from atom.core.sequence import Sequence
from tests.spec_utils import chi_square_sf, wrong_rule

V = 6
NUM_TRIALS = 8000
SIGNIFICANCE = 1e-3  # the correct rule's chi-square p-value must exceed this
CONTROL_P_VALUE = 1e-6  # the wrong rule's must fall below this


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-token probs [V], next-token probs given the previous token [V, V])."""
    g = torch.Generator().manual_seed(seed)
    first = torch.softmax(torch.randn(V, generator=g), dim=0)
    table = torch.softmax(torch.randn(V, V, generator=g), dim=1)
    return first, table


def generate_pairs(rule, *, sampled_proposer: bool) -> torch.Tensor:
    """Counts [V, V] of the first two tokens over NUM_TRIALS runs of verify steps."""
    first, table = _dists(0)
    q_first, q_table = _dists(1)  # the sampled proposer's (a different model)
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(V, V)

    def target_row(prefix: list[int]) -> torch.Tensor:
        return first if not prefix else table[prefix[-1]]

    for _ in range(NUM_TRIALS):
        prefix: list[int] = []
        while len(prefix) < 2:
            drafts, q_rows = [], []
            for _ in range(2):
                q = q_first if not prefix + drafts else q_table[(prefix + drafts)[-1]]
                if sampled_proposer:
                    drafts.append(sample_from(q, g))
                    q_rows.append(q)
                else:  # deterministic: a point mass at the proposer model's argmax
                    drafts.append(int(q.argmax()))
            rows = lambda j, d=drafts, pre=prefix: target_row(pre + d[:j])  # noqa: E731
            prefix += rule(rows, drafts, g, draft_probs=torch.stack(q_rows) if q_rows else None)
        counts[prefix[0], prefix[1]] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to the target's exact joint distribution."""
    first, table = _dists(0)
    expected = (first[:, None] * table) * counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return chi_square_sf(statistic, counts.numel() - 1)


@pytest.mark.parametrize("sampled_proposer", [False, True], ids=["point-mass", "sampled-q"])
def test_rejection_rule_keeps_the_target_distribution(sampled_proposer):
    counts = generate_pairs(rejection_sample, sampled_proposer=sampled_proposer)
    p_value = chi_square_p_value(counts)
    print(f"rejection rule ({'sampled q' if sampled_proposer else 'point mass'}): "
          f"chi-square p-value {p_value:.4f}")
    assert p_value > SIGNIFICANCE


@pytest.mark.parametrize("sampled_proposer", [False, True], ids=["point-mass", "sampled-q"])
def test_a_wrong_rule_fails_the_same_test(sampled_proposer):
    p_value = chi_square_p_value(generate_pairs(wrong_rule, sampled_proposer=sampled_proposer))
    print(f"wrong rule: chi-square p-value {p_value:.3g}")
    assert p_value < CONTROL_P_VALUE


def _seq(tokens: list[int], outputs: list[int], **params) -> Sequence:
    seq = Sequence("r", list(tokens), SamplingParams(**params))
    seq.token_ids += outputs
    return seq


def test_greedy_verification_applies_processors_at_each_draft_position():
    """Row j of a verify sees the drafts before it as output tokens: the token it keeps at
    each position is the sampler's for a sequence that already has those tokens."""
    torch.manual_seed(0)
    vocab, eos = 50, 2
    params = dict(temperature=0.0, repetition_penalty=1.8, min_tokens=3,
                  logit_bias={7: 0.5}, max_tokens=20)
    logits = torch.randn(4, vocab) * 3
    logits[:, eos] += 2.0  # EOS is the raw argmax: min_tokens must mask it at rows 0-1
    sampler = Sampler((eos,))
    seq = _seq([5, 6, 7], [8], **params)
    expected = []
    for j in range(4):  # what the sampler picks at each position, fed its own picks
        row_seq = _seq([5, 6, 7], [8] + expected, **params)
        expected.append(sampler(logits[j:j + 1], [row_seq]).token_ids[0])
    drafts = expected[:3]
    out = RejectionSampler(sampler)(logits, [seq], [drafts])
    assert out.token_ids == [expected]  # every draft accepted, then the bonus token
    wrong = [drafts[0], (drafts[1] + 1) % vocab, drafts[2]]
    assert RejectionSampler(sampler)(logits, [seq], [wrong]).token_ids == [expected[:2]]


def test_seeded_verification_is_reproducible():
    logits = torch.randn(3, 40)
    runs = []
    for _ in range(2):
        seq = _seq([1, 2, 3], [4], temperature=1.0, seed=7, max_tokens=9)
        runs.append(RejectionSampler(Sampler((2,), seed=123))(logits, [seq], [[5, 6]]).token_ids)
    assert runs[0] == runs[1]


def test_logits_rows_must_match_the_drafts():
    seq = _seq([1, 2], [3], temperature=0.0, max_tokens=5)
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler(Sampler())(torch.randn(2, 10), [seq], [[1, 2]])
