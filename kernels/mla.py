"""Multi-head latent attention (MLA) over a paged **latent** KV cache: the torch paths.

DeepSeek-V2 (arXiv:2405.04434, section 2.1) caches, per token and layer, one latent vector
instead of a key and a value per head::

    latent_cache (one per layer)  [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]
        row[:kv_lora_rank] = c_kv, the normalized compressed KV (kv_a_layernorm applied)
        row[kv_lora_rank:] = k_pe, the shared rotary key (rotary embedding applied)

The slot, block table and metadata rules are those of :mod:`atom.kernels.attention` (the same
:class:`~atom.kernels.attention.AttentionMetadata`). Per head ``h`` the keys and values are
``k_h = [c_kv @ W_UK[h].T, k_pe]`` and ``v_h = c_kv @ W_UV[h].T`` (``W_UK[h]`` ``[Dn, R]``,
``W_UV[h]`` ``[Dv, R]``: the rows of ``kv_b_proj`` for head ``h``). Two exact ways to attend:

- **expanded** (:func:`expanded_attention`, used for prefill): up-project every context token to
  per-head K/V and run ordinary causal attention;
- **absorbed** (:func:`absorbed_decode_attention`, used for decode): fold ``W_UK`` into the
  query (``q_abs[h] = q_nope[h] @ W_UK[h]``, ``[R]``) and ``W_UV`` into the output, so the
  scores are ``[q_abs, q_pe] . latent_row`` and the output ``sum_t p_t c_kv_t @ W_UV[h].T``:
  a multi-query attention of width ``R + rope_dim`` whose single KV head is the latent cache
  itself, read in place of any per-head K/V (DeepSeek-V2, section 2.1.2: ``W_UK`` absorbed
  into ``W_Q``, ``W_UV`` into ``W_O``; MLA serving engines decode this way).

Both give the same result up to float rounding (tests/kernels/test_mla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import cpu_ops
from atom.kernels.attention import AttentionMetadata, attend_causal, gather_kv


def write_latent(latent_cache: torch.Tensor, latent: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """Scatter the step's new latent rows into their slots (in place).

    Args:
        latent_cache: ``[1, num_blocks, block_size, 1, L]`` (``L = kv_lora_rank + rope_dim``).
        latent: ``[T, L]``, the step's tokens (padding after ``query_start_loc[-1]`` writes
            nothing).
    """
    num_real = meta.query_start_loc[-1]
    if num_real == 0:
        return
    width = latent_cache.shape[-1]
    latent_cache.view(-1, width).index_copy_(0, meta.slot_mapping[:num_real],
                                             latent[:num_real].to(latent_cache.dtype))


def gather_latent(latent_cache: torch.Tensor, block_table: torch.Tensor,
                  context_len: int) -> torch.Tensor:
    """The first ``context_len`` latent rows of one sequence: ``[context_len, L]`` (a copy)."""
    return gather_kv(latent_cache[0], block_table, context_len)[:, 0]


def expand_latent(latent: torch.Tensor, w_kv_b: torch.Tensor, *, num_heads: int,
                  kv_lora_rank: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values of latent rows.

    Args:
        latent: ``[N, R + rope_dim]``.
        w_kv_b: ``kv_b_proj``'s weight ``[H * (Dn + Dv), R]`` (per head: Dn key rows, then Dv
            value rows).
    Returns:
        (keys ``[N, H, Dn + rope_dim]``, values ``[N, H, Dv]``), latent's dtype.
    """
    c_kv, k_pe = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
    kv = F.linear(c_kv, w_kv_b).view(latent.shape[0], num_heads, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
    return k, v


def expanded_attention(q: torch.Tensor, latent: torch.Tensor, latent_cache: torch.Tensor,
                       meta: AttentionMetadata, *, w_kv_b: torch.Tensor, kv_lora_rank: int,
                       scale: float, seq_range: range, out: torch.Tensor) -> None:
    """Causal attention of the sequences in ``seq_range`` with the latent expanded to per-head
    K/V (the prefill path), into ``out``.

    Args:
        q: ``[T, H, Dn + rope_dim]`` (rotary applied to its last ``rope_dim`` values).
        latent: ``[T, R + rope_dim]``, the step's new rows (already written to the cache): a
            sequence without cached context attends over these directly, the others gather
            their whole context from ``latent_cache``.
        latent_cache: ``[1, num_blocks, block_size, 1, R + rope_dim]``.
        w_kv_b: ``kv_b_proj``'s weight ``[H * (Dn + Dv), R]``.
        out: ``[T, H, Dv]``, written at the tokens of ``seq_range``.
    """
    num_heads, qk_dim = q.shape[1], q.shape[2]
    nope_dim = qk_dim - (latent.shape[1] - kv_lora_rank)
    value_dim = out.shape[2]
    for i in seq_range:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        context_len = meta.context_lens[i]
        rows = (latent[start:end] if end - start == context_len
                else gather_latent(latent_cache, meta.block_tables[i], context_len))
        k, v = expand_latent(rows, w_kv_b, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                             nope_dim=nope_dim)
        if value_dim != qk_dim:  # one head width for q, k and v (SDPA's fast CPU kernels)
            v = F.pad(v, (0, qk_dim - value_dim))
        out[start:end] = attend_causal(q[start:end], k, v, scale=scale)[..., :value_dim]


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed query: ``[q_nope @ W_UK, q_pe]`` per head.

    Args:
        q_nope: ``[S, H, Dn]``; q_pe: ``[S, H, rope_dim]`` (rotary applied).
        w_uk: ``[H, Dn, R]`` (``kv_b_proj``'s key rows, per head).
    Returns:
        ``[S, H, R + rope_dim]``.
    """
    return torch.cat([torch.einsum("shd,hdr->shr", q_nope, w_uk), q_pe], dim=-1)


def absorbed_decode_attention(q_latent: torch.Tensor, latent_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                              kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Batched decode attention in the latent space: the compiled paged decode kernel when it
    is built, else :func:`absorbed_decode_attention_reference`.

    The latent cache is a cache of one KV head of ``R + rope_dim`` values whose keys and values
    are the same rows, so the grouped-query decode kernel
    (``kernels/csrc/paged_attention.cpp``, all ``H`` query heads in one group) reads it in
    place, as its keys and as its values, and the first ``R`` values of its output are the
    weighted latent (the last ``rope_dim`` are computed and dropped: about 11% more value
    work for DeepSeek-V3's 512 + 64, against a gathered copy of every context in the torch
    path: 3-13x slower on a 2-core Zen 4, contexts 128-4096). Arguments and result as the
    reference.
    """
    ops = cpu_ops.load() if q_latent.device.type == "cpu" else None
    if ops is None or q_latent.shape[0] == 0:
        return absorbed_decode_attention_reference(q_latent, latent_cache, block_tables,
                                                   context_lens, kv_lora_rank=kv_lora_rank,
                                                   scale=scale)
    cache = latent_cache[0]
    return ops.paged_decode_attention(q_latent, cache, cache, block_tables, context_lens, scale,
                                      None, None)[..., :kv_lora_rank]


def absorbed_decode_attention_reference(q_latent: torch.Tensor, latent_cache: torch.Tensor,
                                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                                        *, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Batched decode attention in the latent space (one new token per sequence), in torch.

    The ``H`` heads of a sequence are ``H`` queries against one shared key/value head (the
    latent rows; values = their first ``R`` entries), so one SDPA call over the gathered
    latent rows, masked past each ``context_len``, does every sequence.

    Args:
        q_latent: ``[S, H, R + rope_dim]`` (:func:`absorb_query`).
        latent_cache: ``[1, num_blocks, block_size, 1, R + rope_dim]``.
        block_tables: int64 ``[S, >= max_num_blocks]``; context_lens: int64 ``[S]``, each ≥ 1.
    Returns:
        ``[S, H, R]``: the attention-weighted latent ``c_kv`` per head (multiply by ``W_UV``
        for the values), q's dtype.
    """
    num_seqs, num_heads, width = q_latent.shape
    if num_seqs == 0:
        return q_latent.new_empty(0, num_heads, kv_lora_rank)
    cache = latent_cache[0]
    block_size = cache.shape[1]
    max_context_len = int(context_lens.max())
    num_blocks = -(-max_context_len // block_size)
    table = block_tables[:, :num_blocks].flatten()
    rows = cache.index_select(0, table).view(num_seqs, num_blocks * block_size, width)
    rows = rows[:, :max_context_len].unsqueeze(1)  # [S, 1, L_max, width]
    valid = torch.arange(max_context_len, device=q_latent.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q_latent.unsqueeze(1), rows,
                                         rows[..., :kv_lora_rank], attn_mask=valid[:, None, None],
                                         scale=scale)
    return out.squeeze(1)
