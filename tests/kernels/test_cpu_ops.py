"""The compiled paged decode attention kernel against the torch reference paths (CPU)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.attention import decode_attention, gather_kv, paged_decode_attention

# Every test takes the `ops` fixture (conftest.py): a kernel that did not build fails them.


def _random_case(*, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, max_len: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    lens[0] = max_len  # one full-length row; others ragged, some shorter than a block
    max_blocks = -(-max_len // block_size)
    num_blocks = num_seqs * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Shuffled, non-contiguous blocks per sequence; padded table columns point at block 0.
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, -1)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables.contiguous(), lens


def _per_sequence_reference(q, k_cache, v_cache, tables, lens, scale):
    """Plain softmax attention per sequence over its gathered context, in float64."""
    out = []
    group = q.shape[1] // k_cache.shape[2]
    for i in range(q.shape[0]):
        n = int(lens[i])
        k = gather_kv(k_cache, tables[i], n).double().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, tables[i], n).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("head_dim", [64, 12])  # 12: not a multiple of 8 (scalar loop)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_kernel_matches_reference_fp32(ops, head_dim, num_heads, num_kv_heads):
    q, kc, vc, tables, lens = _random_case(num_seqs=7, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, head_dim=head_dim,
                                           block_size=16, max_len=70, dtype=torch.float32)
    scale = head_dim ** -0.5
    out = ops.paged_decode_attention(q, kc, vc, tables, lens, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = _per_sequence_reference(q, kc, vc, tables, lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, paged_decode_attention(q, kc, vc, tables, lens, scale=scale),
                               atol=1e-5, rtol=1e-5)


def test_kernel_bf16_close_to_fp32_math(ops):
    q, kc, vc, tables, lens = _random_case(num_seqs=5, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=40, dtype=torch.bfloat16)
    out = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    # Same bf16 inputs, float64 math: the kernel only rounds in float32 accumulation.
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_decode_attention_uses_kernel_and_keeps_dtype(ops):
    q, kc, vc, tables, lens = _random_case(num_seqs=3, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=33, dtype=torch.bfloat16)
    out = decode_attention(q, kc, vc, tables, lens, scale=0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
                               .to(torch.bfloat16))


def test_kernel_rejects_bad_inputs(ops):
    q, kc, vc, tables, lens = _random_case(num_seqs=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=20, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_decode_attention(q, kc, vc, tables.int(), lens, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_decode_attention(q.bfloat16(), kc, vc, tables, lens, 0.125)
