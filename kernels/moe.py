"""The routed experts of a MoE layer in one compiled call (``kernels/csrc/fused_moe.cpp``).

A decode step gives each expert a few tokens, so one GEMM per expert (oneDNN, packed) costs its
fixed overhead per call, about 40 µs for one 512 KB expert on the 2-core Zen 4 of
docs/PERFORMANCE.md, more than reading the expert's weights. :func:`fused_moe` runs every
active expert of a layer in two parallel passes that stream each expert's weights once
(SiLU-gated MLPs, gates applied, summed per token); it is what vLLM's and SGLang's CPU backends
call their fused-experts kernel. :class:`atom.layers.moe.MoE` uses it where
:func:`fused_moe_applies` (AVX-512 builds), and otherwise its per-expert modules.

Where the kernels have AVX512-BF16, a layer's bfloat16 experts are instead packed once at load
for oneDNN's brgemm micro-kernel (:func:`pack_experts`) and run by :func:`fused_moe_packed`
(``kernels/csrc/fused_moe_packed.cpp``): experts with more than :data:`MAX_SMALL_TOKENS` tokens
on brgemm (AMX tiles where the CPU has them: Intel Xeon 4th generation and later), the others on
a VDPBF16PS kernel reading the same packed blocks (:func:`packed_layout_applies` decides).

Imports torch only.
"""

from __future__ import annotations

import functools

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


# An expert with at most this many tokens in a call runs the VDPBF16PS kernel, one with more
# brgemm (AMX tiles): a 16-row tile is mostly padding below that. SGLang's CPU MoE switches at the
# same count (sgl-kernel/csrc/cpu/moe.cpp: brgemm when M > 4).
MAX_SMALL_TOKENS = 4


@functools.cache
def amx_usable() -> bool:
    """Whether this CPU has AMX tiles and this process may use them (then brgemm runs on
    tiles). The tile-data permission (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) is
    requested here, once per process, through PyTorch (``torch.cpu._init_amx``)."""
    return bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._init_amx())


def packed_layout_applies(dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                          device: torch.device | str = "cpu") -> bool:
    """Whether a MoE layer's experts run packed (:func:`pack_experts`, :func:`fused_moe_packed`):
    bfloat16 on the CPU, ``hidden_size`` a multiple of 32 and ``intermediate_size`` of 16, and
    the kernels built with AVX512-BF16 (Zen 4 and 5, Cooper Lake, Sapphire Rapids and later).
    Elsewhere the experts keep their rows and :func:`fused_moe`. Requests AMX tiles where the CPU
    has them (:func:`amx_usable`).

    Why not only with AMX: on a Zen 5 (AVX512-BF16, no AMX) the packed kernels took 0.53-0.60x
    of the rows kernel's time per layer at 1-2,048 tokens (docs/PERFORMANCE.md,
    ``scripts/bench_kernels_ab.py``): the VDPBF16PS kernel on packed blocks needs no horizontal
    sums, and oneDNN's brgemm runs its AVX-512 kernels there."""
    if (dtype != torch.bfloat16 or torch.device(device).type != "cpu" or hidden_size % 32
            or intermediate_size % 16):
        return False
    ops = cpu_ops.load()
    if ops is None or not ops.fused_moe_packed_is_available():
        return False
    amx_usable()
    return True


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's expert weights in the blocks :func:`fused_moe_packed` reads (VNNI: each
    block's element ``(k, n)`` at ``[k // 2][n][k % 2]``, what brgemm and AMX tiles take).

    Args:
        w13: ``[E, 2I, H]`` (gate rows, then up), ``w2``: ``[E, H, I]``; bfloat16.
    Returns:
        ``w13p`` ``[E, I/16, H/2, 32, 2]`` (block ``j``: gate columns ``16j ..`` then the same up
        columns) and ``w2p`` ``[E, H/32, I/2, 32, 2]`` (block ``j``: output columns ``32j ..``),
        new contiguous tensors.
    Raises:
        ValueError: ``H`` is not a multiple of 32 or ``I`` of 16.
    """
    num_experts, hidden, intermediate = w13.shape[0], w13.shape[2], w2.shape[2]
    if hidden % 32 or intermediate % 16:
        raise ValueError(f"packed experts need hidden_size % 32 == 0 and intermediate_size % 16 "
                         f"== 0, got {hidden} and {intermediate}")
    gate = w13[:, :intermediate].reshape(num_experts, intermediate // 16, 16, hidden)
    up = w13[:, intermediate:].reshape(num_experts, intermediate // 16, 16, hidden)
    w13p = torch.cat([gate, up], dim=2).reshape(num_experts, intermediate // 16, 32, hidden // 2, 2)
    w2p = w2.reshape(num_experts, hidden // 32, 32, intermediate // 2, 2)
    return (w13p.permute(0, 1, 3, 2, 4).contiguous(), w2p.permute(0, 1, 3, 2, 4).contiguous())


def fused_moe_packed(x: torch.Tensor, w13p: torch.Tensor, w2p: torch.Tensor, ids: torch.Tensor,
                     gates: torch.Tensor, *, max_small_tokens: int = MAX_SMALL_TOKENS
                     ) -> torch.Tensor:
    """:func:`fused_moe` on weights packed by :func:`pack_experts` (bfloat16 only): experts with
    more than ``max_small_tokens`` tokens run oneDNN's brgemm in blocks of 32 tokens (AMX tiles
    where the CPU has them, AVX-512 elsewhere), the others a VDPBF16PS kernel.

    Args:
        x: ``[T, H]`` bfloat16, rows contiguous; ``ids`` int64 ``[T, k]``; ``gates`` ``[T, k]``.
    Returns:
        ``[T, H]`` bfloat16, as :func:`fused_moe` (float32 sums, bf16 activations). A token's
        sum over its slots does not depend on their order; an expert's output does depend on
        the path its token count picks (the two sum in different orders, and AMX tiles round
        their pairs their own way), so when EPLB splits an expert's tokens over replicas a
        token's bf16 output may change in its last bits (the float32 rows kernel's does not).
    Raises:
        RuntimeError: the kernels lack the path (no AVX512-BF16 build, oneDNN off), or the shapes
            or dtypes are not the above.
    """
    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError(f"fused_moe_packed needs atom's C++ kernels: "
                           f"{cpu_ops.unavailable_reason()}")
    return ops.fused_moe_packed(x, w13p, w2p, ids.contiguous(), gates.float().contiguous(),
                                max_small_tokens)


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
