"""The fused MoE experts kernel (kernels/csrc/fused_moe.cpp) against float64 math: shapes with
tails (hidden and intermediate sizes that are not multiples of the vector width or of the row
blocks, an odd token count per expert), slots of other ranks' experts, tokens with no local
slot, no tokens at all; the order of a token's two slots does not change its sum; bad input is
refused.

Paths (dot_block.h), by CPU: the native build runs VDPBF16PS for bfloat16 and float32 FMAs on
an AVX512-BF16 CPU (Zen 4/5, Sapphire Rapids on), float32 FMAs for both dtypes on AVX-512
without BF16, the scalar loop on AVX2-only CPUs (Zen 3). The other CPUs' paths run here too, in
builds with fewer extensions (``isa_variants.py``: ``no_avx512bf16``, ``scalar``)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.moe import fused_moe, fused_moe_reference
from tests.kernels import isa_variants
from tests.utils import assert_sums_close

# Tests of the compiled kernels take the `ops` fixture (conftest.py): a kernel that did not build
# fails them.


def _case(tokens, hidden, inter, experts, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    ids = torch.randint(-1, experts + 1, (tokens, k), generator=gen)  # -1, E: another rank's
    gates = torch.rand(tokens, k, generator=gen)
    return x, w13, w2, ids, gates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [
    (1, 64, 32, 4, 2),      # one decode token
    (7, 70, 23, 6, 3),      # tails: 70 = 64 + 6 lanes, 23 columns = 5 blocks of 4 + 3
    (33, 1024, 128, 8, 4),  # the benchmark's expert shape, several tokens an expert
    (0, 64, 32, 4, 2),      # an empty batch
])
def test_fused_moe_matches_float64(ops, dtype, tokens, hidden, inter, experts, k):
    _check_against_float64(fused_moe, _case(tokens, hidden, inter, experts, k, dtype))


@pytest.mark.parametrize("variant", sorted(isa_variants.VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [(7, 70, 23, 6, 3), (9, 256, 64, 4, 2)])
def test_other_cpus_paths_match_float64(isa_variant, variant, dtype, tokens, hidden, inter,
                                        experts, k):
    """The AVX-512-without-BF16 and scalar builds (isa_variants.py), shapes with tails."""
    variant_ops = isa_variant(variant)
    _check_against_float64(variant_ops.fused_moe, _case(tokens, hidden, inter, experts, k, dtype))


@pytest.mark.parametrize("variant", sorted(isa_variants.VARIANTS))
def test_a_variant_registers_the_main_librarys_schemas(isa_variant, variant):
    # isa_variant_bindings.cpp repeats bindings.cpp's two schemas: they must not drift apart
    variant_ops = isa_variant(variant)
    namespace = isa_variants.VARIANTS[variant].variant.name
    for name in ("fused_moe", "paged_decode_attention"):
        schema = str(getattr(variant_ops, name).default._schema)
        assert schema.replace(f"{namespace}::", "atom_kernels::") == str(
            getattr(torch.ops.atom_kernels, name).default._schema)


def _check_against_float64(run, case) -> None:
    x, w13, w2, ids, gates = case
    ids[:1] = w13.shape[0]  # the first token has no local slot: its row is 0
    out = run(x, w13, w2, ids, gates)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref = fused_moe_reference(x, w13, w2, ids, gates)
    if x.dtype == torch.float32:  # sums over H (gate/up), then I (down)
        assert_sums_close(out, ref, reduction_len=x.shape[1] + w2.shape[2])
    else:  # the bf16 activations and output: about 2^-8 of the largest values
        scale = max(1.0, float(ref.abs().max())) if len(x) else 1.0
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1.5e-2 * scale)
    assert not out[:1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_two_slots_sum_the_same_in_either_order(ops, dtype):
    # what keeps outputs bit-identical when EPLB moves experts between slots (k = 2)
    x, w13, w2, _, gates = _case(9, 96, 40, 6, 2, dtype, seed=1)
    ids = torch.stack([torch.arange(9) % 6, (torch.arange(9) + 1) % 6], dim=1)
    assert torch.equal(fused_moe(x, w13, w2, ids, gates),
                       fused_moe(x, w13, w2, ids.flip(1), gates.flip(1)))


def test_bad_input_is_refused(ops):
    x, w13, w2, ids, gates = _case(3, 64, 32, 4, 2, torch.float32)
    with pytest.raises(RuntimeError, match="do not fit"):
        fused_moe(x, w13, w2[:, :, :16].contiguous(), ids, gates)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        fused_moe(x, w13.bfloat16(), w2, ids, gates)
    with pytest.raises(RuntimeError, match="int64"):
        fused_moe(x, w13, w2, ids.int(), gates)
