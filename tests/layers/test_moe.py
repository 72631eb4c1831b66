"""The MoE layer on one rank: the split-MLP model (a) equals the dense MLP, each routing function
equals transformers' router (Mixtral's; Qwen3-MoE's with and without ``norm_topk_prob``), the
MoE layer equals transformers' Mixtral and Qwen3-MoE blocks (the latter as two expert-parallel
halves), sharded experts sum to the whole layer, and a tiny random Mixtral (model (b)) generates what
transformers generates, with and without two-batch overlap."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.kernels.moe import fused_moe_applies
from atom.layers.moe import (ExpertShard, MoE, expert_range, moe_from_dense_mlp, softmax_topk,
                             unit_routing)
from tests.moe_utils import assert_logprobs_close, build_tiny_mixtral, tiny_prompts
from tests.utils import assert_sums_close, check_greedy_close, hf_greedy, ours_greedy


def test_split_mlp_equals_the_dense_mlp():
    torch.manual_seed(0)
    hidden, inter = 32, 48
    gate_up, down = torch.randn(2 * inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(5, hidden)
    gate, up = (x @ gate_up.T).split(inter, dim=-1)
    dense = (torch.nn.functional.silu(gate) * up) @ down.T
    for num_experts in (1, 4, 6):
        moe = moe_from_dense_mlp(gate_up, down, num_experts)
        assert_sums_close(moe(x), dense, reduction_len=hidden + inter, num_paths=2)
    with pytest.raises(ValueError, match="divisor of 48"):
        moe_from_dense_mlp(gate_up, down, 5)


def _mixtral_block_and_ours():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=40, num_local_experts=6,
                           num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(hidden_size=32, intermediate_size=40, num_experts=6, top_k=2)
    ours.router.weight.data.copy_(block.gate.weight)
    ours.set_expert_weights(block.experts.gate_up_proj, block.experts.down_proj)
    return block, ours


@torch.inference_mode()
def test_softmax_top_k_routing_matches_transformers_mixtral_block():
    block, ours = _mixtral_block_and_ours()
    x = torch.randn(9, 32)
    # float32 sums over the router's 32 inputs, the experts' 32 then 40, in two orders
    assert_sums_close(ours(x), block(x[None])[0], reduction_len=32 + 32 + 40, num_paths=2)


def _qwen3_moe_config(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6,
                          num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)


@torch.inference_mode()
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_topk_matches_transformers_qwen3_moe_router(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(_qwen3_moe_config(norm_topk_prob))
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(11, 32)
    _, ref_gates, ref_ids = router(x)
    ids, gates = softmax_topk(x @ router.weight.T, 3, renormalize=norm_topk_prob)
    assert torch.equal(ids, ref_ids) and gates.dtype == torch.float32
    torch.testing.assert_close(gates, ref_gates.float(), rtol=0, atol=1e-6)
    assert torch.allclose(gates.sum(-1), torch.ones(11)) == norm_topk_prob


@torch.inference_mode()
def test_softmax_topk_matches_transformers_mixtral_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    torch.manual_seed(0)
    router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=6,
                                             num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(11, 32)
    _, ref_gates, ref_ids = router(x)
    ids, gates = softmax_topk(x @ router.weight.T, 2, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(gates, ref_gates, rtol=0, atol=1e-6)


def test_unit_routing_sends_every_token_to_the_first_k_experts():
    ids, gates = unit_routing(3, 4)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3 and gates.tolist() == [[1.0] * 4] * 3


@torch.inference_mode()
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_layer_matches_transformers_qwen3_moe_block(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(_qwen3_moe_config(norm_topk_prob)).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(9, 32)
    ref = block(x[None])[0]
    whole = torch.zeros_like(ref)
    for rank in range(2):  # the two halves of expert parallelism sum to the layer
        ours = MoE(hidden_size=32, intermediate_size=24, num_experts=6, top_k=3,
                   renormalize=norm_topk_prob, expert_shard=ExpertShard(rank, 2))
        start, end = expert_range(6, rank, 2)
        ours.router.weight.data.copy_(block.gate.weight)
        ours.set_expert_weights(block.experts.gate_up_proj[start:end],
                                block.experts.down_proj[start:end])
        ids, gates = ours.route(x)
        whole += ours.experts(x, ids, gates)
    # float32 sums over the router's 32 inputs, the experts' 32 then 24, in two orders
    assert_sums_close(whole, ref, reduction_len=32 + 32 + 24, num_paths=2)


@torch.inference_mode()
def test_sharded_experts_sum_to_the_whole_layer():
    _, whole = _mixtral_block_and_ours()
    x = torch.randn(7, 32)
    ids, gates = whole.route(x)
    parts = []
    for start, end in ((0, 2), (2, 6)):
        _, shard = _mixtral_block_and_ours()
        shard.shard_experts(start, end)
        assert shard.num_local_experts == end - start
        parts.append(shard.experts(x, ids, gates))
    assert_sums_close(parts[0] + parts[1], whole(x), reduction_len=32 + 40, num_paths=2)
    with pytest.raises(ValueError, match="not within"):
        shard.shard_experts(0, 2)


@torch.inference_mode()
def test_fused_experts_equal_the_per_expert_modules_and_hold_the_weights_once():
    if not fused_moe_applies(torch.float32):
        pytest.skip("the fused MoE kernel runs on AVX-512 builds only")
    _, ours = _mixtral_block_and_ours()
    x = torch.randn(11, 32)
    ids, gates = ours.route(x)
    unfused = ours.experts(x, ids, gates)
    assert ours.fuse_experts()
    # the fused kernel's sums over 32 then 40 against the per-expert oneDNN GEMMs'
    assert_sums_close(ours.experts(x, ids, gates), unfused, reduction_len=32 + 40, num_paths=2)
    w13 = ours.fused_experts.w13
    for i, expert in enumerate(ours.local_experts):  # views of the stacked rows, not copies
        assert expert.gate_up_proj.weight.data_ptr() == w13[i].data_ptr()
        assert expert.down_proj.weight.data_ptr() == ours.fused_experts.w2[i].data_ptr()
    ours.shard_experts(2, 6)  # a later shard stacks the kept experts again
    assert ours.fused_experts.w13.shape[0] == 4
    _, shard = _mixtral_block_and_ours()
    shard.shard_experts(2, 6)
    assert_sums_close(ours.experts(x, ids, gates), shard.experts(x, ids, gates),
                      reduction_len=32 + 40, num_paths=2)


def test_tiny_mixtral_matches_transformers(tmp_path):
    """One rank, unsplit (TBO needs expert parallelism: its micro-batches, batched and one
    prompt alone, are checked on two ranks in tests/dp/test_dp_moe.py)."""
    model = build_tiny_mixtral(tmp_path)
    prompts = tiny_prompts()
    reference = hf_greedy(model, prompts, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
    with LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
             max_model_len=256) as llm:
        ours = ours_greedy(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    check_greedy_close(ours, reference, name="tiny mixtral, one rank")
    assert_logprobs_close(ours, reference)


@torch.inference_mode()
def test_bfloat16_experts_run_packed_where_the_kernels_have_avx512_bf16_and_hold_weights_once():
    from atom.kernels.moe import packed_layout_applies
    if not packed_layout_applies(torch.bfloat16, 64, 32):
        pytest.skip("packed experts need a kernels build with AVX512-BF16 (this CPU has none)")
    torch.manual_seed(0)
    ours = MoE(hidden_size=64, intermediate_size=32, num_experts=6, top_k=2).bfloat16()
    for p in ours.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).mul(0.2))
    rows = [(e.gate_up_proj.dense_weight().clone(), e.down_proj.dense_weight().clone())
            for e in ours.local_experts]
    x = torch.randn(24, 64).bfloat16()
    ids, gates = ours.route(x)
    unfused = ours.experts(x, ids, gates)
    assert ours.fuse_experts() and ours.fused_experts.packed
    out = ours.experts(x, ids, gates)
    torch.testing.assert_close(out.double(), unfused.double(), rtol=0,
                               atol=1.5e-2 * float(unfused.abs().max()))
    for (gate_up, down), expert in zip(rows, ours.local_experts):  # read back from the blocks
        assert expert.gate_up_proj.weight is None and expert.down_proj.weight is None
        assert torch.equal(expert.gate_up_proj.dense_weight(), gate_up)
        assert torch.equal(expert.down_proj.dense_weight(), down)
    ours.shard_experts(2, 6)  # a later shard packs the kept experts again
    assert ours.fused_experts.w13.shape[0] == 4
    assert torch.equal(ours.local_experts[0].down_proj.dense_weight(), rows[2][1])
