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

For small weights at few rows, and for any weight at one row, :func:`small_linear` (a compiled
kernel, no per-call setup) beats oneDNN (:func:`small_linear_max_rows`);
:class:`atom.layers.linear.Linear` keeps its weight in both forms where the kernel runs and picks
by row count.

Imports torch and the compiled ops (:mod:`atom.kernels.cpu_ops`) only.
"""

from __future__ import annotations

import torch

from atom.kernels import cpu_ops
from atom.kernels.moe import fused_moe_applies

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


#: Weights of at most this many bytes run :func:`small_linear` up to
#: :data:`SMALL_LINEAR_MAX_ROWS` rows: a MoE router (``[32, 1024]`` bf16: 64 KB), a tiny model's
#: linears; oneDNN's fixed cost per call (15-40 µs) is more than their whole product.
SMALL_WEIGHT_BYTES = 256 * 1024
#: The most rows :func:`small_linear` takes for a small weight (3-6x faster than the packed GEMM
#: at 1-8 rows, still ahead at 64, slower at 512: ``scripts/bench_fused_moe.py``).
SMALL_LINEAR_MAX_ROWS = 16


def small_linear_max_rows(weight: torch.Tensor) -> int:
    """Up to how many rows :func:`small_linear` runs for ``weight`` (``[out, in]``) instead of
    oneDNN's packed GEMM: :data:`SMALL_LINEAR_MAX_ROWS` for a weight of at most
    :data:`SMALL_WEIGHT_BYTES`, 1 above (a one-row product streams the weight once; oneDNN's
    one-row path was slower on every shape measured, docs/PERFORMANCE.md), 0 where the kernel
    has no vector path (not float32 / bfloat16 on the CPU, no AVX-512, kernels not built)."""
    if not fused_moe_applies(weight.dtype, weight.device):  # the same vector path's test
        return 0
    return SMALL_LINEAR_MAX_ROWS if weight.numel() * weight.element_size() <= SMALL_WEIGHT_BYTES else 1


def small_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by the compiled kernel for few rows
    (``kernels/csrc/small_linear.cpp``): a oneDNN call costs about 15-40 µs whatever its size,
    more than a ``[32, 1024]`` router's whole product at a decode step's few rows (3-6 µs), and
    at one row the kernel streams any weight once, faster than oneDNN's one-row path.

    Args:
        x: ``[M, in_features]`` float32 or bfloat16, rows contiguous.
        weight: ``[out_features, in_features]`` in x's dtype, contiguous.
        bias: ``[out_features]`` in x's dtype, or None.
    Returns:
        ``[M, out_features]`` in x's dtype (float32 sums, one rounding).
    Raises:
        RuntimeError: the kernels are not built, or the shapes or dtypes are not the above.
    """
    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError(f"small_linear needs atom's C++ kernels: {cpu_ops.unavailable_reason()}")
    return ops.small_linear(x, weight, bias)
