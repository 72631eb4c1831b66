"""The fused elementwise kernels (kernels/csrc/fused_ops.cpp) against their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import fused

# Tests of the compiled kernels take the `ops` fixture (conftest.py): a kernel that did not build
# fails them.


def _randn(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("n", [576, 13])  # 13: the scalar tail after the 8-wide loop
@pytest.mark.parametrize("rows", [1, 70])
def test_rms_norm_matches_reference(ops, n, rows):
    x, w = _randn(rows, n, scale=3.0), _randn(n, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5),
                               rtol=1e-6, atol=1e-6)


def test_fused_add_rms_norm_updates_residual_in_place(ops):
    x, residual, w = _randn(33, 576), _randn(33, 576, seed=2), _randn(576, seed=3)
    expected_sum = residual + x
    expected = fused.rms_norm_reference(expected_sum, w, 1e-5)
    out = fused.rms_norm(x, w, 1e-5, residual=residual)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1536, 13])
def test_silu_and_mul_matches_reference(ops, n):
    x = _randn(40, 2 * n, scale=4.0)
    x[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])  # clamped exp, exact zero
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 12])  # 12: half = 6, the scalar loop only
def test_rotary_embedding_in_place_matches_reference(ops, head_dim):
    num_heads, num_kv_heads, rows = 9, 3, 21
    qkv = _randn(rows, (num_heads + 2 * num_kv_heads) * head_dim)
    cos, sin = _randn(rows, head_dim, seed=4), _randn(rows, head_dim, seed=5)
    q, k, v = qkv.clone().split([num_heads * head_dim, num_kv_heads * head_dim,
                                 num_kv_heads * head_dim], dim=-1)
    ref_q = fused.apply_rotary_reference(q.reshape(rows, num_heads, head_dim), cos, sin)
    ref_k = fused.apply_rotary_reference(k.reshape(rows, num_kv_heads, head_dim), cos, sin)
    ops.rotary_embedding_(qkv, cos, sin, num_heads, num_kv_heads)
    out_q, out_k, out_v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                                     num_kv_heads * head_dim], dim=-1)
    torch.testing.assert_close(out_q.reshape_as(ref_q), ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k.reshape_as(ref_k), ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(out_v, v)  # values are not rotated


def test_kernels_reject_wrong_dtype_and_shape(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(_randn(2, 8).double(), _randn(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_and_mul(_randn(2, 7))
    with pytest.raises(RuntimeError, match=r"\(H \+ 2 H_kv\) \* D"):
        ops.rotary_embedding_(_randn(2, 100), _randn(2, 8), _randn(2, 8), 2, 1)


def test_bfloat16_takes_the_torch_path():
    """Non-float32 inputs use the references (the kernels are float32 only)."""
    x, w = _randn(5, 64).bfloat16(), _randn(64, seed=1).bfloat16()
    assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5))
    gu = _randn(5, 32).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(fused.silu_and_mul(gu), F.silu(gate) * up)
    qkv = _randn(3, (2 + 2 * 1) * 8).bfloat16()  # 2 query heads, 1 KV head, head_dim 8
    cos, sin = _randn(3, 8, seed=2).bfloat16(), _randn(3, 8, seed=3).bfloat16()
    expected = fused.apply_rotary_reference(qkv[:, :24].reshape(3, 3, 8), cos, sin)
    values = qkv[:, 24:].clone()
    fused.rotary_embedding_(qkv, cos, sin, num_heads=2, num_kv_heads=1)
    assert torch.equal(qkv[:, :24].reshape(3, 3, 8), expected)
    assert torch.equal(qkv[:, 24:], values)


@pytest.mark.parametrize("vocab", [49152, 1003, 5])  # 1003: a tail after the 8-wide loop; 5: only the tail
def test_logsumexp_argmax_matches_torch(ops, vocab):
    x = _randn(9, vocab, scale=6.0)
    x[1, :] = 0.5  # all tied: the first index wins
    x[2, [vocab // 2, vocab - 1]] = 1e3  # tie between a lane and the tail
    x[3, 0] = 1e3  # the first element
    lse, ids = ops.logsumexp_argmax(x)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=1e-6, atol=1e-5)
    assert torch.equal(fused.logsumexp_argmax(x)[1], ids)
