"""The SiLU-gated MLP of the Llama, Qwen3 and Mixtral families (dense layers and experts), and
gpt-oss's clamped SwiGLU expert."""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels import fused
from atom.layers.linear import Linear


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the gate and up projections fused in one GEMM.

    Parameters: ``gate_up_proj.weight`` ``[2 * intermediate, hidden]`` (gate rows, then up),
    ``down_proj.weight`` ``[hidden, intermediate]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` → ``[T, hidden]``, run dtype."""
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


def clamped_swiglu(gate_up: torch.Tensor, *, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of ``gate_up`` ``[T, 2I]`` (gate columns, then up) → ``[T, I]``:
    ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``
    (Hugging Face's ``GptOssExperts._apply_gate``, there with gate and up interleaved)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLUMLP(nn.Module):
    """gpt-oss's expert: ``down(clamped_swiglu(gate_up(x)))`` with biases on both projections
    (:func:`clamped_swiglu`).

    Parameters: ``gate_up_proj.weight`` ``[2 * intermediate, hidden]`` and ``.bias``
    ``[2 * intermediate]`` (gate rows first, then up: checkpoints interleave them, the loader
    de-interleaves), ``down_proj.weight`` ``[hidden, intermediate]`` and ``.bias`` ``[hidden]``.

    Args:
        limit: the clamp (gpt-oss: ``swiglu_limit`` 7.0).
        alpha: the sigmoid's gain (gpt-oss: ``swiglu_alpha`` 1.702).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, limit: float,
                 alpha: float) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` → ``[T, hidden]``, run dtype."""
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), limit=self.limit,
                                             alpha=self.alpha))
