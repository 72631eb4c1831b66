"""The SiLU-gated MLP of the Llama, Qwen3 and Mixtral families (dense layers)."""

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
