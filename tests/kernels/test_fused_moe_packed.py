"""The fused MoE experts on packed bfloat16 blocks (kernels/csrc/fused_moe_packed.cpp) against
float64 math, on both of its paths: oneDNN's brgemm (experts with more than
``max_small_tokens`` tokens: AMX tiles on a CPU with AMX, oneDNN's AVX-512 kernels on one
without) and the VDPBF16PS kernel (the others), alone and mixed in one call; the packing and
reading one expert's rows back; bad input refused.

Paths, by CPU: every AVX512-BF16 CPU (Zen 4/5, Cooper Lake, Sapphire Rapids on) runs both here;
brgemm takes its AMX kernels only where ``lscpu`` lists ``amx_bf16`` (the test names which it
ran). Builds without AVX512-BF16 (Skylake-SP, Ice Lake, AVX2-only CPUs) do not have the op: the
layer keeps ``fused_moe.cpp`` there and these tests skip, saying so."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.moe import (MAX_SMALL_TOKENS, amx_usable, fused_moe_packed,
                              fused_moe_reference, pack_experts)
from atom.layers.moe import PackedExpertRows

BIG = 1 << 30  # max_small_tokens that keeps every expert on the VDPBF16PS kernel


@pytest.fixture
def packed_ops(ops):
    if not ops.fused_moe_packed_is_available():
        pytest.skip("the packed MoE kernels need a build with AVX512-BF16 (this CPU has none)")
    return ops


def _case(tokens, hidden, inter, experts, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).bfloat16()
    ids = torch.randint(-1, experts + 1, (tokens, k), generator=gen)  # -1, E: another rank's
    gates = torch.rand(tokens, k, generator=gen)
    if tokens:
        ids[0] = experts  # the first token has no local slot: its row is 0
    return x, w13, w2, ids, gates


@pytest.mark.parametrize("max_small", [0, MAX_SMALL_TOKENS, BIG],
                         ids=["brgemm", "by_count", "vdpbf16ps"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [
    (1, 64, 32, 4, 2),       # one decode token
    (70, 96, 48, 3, 2),      # 40-50 tokens an expert: a full and a partial block of 32 tokens
    (33, 1024, 128, 8, 4),   # the benchmark's expert shape
    (0, 64, 32, 4, 2),       # an empty batch
])
def test_packed_experts_match_float64(packed_ops, max_small, tokens, hidden, inter, experts, k):
    x, w13, w2, ids, gates = _case(tokens, hidden, inter, experts, k)
    out = fused_moe_packed(x, *pack_experts(w13, w2), ids, gates, max_small_tokens=max_small)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = fused_moe_reference(x, w13, w2, ids, gates)
    # float32 sums; the bf16 activations and output give about 2^-8 of the largest values
    scale = max(1.0, float(ref.abs().max())) if tokens else 1.0
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1.5e-2 * scale,
                               msg=lambda m: f"{m}\n(AMX tiles: {amx_usable()})")
    assert not out[:1].any()


def test_one_call_mixes_both_paths_and_a_tokens_two_slots_sum_in_either_order(packed_ops):
    # expert 0 gets 12 tokens (brgemm), the others 1-2 (VDPBF16PS); k = 2 as EPLB's replicas
    x, w13, w2, _, gates = _case(12, 64, 32, 6, 2, seed=1)
    ids = torch.stack([torch.zeros(12, dtype=torch.long), torch.arange(12) % 5 + 1], dim=1)
    w13p, w2p = pack_experts(w13, w2)
    out = fused_moe_packed(x, w13p, w2p, ids, gates)
    assert torch.equal(out, fused_moe_packed(x, w13p, w2p, ids.flip(1), gates.flip(1)))
    ref = fused_moe_reference(x, w13, w2, ids, gates)
    torch.testing.assert_close(out.double(), ref, rtol=0,
                               atol=1.5e-2 * max(1.0, float(ref.abs().max())))


def test_packing_keeps_every_weight_and_reads_each_experts_rows_back():
    _, w13, w2, _, _ = _case(0, 64, 48, 3, 2)
    w13p, w2p = pack_experts(w13, w2)
    assert w13p.shape == (3, 3, 32, 32, 2) and w2p.shape == (3, 2, 24, 32, 2)
    # VNNI pairs: block j's column c < 16 is gate row 16j + c, its k-th weight at [k // 2][c][k % 2]
    assert w13p[1, 2, 5, 3, 1] == w13[1, 16 * 2 + 3, 11]
    assert w13p[1, 2, 5, 16 + 3, 0] == w13[1, 48 + 16 * 2 + 3, 10]
    assert w2p[2, 1, 7, 4, 1] == w2[2, 32 + 4, 15]
    for e in range(3):
        assert torch.equal(PackedExpertRows(w13p, e, gate_up=True).to_dense(), w13[e])
        assert torch.equal(PackedExpertRows(w2p, e, gate_up=False).to_dense(), w2[e])
    with pytest.raises(ValueError, match="hidden_size % 32"):
        pack_experts(w13[:, :, :48], w2[:, :48])


def test_bad_input_is_refused(packed_ops):
    x, w13, w2, ids, gates = _case(3, 64, 32, 4, 2)
    w13p, w2p = pack_experts(w13, w2)
    with pytest.raises(RuntimeError, match="do not fit"):
        fused_moe_packed(x[:, :32].contiguous(), w13p, w2p, ids, gates)
    with pytest.raises(RuntimeError, match="bfloat16"):
        fused_moe_packed(x.float(), w13p, w2p, ids, gates)
    with pytest.raises(RuntimeError, match="pack_experts"):
        fused_moe_packed(x, w13, w2, ids, gates)
