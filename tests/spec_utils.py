"""Shared helpers of the speculative decoding tests: chi-square p-values and the wrong
acceptance rule the negative controls use."""

from __future__ import annotations

import torch

from atom.worker.sampler import sample_from


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def homogeneity_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors ``[V]`` come from one distribution (cells empty
    on both sides dropped)."""
    table = torch.stack([a, b]).double()
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    return chi_square_sf(statistic, table.shape[1] - 1)


def wrong_rule(target_probs, draft_token_ids, generator, *, draft_probs=None):
    """The negative control: accepts like the real rule but, on a rejection, resamples from
    ``p`` instead of ``norm(max(0, p - q))`` (the draft is then over-weighted)."""
    row = target_probs.__getitem__ if isinstance(target_probs, torch.Tensor) else target_probs
    out = []
    for j, draft in enumerate(draft_token_ids):
        p = row(j)
        q = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if float(torch.rand((), generator=generator)) * q < float(p[draft]):
            out.append(draft)
            continue
        out.append(sample_from(p, generator))
        return out
    out.append(sample_from(row(len(draft_token_ids)), generator))
    return out
