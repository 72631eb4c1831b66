"""oneDNN packed linear weights and the small-weight kernel (atom.kernels.linear), and the model's
Linear that uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.linear import (SMALL_LINEAR_MAX_ROWS, SMALL_WEIGHT_BYTES, pack_weight,
                                 packed_linear, small_linear, small_linear_max_rows)
from atom.layers.linear import Linear
from tests.utils import assert_sums_close

gen = torch.Generator().manual_seed(0)
weight = torch.randn(96, 40, generator=gen)
packed = pack_weight(weight)
needs_onednn = pytest.mark.skipif(packed is None, reason="oneDNN cannot pack weights here")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    x = torch.randn(rows, 40, generator=gen)
    out = packed_linear(x, packed)
    assert out.shape == (rows, 96)
    assert_sums_close(out, F.linear(x, weight), reduction_len=40, num_paths=2)  # MKL, oneDNN


@needs_onednn
def test_packed_linear_takes_strided_and_batched_inputs():
    x = torch.randn(7, 80, generator=gen)[:, ::2]  # non-contiguous rows
    assert_sums_close(packed_linear(x, packed), F.linear(x, weight), reduction_len=40,
                      num_paths=2)
    x3 = torch.randn(2, 5, 40, generator=gen)
    assert_sums_close(packed_linear(x3, packed), F.linear(x3, weight), reduction_len=40,
                      num_paths=2)


@needs_onednn
def test_a_large_weight_runs_one_row_on_the_small_kernel_and_more_on_onednn():
    layer = Linear(256, 300)  # 300 KB: above SMALL_WEIGHT_BYTES
    layer.weight.data.copy_(torch.randn(300, 256, generator=gen))
    x = torch.randn(9, 256, generator=gen)
    before = layer(x)
    layer.pack_weight()
    assert layer.packed_weight is not None
    # MKL's sums against oneDNN's, whose order differs by CPU (AMX-era kernels: issue 49)
    assert_sums_close(layer(x), before, reduction_len=256, num_paths=2)
    if small_linear_max_rows(layer.packed_weight.to_dense()) == 0:  # no AVX-512 kernel here
        assert layer.weight is None and layer.small_rows == 0
    else:  # both forms kept; one row takes the kernel, two the packed GEMM
        assert layer.weight is not None and layer.small_rows == 1
        assert torch.equal(layer(x[:1]), small_linear(x[:1], layer.weight))
        assert torch.equal(layer(x[:2]), packed_linear(x[:2], layer.packed_weight))
    layer.pack_weight()  # a second call is a no-op


@needs_onednn
@pytest.mark.parametrize("out_features", [8, 300])  # small_rows 16 and 1 where the kernel runs
@pytest.mark.parametrize("kernel", [True, False])
def test_a_packed_linear_takes_zero_rows(out_features, kernel, monkeypatch):
    # a TBO half that samples nothing hands the LM head zero rows; on a CPU without the
    # small-linear kernel (small_rows 0) those rows once went to it, with no plain weight kept
    if not kernel:
        monkeypatch.setattr("atom.layers.linear.small_linear_max_rows", lambda weight: 0)
    layer = Linear(256, out_features)
    layer.weight.data.copy_(torch.randn(out_features, 256, generator=gen))
    layer.pack_weight()
    assert (layer.small_rows == 0) == (layer.weight is None)
    assert layer(torch.randn(0, 256, generator=gen)).shape == (0, out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_float64(ops, dtype, rows, bias):
    # 37 columns of weight (4 blocks of 8 + 5), 70 inputs (a vector tail in both dtypes)
    w = torch.randn(37, 70, generator=gen).to(dtype)
    b = torch.randn(37, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 70, generator=gen).to(dtype)
    out = small_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, 37)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert_sums_close(out, exact, reduction_len=70 + bias)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        small_linear(x, w.double(), None)


@needs_onednn
def test_a_small_weight_keeps_both_forms_and_few_rows_take_the_small_kernel(ops):
    layer = Linear(40, 96)  # 15 KB
    layer.weight.data.copy_(weight)
    if small_linear_max_rows(layer.weight) == 0:
        pytest.skip("the small-linear kernel runs on AVX-512 builds only")
    assert layer.weight.numel() * 4 <= SMALL_WEIGHT_BYTES
    layer.pack_weight()
    assert layer.weight is not None and layer.packed_weight is not None
    for rows in (1, SMALL_LINEAR_MAX_ROWS, SMALL_LINEAR_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 40, generator=gen)
        expected = (small_linear(x, weight) if rows <= SMALL_LINEAR_MAX_ROWS
                    else packed_linear(x, layer.packed_weight))
        assert torch.equal(layer(x), expected)


def test_weights_that_cannot_be_packed_stay_dense():
    assert pack_weight(torch.randn(4, 3, 2)) is None  # not a matrix
    layer = Linear(3, 4)
    layer.weight.data.copy_(torch.randn(4, 3, generator=gen))
    if pack_weight(layer.weight.bfloat16()) is None:  # no native bf16 GEMMs on this CPU
        layer = layer.bfloat16()
        layer.pack_weight()
        assert layer.weight is not None and layer.packed_weight is None
