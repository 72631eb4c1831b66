"""The fused elementwise kernels (kernels/csrc/fused_ops.cpp) against their torch references
(float32) and float64 math (bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import fused
from tests.utils import assert_sums_close

# Tests of the compiled kernels take the `ops` fixture (conftest.py): a kernel that did not build
# fails them.


def _randn(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("n", [576, 13])  # 13: the scalar tail after the 8-wide loop
@pytest.mark.parametrize("rows", [1, 70])
def test_rms_norm_matches_reference(ops, n, rows):
    x, w = _randn(rows, n, scale=3.0), _randn(n, seed=1)
    # float32 sums of squares over n in two orders (the kernel's, torch's)
    assert_sums_close(ops.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5),
                      reduction_len=n, num_paths=2)


def test_fused_add_rms_norm_updates_residual_in_place(ops):
    x, residual, w = _randn(33, 576), _randn(33, 576, seed=2), _randn(576, seed=3)
    expected_sum = residual + x
    expected = fused.rms_norm_reference(expected_sum, w, 1e-5)
    out = fused.rms_norm(x, w, 1e-5, residual=residual)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    assert_sums_close(out, expected, reduction_len=576, num_paths=2)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_with_qk_norm_equals_norm_then_rotary(ops, dtype):
    # Qwen3's QK-norm in the rotary's call: the same values as the two kernels one after the other
    num_heads, num_kv_heads, rows, head_dim = 8, 2, 5, 64
    qkv = _randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, scale=3.0).to(dtype)
    cos, sin = _randn(rows, head_dim, seed=4).to(dtype), _randn(rows, head_dim, seed=5).to(dtype)
    q_norm, k_norm = _randn(head_dim, seed=6).to(dtype), _randn(head_dim, seed=7).to(dtype)
    expected = qkv.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    for weight, lo, hi in ((q_norm, 0, q_size), (k_norm, q_size, q_size + kv_size)):
        part = expected[:, lo:hi]
        part.copy_(ops.rms_norm(part.reshape(-1, head_dim), weight, 1e-6).view(rows, -1))
    ops.rotary_embedding_(expected, cos, sin, num_heads, num_kv_heads)
    fused.rotary_embedding_(qkv, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            q_norm=q_norm, k_norm=k_norm, eps=1e-6)
    assert torch.equal(qkv, expected)
    with pytest.raises(RuntimeError, match="both q_norm and k_norm"):
        ops.rotary_embedding_(qkv, cos, sin, num_heads, num_kv_heads, q_norm, None, 1e-6)


def test_kernels_reject_wrong_dtype_and_shape(ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(_randn(2, 8).double(), _randn(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops.rms_norm(_randn(2, 8).bfloat16(), _randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_and_mul(_randn(2, 7))
    with pytest.raises(RuntimeError, match=r"\(H \+ 2 H_kv\) \* D"):
        ops.rotary_embedding_(_randn(2, 100), _randn(2, 8), _randn(2, 8), 2, 1)


# bfloat16 kernels against float64 math on the same bf16 inputs. A kernel computes in float32
# and rounds each output once (at most half a bf16 ulp: 2^-9 relative); the torch reference
# rounds after every op. Tolerance: rtol 2^-8 (one rounding plus float32 sums), atol 1e-6; the
# kernel must also be no farther from float64 than the reference, summed over all elements.
BF16_TOLERANCE = dict(rtol=2**-8, atol=1e-6)


def _check_bf16(out: torch.Tensor, exact: torch.Tensor, reference: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, **BF16_TOLERANCE)
    assert (out.double() - exact).abs().sum() <= (reference.double() - exact).abs().sum()


def _rms_norm_exact(x, w, eps):
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("n", [576, 13])
@pytest.mark.parametrize("rows", [1, 70])
def test_rms_norm_bf16_matches_float64(ops, n, rows):
    x, w = _randn(rows, n, scale=3.0).bfloat16(), _randn(n, seed=1).bfloat16()
    out = fused.rms_norm(x, w, 1e-5)
    assert torch.equal(out, ops.rms_norm(x, w, 1e-5))  # the wrapper runs the kernel
    _check_bf16(out, _rms_norm_exact(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("n", [576, 13])
def test_fused_add_rms_norm_bf16_matches_float64(ops, n):
    x, residual, w = (_randn(33, n, seed=2).bfloat16(), _randn(33, n, seed=3).bfloat16(),
                      _randn(n, seed=4).bfloat16())
    expected_sum = residual + x  # bf16: rounded once, as the kernel stores it
    out = fused.rms_norm(x, w, 1e-5, residual=residual)
    assert torch.equal(residual, expected_sum)
    _check_bf16(out, _rms_norm_exact(expected_sum, w, 1e-5),
                fused.rms_norm_reference(expected_sum, w, 1e-5))


@pytest.mark.parametrize("n", [1536, 13])
def test_silu_and_mul_bf16_matches_float64(ops, n):
    x = _randn(40, 2 * n, scale=4.0).bfloat16()
    out = fused.silu_and_mul(x)
    assert torch.equal(out, ops.silu_and_mul(x))
    gate, up = x.double().chunk(2, dim=-1)
    ref_gate, ref_up = x.chunk(2, dim=-1)
    _check_bf16(out, F.silu(gate) * up, F.silu(ref_gate) * ref_up)


@pytest.mark.parametrize("head_dim", [64, 12])
def test_rotary_embedding_bf16_matches_float64(ops, head_dim):
    num_heads, num_kv_heads, rows = 9, 3, 21
    qkv = _randn(rows, (num_heads + 2 * num_kv_heads) * head_dim).bfloat16()
    cos, sin = _randn(rows, head_dim, seed=4).bfloat16(), _randn(rows, head_dim, seed=5).bfloat16()
    qk_size = (num_heads + num_kv_heads) * head_dim
    heads = qkv[:, :qk_size].reshape(rows, num_heads + num_kv_heads, head_dim)
    exact = fused.apply_rotary_reference(heads.double(), cos.double(), sin.double())
    reference = fused.apply_rotary_reference(heads, cos, sin)
    values = qkv[:, qk_size:].clone()
    fused.rotary_embedding_(qkv, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads)
    _check_bf16(qkv[:, :qk_size].reshape_as(exact), exact, reference)
    assert torch.equal(qkv[:, qk_size:], values)  # values are not rotated


def test_other_dtypes_take_the_torch_path():
    """float16 has no kernel: the references run."""
    x, w = _randn(5, 64).half(), _randn(64, seed=1).half()
    assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5))
    gu = _randn(5, 32).half()
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(fused.silu_and_mul(gu), F.silu(gate) * up)
    # QK-norm then rotary: each head normalized by the reference, then rotated by it
    qkv, cos, sin = _randn(3, 4 * 16).half(), _randn(3, 16, seed=2).half(), _randn(3, 16, seed=3).half()
    q_norm, k_norm = _randn(16, seed=4).half(), _randn(16, seed=5).half()
    heads = qkv[:, :3 * 16].reshape(3, 3, 16).clone()
    heads[:, :2] = fused.rms_norm_reference(heads[:, :2], q_norm, 1e-6)
    heads[:, 2:] = fused.rms_norm_reference(heads[:, 2:], k_norm, 1e-6)
    fused.rotary_embedding_(qkv, cos, sin, num_heads=2, num_kv_heads=1, q_norm=q_norm,
                            k_norm=k_norm, eps=1e-6)
    assert torch.equal(qkv[:, :3 * 16].reshape(3, 3, 16), fused.apply_rotary_reference(heads, cos, sin))


@pytest.mark.parametrize("vocab", [49152, 1003, 5])  # 1003: a tail after the 8-wide loop; 5: only the tail
def test_logsumexp_argmax_matches_torch(ops, vocab):
    x = _randn(9, vocab, scale=6.0)
    x[1, :] = 0.5  # all tied: the first index wins
    x[2, [vocab // 2, vocab - 1]] = 1e3  # tie between a lane and the tail
    x[3, 0] = 1e3  # the first element
    lse, ids = ops.logsumexp_argmax(x)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, x.argmax(dim=-1))
    # a sum of vocab positive terms, each side off by a relative error; in the log that is an
    # absolute error of the same size (magnitude 1)
    assert_sums_close(lse, torch.logsumexp(x, dim=-1), reduction_len=vocab, num_paths=2,
                      magnitude=1.0)
    assert torch.equal(fused.logsumexp_argmax(x)[1], ids)
