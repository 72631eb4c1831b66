"""Fused elementwise ops of the Llama decoder: RMSNorm (optionally with the residual add folded
in), SiLU-and-mul, and the rotary embedding applied in place to a fused qkv tensor; and the
sampler's row-wise logsumexp + argmax.

Each function runs the compiled CPU kernel (``kernels/csrc/fused_ops.cpp`` through
:mod:`atom.kernels.cpu_ops`) for float32 and bfloat16 CPU tensors when it is built (the sampler's
logsumexp + argmax for float32 logits), and otherwise the torch reference here, which computes
exactly what Hugging Face's Llama does (RMSNorm in float32 and cast back, ``act(gate) * up``,
``x * cos + rotate_half(x) * sin``). On bfloat16 the kernels compute in float32 and round once
per output element, where the reference rounds after every op: they are as close or closer to
the exact result (tests/kernels/test_fused.py checks both against float64). One kernel call
replaces a chain of 4-8 torch ops per layer; in a batch-64 decode step of SmolLM2-135M those
chains were about a tenth of the step in float32 (docs/PERFORMANCE.md), and about 15% of a
bfloat16 W1 before the kernels took bfloat16 (issue 37).

Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import cpu_ops


def _kernels(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)):
    """The compiled ops when they apply to ``x`` (one of ``dtypes``, on the CPU), else None."""
    if x.dtype not in dtypes or x.device.type != "cpu":
        return None
    return cpu_ops.load()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm``: normalize in float32, cast back, scale by ``weight``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` or, with ``residual``, of ``residual + x``.

    Args:
        x: ``[T, N]``, run dtype.
        weight: ``[N]``, same dtype.
        residual: ``[T, N]`` or None. When given it is updated in place to ``residual + x``
            (the residual stream after this sub-layer) and the norm is taken of that sum.
    Returns:
        ``[T, N]``, a new tensor.
    """
    ops = _kernels(x)
    if ops is not None and x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == x.dtype and (
            residual is None or (residual.stride(-1) == 1 and residual.dtype == x.dtype)):
        if residual is None:
            return ops.rms_norm(x, weight, eps)
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    if residual is not None:
        residual.add_(x)
        x = residual
    return rms_norm_reference(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]``: ``[T, 2 I]`` → ``[T, I]``, run dtype."""
    ops = _kernels(x)
    if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, H, D]``; cos/sin: ``[T, D]`` in x's dtype. HF ``rotate_half`` convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_embedding_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                      num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """Rotate the query and key heads of a fused projection in place; with ``q_norm`` and
    ``k_norm``, RMSNorm each query / key head first (Qwen3's QK-norm, :func:`rms_norm`'s math),
    in the same call.

    Args:
        qkv: ``[T, (H + 2 H_kv) * D]``: H query heads, then H_kv key heads, then H_kv value
            heads (left as they are); rows contiguous.
        cos, sin: ``[T, D]`` in qkv's dtype (the rows of each token's position).
        q_norm, k_norm: ``[D]`` in qkv's dtype, both or neither; ``eps`` their epsilon.
    """
    ops = _kernels(qkv)
    if (ops is not None and qkv.dim() == 2 and qkv.stride(-1) == 1 and cos.is_contiguous()
            and sin.is_contiguous() and cos.dtype == sin.dtype == qkv.dtype
            and all(w is None or w.dtype == qkv.dtype for w in (q_norm, k_norm))):
        ops.rotary_embedding_(qkv, cos, sin, num_heads, num_kv_heads, q_norm, k_norm, eps)
        return
    head_dim = cos.shape[-1]
    rows = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, num_heads + num_kv_heads,
                                                               head_dim)
    if q_norm is not None:
        for weight, heads in ((q_norm, qk[:, :num_heads]), (k_norm, qk[:, num_heads:])):
            heads.copy_(rms_norm(heads.reshape(-1, head_dim), weight, eps).view(heads.shape))
    qk.copy_(apply_rotary_reference(qk, cos, sin))


def logsumexp_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise ``torch.logsumexp`` and ``argmax`` of ``[S, V]`` logits in two passes per row.

    Returns:
        ``(logsumexp [S] in logits' dtype, argmax int64 [S])``; ties give the first index, as
        ``torch.argmax`` does (rows are expected NaN-free).
    """
    ops = _kernels(logits, (torch.float32,))
    if ops is not None and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] > 0:
        return ops.logsumexp_argmax(logits)
    return torch.logsumexp(logits, dim=-1), logits.argmax(dim=-1)
