"""Linear layers on CPU through oneDNN with weights pre-packed once at load.

``F.linear`` on CPU calls MKL's sgemm with the weight in its stored ``[out, in]`` layout, every
step. oneDNN (bundled with torch as MKL-DNN) can instead reorder the weight once into its own
blocked layout and run every later GEMM on that copy. Measured on the development machine
(2 AVX2 cores, float32; ``docs/PERFORMANCE.md``), for SmolLM2-135M's shapes at 64 rows (a batch-64
decode step) the packed GEMMs are 1.1-1.4x faster, and the ``[49152, 576]`` LM head 1.8x faster
at 1 and 64 rows; at 2,048 rows (prefill) both are within noise of each other. This is the
same pair of ops torch's own inductor uses for frozen CPU linears
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``).

Packing is skipped (callers keep ``F.linear``) when oneDNN is not built into torch, the weight
is not on the CPU, or oneDNN refuses the dtype on this CPU (bfloat16 without AVX512-BF16 or
AVX-NE-CONVERT).

Imports torch only.
"""

from __future__ import annotations

import torch

#: The row count oneDNN picks its weight layout for; any row count works at run time (a
#: batch-64 decode step is the case that gains most; 1 and 2,048 rows measured no worse).
PACK_BATCH_HINT = 64


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a linear weight, or None when it cannot be packed here.

    Args:
        weight: ``[out_features, in_features]``, float32 or bfloat16, CPU.
    Returns:
        An opaque oneDNN tensor (layout ``torch._mkldnn``) for :func:`packed_linear`, or None.
    """
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                       PACK_BATCH_HINT)
    except RuntimeError:  # e.g. bfloat16 on a CPU without native bf16 support
        return None


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with ``W`` packed by :func:`pack_weight`.

    Args:
        x: ``[..., in_features]`` in the weight's dtype (any row count, zero included).
        bias: ``[out_features]`` in the same dtype, or None.
    Returns:
        ``[..., out_features]``, contiguous; equal to ``F.linear(x, W)`` up to float rounding
        (a different summation order).
    """
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
