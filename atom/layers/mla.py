"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3,
arXiv:2412.19437) over a paged latent KV cache (:mod:`atom.kernels.mla`).

Per token: the query comes from a low-rank pair (``q_a_proj`` → ``q_a_layernorm`` →
``q_b_proj``; DeepSeek-V3) or one projection (``q_proj``, when ``q_lora_rank`` is null:
DeepSeek-V2-Lite), ``Dn + Dr`` values per head of which the last ``Dr`` get the rotary
embedding; ``kv_a_proj_with_mqa`` gives the compressed KV (``kv_lora_rank`` = R values,
normalized by ``kv_a_layernorm``) and one rotary key shared by every head (``Dr`` values). Those
``R + Dr`` values are all the layer caches. ``kv_b_proj`` (``[H * (Dn + Dv), R]``) up-projects
the latent to per-head keys (``Dn``, the rotary key appended) and values (``Dv``, which need not
equal ``Dn + Dr``).

Prefill sequences attend with the latent expanded to per-head K/V; decode sequences attend in
the latent space with ``kv_b_proj`` absorbed into the query and the output
(:mod:`atom.kernels.mla`); ``absorb=False`` sends decodes through the expanded path too
(scripts/bench_mla.py's baseline).

The rotary pairs: DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...``
(transformers' ``rope_interleave``, and DeepSeek-V2's complex form). The model permutes the
rotary rows of ``q_*_proj`` and ``kv_a_proj_with_mqa`` at load (even rows first, then odd;
:func:`deinterleave_rows`) so this module applies the half-split ``rotate_half`` rotary: dot
products of queries and keys are unchanged (both permuted alike).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels.attention import AttentionMetadata
from atom.kernels.fused import apply_rotary_reference
from atom.kernels.mla import (absorb_query, absorbed_decode_attention, expanded_attention,
                              write_latent)
from atom.layers.linear import Linear
from atom.layers.norm import RMSNorm


def deinterleave_rows(weight: torch.Tensor, *, row_start: int, rope_dim: int,
                      stride: int, count: int) -> torch.Tensor:
    """A copy of ``weight`` whose rotary row blocks are reordered from interleaved pairs to
    halves: in each of ``count`` blocks (block ``i`` starts at ``row_start + i * stride``, spans
    ``rope_dim`` rows), rows ``0, 2, 4, ...`` first, then ``1, 3, 5, ...``."""
    out = weight.clone()
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    for i in range(count):
        start = row_start + i * stride
        out[start:start + rope_dim] = weight[start:start + rope_dim][order]
    return out


class MLAttention(nn.Module):
    """Multi-head latent attention reading and writing the layer's paged latent cache.

    ``kv_cache`` (``[1, num_blocks, block_size, 1, R + Dr]``, a latent
    :class:`~atom.kv_cache_spec.KVCacheSpec`) is bound by the model runner, which owns it.

    Args:
        hidden_size: the residual stream's width.
        num_heads: H, query heads (every head reads the one latent).
        q_lora_rank: the query's low rank, or None for a plain ``q_proj``.
        kv_lora_rank: R, the cached latent's width.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: Dn, Dr, Dv.
        scale: the softmax scale (``(Dn + Dr) ** -0.5``, times YaRN's mscale squared).
        eps: the epsilon of ``q_a_layernorm`` / ``kv_a_layernorm``.
        absorb: decode in the latent space (the default); False = the expanded path for
            decodes too.

    Parameters: ``q_a_proj.weight`` ``[q_lora_rank, hidden]``, ``q_a_layernorm.weight``,
    ``q_b_proj.weight`` ``[H * (Dn + Dr), q_lora_rank]`` (or ``q_proj.weight``
    ``[H * (Dn + Dr), hidden]``), ``kv_a_proj_with_mqa.weight`` ``[R + Dr, hidden]``,
    ``kv_a_layernorm.weight`` ``[R]``, ``kv_b_proj.weight`` ``[H * (Dn + Dv), R]``,
    ``o_proj.weight`` ``[hidden, H * Dv]``; :meth:`prepare_absorbed` moves ``kv_b_proj``'s into
    buffers.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, eps: float = 1e-6, absorb: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = scale
        self.absorb = absorb
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * self.qk_dim)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.qk_dim)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size)
        self.kv_cache: torch.Tensor | None = None
        # kv_b_proj's weight as both attention paths read it (prepare_absorbed)
        for name in ("w_kv_b", "w_uk", "w_uv"):
            self.register_buffer(name, None, persistent=False)

    def prepare_absorbed(self) -> None:
        """Move ``kv_b_proj``'s loaded weight into the buffers both attention paths read (the
        expanded path multiplies by the whole matrix, the absorbed one by per-head blocks, so a
        oneDNN-packed Linear would serve neither): ``w_kv_b`` ``[H * (Dn + Dv), R]`` and its
        views ``w_uk`` ``[H, Dn, R]``, ``w_uv`` ``[H, Dv, R]``; the Linear is dropped. Call once,
        after the weights are loaded."""
        w = self.kv_b_proj.weight.detach()
        per_head = w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_kv_b, self.w_uk, self.w_uv = (w, per_head[:, :self.nope_dim],
                                             per_head[:, self.nope_dim:])
        self.kv_b_proj = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x ``[T, hidden]``, cos/sin ``[T, Dr]`` (each token's position), run dtype →
        ``[T, hidden]``; writes the tokens' latent rows to their slots (none for padding)."""
        num_tokens = x.shape[0]
        q_in = x if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q_proj = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        q = q_proj(q_in).view(num_tokens, self.num_heads, self.qk_dim)
        q = torch.cat([q[..., :self.nope_dim],
                       apply_rotary_reference(q[..., self.nope_dim:], cos, sin)], dim=-1)
        kv_a = self.kv_a_proj_with_mqa(x)
        k_pe = apply_rotary_reference(kv_a[:, None, self.kv_lora_rank:], cos, sin)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(kv_a[:, :self.kv_lora_rank].contiguous()), k_pe],
                           dim=-1)
        assert self.kv_cache is not None, "bind_kv_caches() must run before the forward"
        assert self.w_kv_b is not None, "prepare_absorbed() must run before the forward"
        write_latent(self.kv_cache, latent, meta)
        out = q.new_zeros(num_tokens, self.num_heads, self.v_dim)
        num_decodes = meta.num_decodes if self.absorb else 0
        if num_decodes:
            out[:num_decodes] = self._absorbed_decode(q[:num_decodes], meta)
        if meta.num_seqs > num_decodes:
            expanded_attention(q, latent, self.kv_cache, meta, w_kv_b=self.w_kv_b,
                               kv_lora_rank=self.kv_lora_rank, scale=self.scale,
                               seq_range=range(num_decodes, meta.num_seqs), out=out)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _absorbed_decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decodes' ``[S, H, Dv]`` through the latent space (module docstring)."""
        num_decodes = q.shape[0]
        q_latent = absorb_query(q[..., :self.nope_dim], q[..., self.nope_dim:], self.w_uk)
        weighted = absorbed_decode_attention(
            q_latent, self.kv_cache, meta.block_tables[:num_decodes],
            meta.context_lens_tensor[:num_decodes], kv_lora_rank=self.kv_lora_rank,
            scale=self.scale)
        return torch.einsum("shr,hvr->shv", weighted, self.w_uv)
