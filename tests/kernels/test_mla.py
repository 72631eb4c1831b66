"""The two MLA attention paths of atom/kernels/mla.py agree (fp32, random tensors): decode in
the latent space with the up-projection absorbed, against the latent expanded to per-head K/V
(DeepSeek-V2, arXiv:2405.04434), over several context lengths and shuffled block tables."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.attention import AttentionMetadata
from atom.kernels import cpu_ops
from atom.kernels.mla import (absorb_query, absorbed_decode_attention,
                              absorbed_decode_attention_reference, expand_latent,
                              expanded_attention, write_latent)
from tests.utils import assert_sums_close

H, R, DR, DN, DV = 4, 32, 8, 16, 12  # heads, kv_lora_rank, rope, nope, value (DV != DN + DR)
NUM_BLOCKS, BLOCK_SIZE = 40, 8


def _decode_meta(context_lens: list[int], gen: torch.Generator) -> AttentionMetadata:
    """One decode token per sequence, blocks from a shuffled pool (non-contiguous tables)."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in context_lens)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int64)
    slots = []
    for i, n in enumerate(context_lens):
        for j in range(-(-n // BLOCK_SIZE)):
            tables[i, j] = free.pop()
        slots.append(int(tables[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=list(range(len(context_lens) + 1)),
        context_lens=list(context_lens), block_tables=tables, num_decodes=len(context_lens),
        context_lens_tensor=torch.tensor(context_lens))


@pytest.mark.parametrize("context_lens", [[1], [7, 8, 9], [33, 1, 64, 17], [100, 3]])
def test_absorbed_decode_equals_expanded(context_lens):
    gen = torch.Generator().manual_seed(sum(context_lens))
    meta = _decode_meta(context_lens, gen)
    cache = torch.randn(1, NUM_BLOCKS, BLOCK_SIZE, 1, R + DR, generator=gen)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    q = torch.randn(len(context_lens), H, DN + DR, generator=gen)
    new_rows = torch.randn(len(context_lens), R + DR, generator=gen)
    write_latent(cache, new_rows, meta)
    scale = (DN + DR) ** -0.5

    # expanded: every context token up-projected to per-head K/V, ordinary attention
    expanded = torch.zeros(len(context_lens), H, DV)
    as_prefill = AttentionMetadata(**{**meta.__dict__, "num_decodes": 0})
    expanded_attention(q, new_rows, cache, as_prefill, w_kv_b=w_kv_b, kv_lora_rank=R,
                       scale=scale, seq_range=range(len(context_lens)), out=expanded)

    # absorbed: W_UK into the query, attention over the latent rows, W_UV on the output
    per_head = w_kv_b.view(H, DN + DV, R)
    w_uk, w_uv = per_head[:, :DN], per_head[:, DN:]
    q_latent = absorb_query(q[..., :DN], q[..., DN:], w_uk)
    # Terms per output along the longest chain of float32 sums: the up-projections from the
    # latent (R, twice), q . k (DN + DR, or R + DR absorbed), p . v over the context.
    sums = 2 * R + R + DN + DR + max(context_lens)
    # the compiled kernel (reading the latent in place) and the torch reference
    assert cpu_ops.load() is not None, cpu_ops.unavailable_reason()
    for attend in (absorbed_decode_attention, absorbed_decode_attention_reference):
        weighted = attend(q_latent, cache, meta.block_tables, meta.context_lens_tensor,
                          kv_lora_rank=R, scale=scale)
        absorbed = torch.einsum("shr,hvr->shv", weighted, w_uv)
        assert_sums_close(absorbed, expanded, reduction_len=sums, num_paths=2)

    # and both equal attention written out over the expanded K/V of each sequence
    for i, n in enumerate(context_lens):
        rows = cache[0].index_select(0, meta.block_tables[i]).flatten(0, 1)[:n, 0]
        k, v = expand_latent(rows, w_kv_b, num_heads=H, kv_lora_rank=R, nope_dim=DN)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[i], k) * scale, dim=-1)
        assert_sums_close(torch.einsum("ht,thv->hv", probs, v), absorbed[i],
                          reduction_len=sums, num_paths=2)


def test_write_latent_skips_padding():
    cache = torch.zeros(1, 4, BLOCK_SIZE, 1, R + DR)
    meta = AttentionMetadata(slot_mapping=torch.tensor([3, -1]), query_start_loc=[0, 1],
                             context_lens=[4], block_tables=torch.zeros(1, 1, dtype=torch.int64),
                             num_decodes=1, context_lens_tensor=torch.tensor([4]))
    rows = torch.randn(2, R + DR)
    write_latent(cache, rows, meta)
    assert torch.equal(cache.view(-1, R + DR)[3], rows[0])
    assert int((cache != 0).any(-1).sum()) == 1
