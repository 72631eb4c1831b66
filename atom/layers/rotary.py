"""Rotary position embedding tables (RoFormer, Su et al. 2021, arXiv:2104.09864) in Hugging
Face's ``rotate_half`` convention; :func:`atom.kernels.fused.rotary_embedding_` applies them.

Two frequency rules: the default (``inv_freq = theta ** (-2i / d)``) and YaRN (Peng et al.
2023, arXiv:2309.00071; gpt-oss, DeepSeek-V3), which interpolates the low frequencies by
``factor``, keeps the high ones, ramps linearly between the two, and scales cos/sin by an
attention factor (:class:`YarnScaling`, :func:`yarn_inv_freq`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def default_inv_freq(*, head_dim: int, rope_theta: float) -> torch.Tensor:
    """``theta ** (-2i / d)`` for ``i < d / 2``, float32 ``[head_dim / 2]`` (computed in float32
    as Hugging Face does)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (rope_theta ** exponents)


def rotary_cos_sin(
    *, head_dim: int, rope_theta: float, max_positions: int,
    inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` float32, the two halves of each row equal.

    Args:
        inv_freq: float32 ``[head_dim / 2]``; None = :func:`default_inv_freq` (no scaling).
        attention_factor: multiplies cos and sin (YaRN's; 1 without scaling).

    Frequencies are computed in float32 as HF does; the tables are cast to the run dtype at use,
    like HF's rotary embedding output.
    """
    if inv_freq is None:
        inv_freq = default_inv_freq(head_dim=head_dim, rope_theta=rope_theta)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's settings (``config.json``'s ``rope_scaling`` / ``rope_parameters`` with
    ``rope_type: yarn``; the keys and defaults of Hugging Face's ``_compute_yarn_parameters``).

    Attributes:
        factor: context extension factor (s).
        original_max_position_embeddings: the pre-training context, in tokens.
        beta_fast, beta_slow: rotations bounding the ramp (extrapolate above ``beta_fast``
            rotations over the original context, interpolate below ``beta_slow``).
        truncate: round the ramp's bounds outward to whole dimensions (gpt-oss: false).
        attention_factor: cos/sin scale; None = from ``factor`` (and ``mscale`` /
            ``mscale_all_dim`` when both are set: DeepSeek's form).
        mscale, mscale_all_dim: DeepSeek's attention-factor knobs; None = unset.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @classmethod
    def from_rope_parameters(cls, rope: dict, *, max_position_embeddings: int) -> YarnScaling:
        """From a ``rope_type: yarn`` dict; a missing ``factor`` is
        ``max_position_embeddings / original_max_position_embeddings``, as in HF.

        Raises:
            ValueError: ``original_max_position_embeddings`` is missing.
        """
        original = rope.get("original_max_position_embeddings")
        if original is None:
            raise ValueError(f"yarn rope scaling {rope!r} has no original_max_position_embeddings")
        factor = rope.get("factor") or max_position_embeddings / original
        return cls(factor=float(factor), original_max_position_embeddings=int(original),
                   beta_fast=float(rope.get("beta_fast") or 32.0),
                   beta_slow=float(rope.get("beta_slow") or 1.0),
                   truncate=bool(rope.get("truncate", True)),
                   attention_factor=rope.get("attention_factor"), mscale=rope.get("mscale"),
                   mscale_all_dim=rope.get("mscale_all_dim"))

    def resolved_attention_factor(self) -> float:
        """The cos/sin scale: ``attention_factor``, else ``0.1 ln(s) + 1`` (YaRN's
        ``sqrt(1/t)``; DeepSeek's ratio of two such terms when ``mscale`` and ``mscale_all_dim``
        are both set); 1 when ``factor <= 1``."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor,
                                                                     self.mscale_all_dim)
        return get_mscale(self.factor)


def yarn_inv_freq(*, head_dim: int, rope_theta: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN's frequencies, float32 ``[head_dim / 2]``: dimension ``i`` blends the extrapolated
    ``theta ** (-2i/d)`` and the interpolated ``theta ** (-2i/d) / s`` by a linear ramp between
    the dimensions that rotate ``beta_fast`` and ``beta_slow`` times over the original context
    (arXiv:2309.00071, section 3.2; the steps of HF's ``_compute_yarn_parameters``)."""
    base, dim = rope_theta, head_dim

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings
                               / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep
