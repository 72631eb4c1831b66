"""Paged KV cache and attention over it: a torch reference and a batched decode path.

Imports torch only (``atom.kernels`` sits at the bottom of the import graph).

Layout (vLLM's paged KV cache)::

    kv_cache (one per layer)  [2, num_blocks, block_size, num_kv_heads, head_dim]   run dtype
        kv_cache[0] = key cache, kv_cache[1] = value cache

    slot  = block_id * block_size + offset_in_block        (int64, one per new token)
    block_table[i] = the block ids of sequence i, in token order; token j of sequence i
                     lives in block block_table[i][j // block_size] at offset j % block_size

A step's batch is flattened into ``T`` tokens. Sequence ``i`` owns the contiguous token range
``[query_start_loc[i], query_start_loc[i+1])`` of ``query_len_i`` new tokens at positions
``[context_len_i - query_len_i, context_len_i)``; it attends causally to all ``context_len_i``
tokens of its own KV (earlier prefill chunks and prefix-cached blocks included), read through
its block table. One rule covers prefill, chunked prefill and decode (``query_len_i == 1``).
Tokens after the last sequence (``T > query_start_loc[-1]``) are padding: they write no KV
(slot ``-1``) and their attention output is zero.

Two per-layer options (gpt-oss; every path takes them):

- ``sliding_window = W``: a query at position ``p`` sees only the keys at positions
  ``(p - W, p]`` (Hugging Face's ``sliding_window_overlay``: ``kv_idx > q_idx - W``). A
  sliding layer reads its KV cache group's block tables (``AttentionMetadata.group_metadata``),
  where the blocks before a sequence's window may have been released: their entries are block
  0, which every path masks (the compiled kernels start reading at the window; the torch paths
  gather finite values and mask them), so a released block never changes a result.
- ``sinks``: float ``[H]``, one learned logit per query head added to the softmax's
  denominator only (``softmax([scores, sink])`` with the sink's column dropped: the weights of
  the real keys sum to less than 1; "attention sinks", Xiao et al. 2023, arXiv:2309.17453, in
  gpt-oss's learned form).

Sequences are ordered decodes first: the first ``num_decodes`` sequences have ``query_len == 1``
and go through one batched call (:func:`decode_attention`: the compiled kernel of
:mod:`atom.kernels.cpu_ops`, which reads the blocks in place, or, without it, the torch
gather + masked SDPA of :func:`paged_decode_attention`); the others through one more
(:func:`prefill_attention`: the compiled prefill kernel, which reads the blocks in place too, or
the per-sequence reference :func:`paged_prefill_attention_reference`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.kernels import cpu_ops

#: The one sentinel slot value: a token whose slot is ``NO_KV_WRITE_SLOT`` writes no KV. Used for
#: dummy batches (a DP rank with no work still runs the forward) and for padding tokens.
NO_KV_WRITE_SLOT = -1


@dataclass
class AttentionMetadata:
    """Per-step description of a flattened batch, shared by every layer.

    Attributes:
        slot_mapping: int64 ``[T]``; the KV slot of each new token, or ``NO_KV_WRITE_SLOT``.
        query_start_loc: host list of ``S + 1`` ints; token offsets of each sequence's new
            tokens in the flattened batch (cumulative query lengths, starting at 0).
        context_lens: host list of ``S`` ints; tokens with KV after this step per sequence
            (cached + new).
        block_tables: int64 ``[S, max_num_blocks]``; rows padded with block 0 (never read: the
            padded columns lie beyond ``context_len`` and are masked out).
        num_decodes: the first ``num_decodes`` sequences have ``query_len == 1``.
        context_lens_tensor: int64 ``[S]``, the same as ``context_lens`` on the device (used by
            the batched decode mask).
        group_metadata: KV cache groups 1.. of a hybrid model (gpt-oss's sliding layers): the
            same step through each group's own block tables and slots
            (:meth:`for_group`); empty for one group. A sliding group's blocks before a
            sequence's window are block 0 in its table: the window masks them, the compiled
            kernels never read them and the torch paths read finite values they mask out.
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    num_decodes: int
    context_lens_tensor: torch.Tensor
    group_metadata: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group ``group`` (0: this one)."""
        return self if group == 0 else self.group_metadata[group - 1]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @functools.cached_property
    def query_start_loc_tensor(self) -> torch.Tensor:
        """int64 ``[S + 1]``, ``query_start_loc`` on the device (made once per step, on first
        use: every layer's prefill attention reads it)."""
        return torch.tensor(self.query_start_loc, dtype=torch.int64,
                            device=self.slot_mapping.device)

    @classmethod
    def empty(cls, num_tokens: int = 0, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for a dummy batch of ``num_tokens`` padding tokens (no KV written or read)."""
        return cls(
            slot_mapping=torch.full((num_tokens,), NO_KV_WRITE_SLOT, dtype=torch.int64,
                                    device=device),
            query_start_loc=[0],
            context_lens=[],
            block_tables=torch.zeros((0, 1), dtype=torch.int64, device=device),
            num_decodes=0,
            context_lens_tensor=torch.zeros((0,), dtype=torch.int64, device=device),
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' keys and values into their cache slots (in place).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, run dtype.
        k, v: ``[T, num_kv_heads, head_dim]``, same dtype (cast if not).
        slot_mapping: int64 ``[T]``; ``NO_KV_WRITE_SLOT`` (-1) leaves the cache untouched for
            that token. Other values must lie in ``[0, num_blocks * block_size)``.
    """
    valid = slot_mapping != NO_KV_WRITE_SLOT
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    _scatter_kv(k_cache, v_cache, k, v, slot_mapping)


def _scatter_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slots: torch.Tensor) -> None:
    """:func:`write_kv` for slots that are all valid (one ``index_copy_`` per cache)."""
    if slots.numel() == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def _write_step_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   meta: AttentionMetadata) -> None:
    """Write a step's new K/V: its real tokens ``[0, query_start_loc[-1])`` all have slots (the
    runner's layout), the padding after them writes nothing, so no per-token check is needed."""
    num_real = meta.query_start_loc[-1]
    _scatter_kv(k_cache, v_cache, k[:num_real], v[:num_real], meta.slot_mapping[:num_real])


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` cached tokens of one sequence.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (key or value cache).
        block_table: int64 ``[>= ceil(context_len / block_size)]``.
    Returns:
        ``[context_len, num_kv_heads, head_dim]`` (a copy).
    """
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:context_len]


def causal_window_mask(len_q: int, len_k: int, *, sliding_window: int | None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """bool ``[L_q, L_k]``: which keys each of ``L_q`` queries sees when the queries are the
    *last* ``L_q`` of ``L_k`` positions (bottom-right causal), within ``sliding_window``."""
    q_pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    k_pos = torch.arange(len_k, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                     scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention written out (float32 math), with optional sinks: the torch reference of the
    sink and sliding-window paths (the same steps as Hugging Face's gpt-oss eager attention).

    Args:
        q: ``[B, H_kv, G, L_q, D]`` (the ``G = H / H_kv`` query heads of each KV head grouped).
        k, v: ``[B, H_kv, L_k, D]``.
        mask: bool, broadcastable to ``[B, H_kv, G, L_q, L_k]``; True = visible. Every query
            must see at least one key.
        sinks: ``[H]`` (head ``h = kv_head * G + g``), or None.
    Returns:
        ``[B, H_kv, G, L_q, D]`` in q's dtype.
    """
    scores = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, *q.shape[1:3], 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float().unsqueeze(2)).to(q.dtype)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  sinks: torch.Tensor | None = None,
                  sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of ``L_q`` queries that are the *last* ``L_q`` of ``L_k`` positions.

    q: ``[L_q, H, D]``; k, v: ``[L_k, H_kv, D]`` with ``H % H_kv == 0`` (GQA). Returns
    ``[L_q, H, D]``. Without sinks or a window: SDPA (its ``is_causal`` aligns the mask
    top-left, right only when ``L_q == L_k``; otherwise query ``j`` may see keys
    ``<= L_k - L_q + j``, bottom-right); with either: :func:`masked_attention`.
    """
    len_q, len_k = q.shape[0], k.shape[0]
    if sinks is not None or sliding_window is not None:
        num_kv_heads = k.shape[1]
        qg = q.view(len_q, num_kv_heads, -1, q.shape[-1]).permute(1, 2, 0, 3).unsqueeze(0)
        mask = causal_window_mask(len_q, len_k, sliding_window=sliding_window, device=q.device)
        out = masked_attention(qg, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                               mask, scale=scale, sinks=sinks)
        return out.squeeze(0).permute(2, 0, 1, 3).reshape(q.shape)
    # A leading batch dim of 1: with 3-D inputs the CPU SDPA takes its math path, with 4-D the
    # flash kernel (5x faster at 1k tokens).
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if len_q == len_k:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        mask = causal_window_mask(len_q, len_k, sliding_window=None, device=q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def paged_prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, meta: AttentionMetadata, *, scale: float, seq_range: range,
    out: torch.Tensor, sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> None:
    """Reference attention, one sequence at a time (any query lengths), into ``out``.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, H_kv, D]`` the new tokens' keys/values (already written to
            the cache). A sequence with no cached context (``query_len == context_len``) attends
            over ``k``/``v`` directly; the others gather their context from the cache.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``.
        seq_range: which sequences of ``meta`` to compute.
        out: ``[T, H, D]``, written at the tokens of the sequences in ``seq_range``.
        sinks, sliding_window: the layer's options (module docstring); None = off.
    """
    for i in seq_range:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        context_len = meta.context_lens[i]
        if end - start == context_len:
            ks, vs = k[start:end], v[start:end]
        else:
            ks = gather_kv(k_cache, meta.block_tables[i], context_len)
            vs = gather_kv(v_cache, meta.block_tables[i], context_len)
        out[start:end] = attend_causal(q[start:end], ks, vs, scale=scale, sinks=sinks,
                                       sliding_window=sliding_window)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, *, scale: float, sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Batched attention for ``S`` sequences with one new token each (decode).

    Gathers every sequence's blocks padded to the longest context, masks keys at or beyond each
    ``context_len`` (and, with a window, before ``context_len - sliding_window``) and runs one
    SDPA (:func:`masked_attention` with sinks or a window). GQA is done by grouping query heads
    per KV head (``[S, H_kv, G, D]``) instead of repeating K/V, so the gathered K/V are read once.

    Args:
        q: ``[S, H, D]`` run dtype (the token at position ``context_len - 1``).
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``.
        block_tables: int64 ``[S, >= max_num_blocks]``; columns past the longest context are
            ignored.
        context_lens: int64 ``[S]``, each ``>= 1``.
        sinks, sliding_window: the layer's options (module docstring); None = off.
    Returns:
        ``[S, H, D]``, run dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return q.new_empty(q.shape)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_context_len = int(context_lens.max())
    num_blocks = -(-max_context_len // block_size)
    # index_select on the flattened table: ~20x faster on CPU than advanced indexing with a
    # 2-D index (k_cache[table]), which dominated the decode step.
    table = block_tables[:, :num_blocks].flatten()
    gathered_shape = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    # [S * nb, bs, Hkv, D] -> [S, L, Hkv, D] -> [S, Hkv, L, D]
    ks = k_cache.index_select(0, table).view(gathered_shape)[:, :max_context_len].transpose(1, 2)
    vs = v_cache.index_select(0, table).view(gathered_shape)[:, :max_context_len].transpose(1, 2)
    key_pos = torch.arange(max_context_len, device=q.device)[None, :]
    valid = key_pos < context_lens[:, None]
    if sliding_window is not None:
        valid &= key_pos >= context_lens[:, None] - sliding_window
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    if sinks is not None or sliding_window is not None:
        out = masked_attention(qg.unsqueeze(3), ks, vs, valid[:, None, None, None, :],
                               scale=scale, sinks=sinks)
    else:
        mask = valid[:, None, None, :]  # [S, 1, 1, L], broadcast over KV heads and the group
        out = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, *, scale: float, sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Batched decode attention: the compiled CPU kernel when it is built, else the torch path.

    The kernel (``kernels/csrc/paged_attention.cpp``) walks each sequence's block table and reads
    K/V in place, so no context is copied (bfloat16 K/V are read as bf16 and accumulated in
    float32; q may be a strided view of the fused qkv; sinks and the window too: a windowed
    sequence's blocks before its window are not read); :func:`paged_decode_attention` gathers
    whole contexts and is the fallback (no compiler, ``ATOM_DISABLE_CPP_KERNELS=1``, or a
    non-CPU device). Arguments and result as :func:`paged_decode_attention` (float32 or
    bfloat16; each ``context_len >= 1``); ``new_kv`` = (keys ``[S, H_kv, D]``, values, slots
    int64 ``[S]``): the step's new K/V, written to their slots first (:func:`write_kv`; in the
    kernel's call when it runs).
    """
    ops = cpu_ops.load() if q.device.type == "cpu" else None
    if ops is None:
        if new_kv is not None:
            write_kv(k_cache, v_cache, *new_kv)
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                      sinks=sinks, sliding_window=sliding_window)
    return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      sinks, sliding_window, *(new_kv or (None, None, None)))


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, meta: AttentionMetadata, *, scale: float, out: torch.Tensor,
    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
) -> None:
    """Causal attention of the prefill sequences of ``meta`` (those after its decodes) into
    ``out``: the compiled kernel when it is built, else the per-sequence reference.

    The kernel (``kernels/csrc/prefill_attention.cpp``) runs every prefill sequence of the step
    in one call and reads K/V from the cache through the block tables (new tokens, earlier
    chunks and prefix-cached blocks alike: no gathered copy, no SDPA per sequence; with a window,
    only the blocks from each tile's window start on); the
    reference (:func:`paged_prefill_attention_reference`) is the fallback (no compiler,
    ``ATOM_DISABLE_CPP_KERNELS=1``, or a non-CPU device).

    Args:
        q: ``[T, H, D]`` (may be a strided view of the fused qkv); k, v: ``[T, H_kv, D]``, the
            new tokens' keys/values, already written to the caches.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``, q's dtype.
        out: ``[T, H, D]``, written at the prefill sequences' rows only.
        sinks, sliding_window: the layer's options (module docstring); None = off.
    """
    ops = cpu_ops.load() if q.device.type == "cpu" else None
    num_decodes = meta.num_decodes
    if ops is None:
        paged_prefill_attention_reference(q, k, v, k_cache, v_cache, meta, scale=scale,
                                          seq_range=range(num_decodes, meta.num_seqs), out=out,
                                          sinks=sinks, sliding_window=sliding_window)
        return
    ops.paged_prefill_attention_(out, q, k_cache, v_cache, meta.block_tables[num_decodes:],
                                 meta.context_lens_tensor[num_decodes:],
                                 meta.query_start_loc_tensor[num_decodes:], scale, sinks,
                                 sliding_window)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    meta: AttentionMetadata, *, scale: float, sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write the new K/V to the paged cache, then attend (mixed prefill/decode batch).

    Args:
        q: ``[T, H, D]``; k, v: ``[T, H_kv, D]``; run dtype.
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]`` (mutated: the new tokens' slots).
        meta: the step's :class:`AttentionMetadata` (decodes first).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sinks: float ``[H]``, one logit per query head in every softmax's denominator, or None.
        sliding_window: each query sees its latest ``sliding_window`` positions only; None = all.
    Returns:
        ``[T, H, D]``; zero for padding tokens.
    """
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_decodes = meta.num_decodes
    assert meta.query_start_loc[num_decodes] == num_decodes, "decodes must come first"
    options = dict(scale=scale, sinks=sinks, sliding_window=sliding_window)
    if num_decodes == q.shape[0] and num_decodes > 0:  # a pure decode step, no padding
        return decode_attention(q, k_cache, v_cache, meta.block_tables,
                                meta.context_lens_tensor, new_kv=(k, v, meta.slot_mapping),
                                **options)
    _write_step_kv(k_cache, v_cache, k, v, meta)
    out = q.new_empty(q.shape)
    out[meta.query_start_loc[-1]:].zero_()  # padding tokens
    if num_decodes > 0:
        # Decodes come first, so their tokens are q[:num_decodes].
        out[:num_decodes] = decode_attention(
            q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
            meta.context_lens_tensor[:num_decodes], **options,
        )
    if meta.num_seqs > num_decodes:
        prefill_attention(q, k, v, k_cache, v_cache, meta, out=out, **options)
    return out


def paged_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    meta: AttentionMetadata, *, scale: float, sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Like :func:`paged_attention` but every sequence (decodes too) goes through the per-sequence
    reference that gathers from the cache; the yardstick for the faster paths in tests."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_step_kv(k_cache, v_cache, k, v, meta)
    out = torch.zeros_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ks = gather_kv(k_cache, meta.block_tables[i], meta.context_lens[i])
        vs = gather_kv(v_cache, meta.block_tables[i], meta.context_lens[i])
        out[start:end] = attend_causal(q[start:end], ks, vs, scale=scale, sinks=sinks,
                                       sliding_window=sliding_window)
    return out
