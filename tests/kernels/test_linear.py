"""oneDNN packed linear weights (atom.kernels.linear) and the model's Linear that uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.linear import pack_weight, packed_linear
from atom.layers.linear import Linear

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
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_takes_strided_and_batched_inputs():
    x = torch.randn(7, 80, generator=gen)[:, ::2]  # non-contiguous rows
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 40, generator=gen)
    torch.testing.assert_close(packed_linear(x3, packed), F.linear(x3, weight), rtol=1e-5,
                               atol=1e-5)


@needs_onednn
def test_linear_module_drops_dense_weight_after_packing():
    layer = Linear(40, 96)
    layer.weight.data.copy_(weight)
    x = torch.randn(9, 40, generator=gen)
    before = layer(x)
    layer.pack_weight()
    assert layer.weight is None and layer.packed_weight is not None
    torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)
    layer.pack_weight()  # a second call is a no-op


def test_weights_that_cannot_be_packed_stay_dense():
    assert pack_weight(torch.randn(4, 3, 2)) is None  # not a matrix
    layer = Linear(3, 4)
    layer.weight.data.copy_(torch.randn(4, 3, generator=gen))
    if pack_weight(layer.weight.bfloat16()) is None:  # no native bf16 GEMMs on this CPU
        layer = layer.bfloat16()
        layer.pack_weight()
        assert layer.weight is not None and layer.packed_weight is None
