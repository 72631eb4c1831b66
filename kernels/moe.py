"""The routed experts of a MoE layer in one compiled call (``kernels/csrc/fused_moe.cpp``).

A decode step gives each expert a few tokens, so one GEMM per expert (oneDNN, packed) costs its
fixed overhead per call, about 40 µs for one 512 KB expert on the 2-core Zen 4 of
docs/PERFORMANCE.md, more than reading the expert's weights. :func:`fused_moe` runs every
active expert of a layer in two parallel passes that stream each expert's weights once
(SiLU-gated MLPs, gates applied, summed per token); it is what vLLM's and SGLang's CPU backends
call their fused-experts kernel. :class:`atom.layers.moe.MoE` uses it where
:func:`fused_moe_applies` (AVX-512 builds), and otherwise its per-expert modules.

Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import cpu_ops


def fused_moe_applies(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether :func:`fused_moe` runs its vector path for weights of ``dtype`` on ``device``:
    float32 or bfloat16 on the CPU, with the kernels built on a CPU with AVX-512 F/BW/VL (on
    other CPUs it is a scalar loop, slower than per-expert oneDNN GEMMs)."""
    if dtype not in (torch.float32, torch.bfloat16) or torch.device(device).type != "cpu":
        return False
    ops = cpu_ops.load()
    return ops is not None and bool(ops.fused_moe_is_simd())


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
              gates: torch.Tensor) -> torch.Tensor:
    """``y[t] = Σ_j gates[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t]))``, ``e = ids[t, j]``,
    over the slots whose ``e`` is in ``[0, E)`` (the others belong to another rank's experts).

    Args:
        x: ``[T, H]`` float32 or bfloat16, rows contiguous.
        w13: ``[E, 2I, H]`` in x's dtype, contiguous: each expert's gate rows, then its up rows
            (transformers v5's fused ``gate_up_proj``).
        w2: ``[E, H, I]`` in x's dtype, contiguous (``down_proj``).
        ids: int64 ``[T, k]``, the local expert of each slot.
        gates: float32 ``[T, k]``.
    Returns:
        ``[T, H]`` in x's dtype; sums in float32, the activations rounded to x's dtype before the
        down projection (as the unfused path rounds them), one rounding at the end; zero rows for
        tokens with no local slot.
    Raises:
        RuntimeError: the kernels are not built (:func:`fused_moe_applies`), or the shapes or
            dtypes are not the above.
    """
    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError(f"fused_moe needs atom's C++ kernels: {cpu_ops.unavailable_reason()}")
    return ops.fused_moe(x, w13, w2, ids.contiguous(), gates.float().contiguous())


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                        gates: torch.Tensor) -> torch.Tensor:
    """What :func:`fused_moe` computes, in float64 torch (the tests' reference): ``[T, H]``
    float64."""
    num_experts, intermediate = w13.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j in (ids >= 0).logical_and(ids < num_experts).nonzero().tolist():
        e = int(ids[t, j])
        gate_up = w13[e].double() @ x[t].double()
        act = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
        out[t] += float(gates[t, j]) * (w2[e].double() @ act)
    return out
