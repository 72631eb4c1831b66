"""Grouped-query self-attention over a paged KV cache, with q/k/v fused in one GEMM.

The one attention module of the Llama, Mixtral, Qwen3 and gpt-oss families; Qwen3 adds a
per-head RMSNorm on the queries and keys before the rotary embedding (``qk_norm_eps``; Qwen3
technical report, arXiv:2505.09388, "QK-Norm"); gpt-oss adds biases on the projections, a learned
sink logit per head and, in every other layer, a sliding window (``bias``, ``sinks``,
``sliding_window``). The kernels (:func:`atom.kernels.attention.paged_attention`) write the
step's keys and values into the layer's cache and attend over each sequence's context.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels import fused
from atom.kernels.attention import AttentionMetadata, paged_attention
from atom.layers.linear import Linear
from atom.layers.norm import RMSNorm


class Attention(nn.Module):
    """Self-attention with fused QKV; reads and writes the layer's paged KV cache.

    ``kv_cache`` (``[2, num_blocks, block_size, H_kv, D]``, :class:`atom.kv_cache_spec.KVCacheSpec`)
    is bound by the model runner, which owns it; this module only writes the slots of the
    current step's tokens.

    Args:
        hidden_size: the residual stream's width.
        num_heads, num_kv_heads: query heads and KV heads (a multiple of ``num_kv_heads``).
        head_dim: values per head (need not be ``hidden_size / num_heads``: Qwen3).
        qk_norm_eps: when set, RMSNorm each query and key head (weights ``q_norm.weight``,
            ``k_norm.weight``, ``[head_dim]``) with this epsilon before the rotary embedding.
        bias: the q/k/v and output projections have biases (``qkv_proj.bias``, ``o_proj.bias``).
        sinks: a learned logit per query head in the softmax's denominator (``sinks`` ``[H]``;
            :mod:`atom.kernels.attention`).
        sliding_window: each query sees only its latest this many positions; None = all.

    Parameters: ``qkv_proj.weight`` ``[(H + 2 H_kv) * D, hidden]`` (q rows, then k, then v),
    ``o_proj.weight`` ``[hidden, H * D]``.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm_eps: float | None = None, bias: bool = False, sinks: bool = False,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=bias)
        self.sinks = (nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks
                      else None)
        self.sliding_window = sliding_window
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.kv_cache: torch.Tensor | None = None
        # the KV cache group whose block tables this layer reads (bind_kv_caches sets it)
        self.kv_cache_group = 0

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x ``[T, hidden]``, cos/sin ``[T, D]`` (each token's position), run dtype →
        ``[T, hidden]``; writes the tokens' K/V to their slots (none for padding)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_norm = ({} if self.q_norm is None else  # QK-norm, in the rotary's call
                   dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight, eps=self.q_norm.eps))
        fused.rotary_embedding_(qkv, cos, sin, num_heads=self.num_heads,
                                num_kv_heads=self.num_kv_heads, **qk_norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        assert self.kv_cache is not None, "bind_kv_caches() must run before the forward"
        meta = meta.for_group(self.kv_cache_group)
        out = paged_attention(q, k, v, self.kv_cache, meta, scale=self.scale, sinks=self.sinks,
                              sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))
