"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), as every family here uses it."""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels import fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face's ``LlamaRMSNorm``
    (:func:`atom.kernels.fused.rms_norm`). With ``residual``, normalizes ``residual + x`` and
    leaves that sum in ``residual`` (in place).

    Args:
        dim: the normalized (last) dimension: the hidden size, or the head dim of Qwen3's
            per-head q/k norm.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[T, dim]`` (and residual ``[T, dim]``), run dtype → ``[T, dim]``."""
        return fused.rms_norm(x, self.weight, self.eps, residual)
