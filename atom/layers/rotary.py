"""Rotary position embedding tables (RoFormer, Su et al. 2021, arXiv:2104.09864) in Hugging
Face's ``rotate_half`` convention; :func:`atom.kernels.fused.rotary_embedding_` applies them."""

from __future__ import annotations

import torch


def rotary_cos_sin(
    *, head_dim: int, rope_theta: float, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` float32 (HF default rope, no scaling).

    Frequencies are computed in float32 as HF does (``inv_freq = theta ** (-2i / d)``); the
    tables are cast to the run dtype at use, like HF's rotary embedding output.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
