"""gpt-oss's building blocks, each against transformers' own: the router (bias, top-k then
softmax), the MoE layer with clamped SwiGLU experts (whole and as two expert-parallel halves),
YaRN's frequencies and attention factor (gpt-oss's and DeepSeek's forms), and the attention
layer with biases, sinks and a sliding window."""

from __future__ import annotations

import functools

import pytest
import torch

from atom.layers.mlp import ClampedSwiGLUMLP, clamped_swiglu
from atom.layers.moe import ExpertShard, TopKSoftmaxMoE, topk_then_softmax
from atom.layers.rotary import YarnScaling, default_inv_freq, rotary_cos_sin, yarn_inv_freq
from tests.utils import assert_sums_close


def _gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    return GptOssConfig(**{**dict(hidden_size=32, intermediate_size=24, num_local_experts=6,
                                  num_experts_per_tok=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8), **overrides})


def _gpt_oss_mlp_and_ours(expert_shard=None):
    """transformers' GptOssMLP with random weights and biases, and our layer holding the same
    (gate/up columns de-interleaved into gate rows, then up rows)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    block = GptOssMLP(_gpt_oss_config()).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = TopKSoftmaxMoE(hidden_size=32, intermediate_size=24, num_experts=6, top_k=3,
                          expert_shard=expert_shard,
                          expert_class=functools.partial(ClampedSwiGLUMLP, limit=7.0,
                                                         alpha=1.702))
    ours.router.weight.data.copy_(block.router.weight)
    ours.router.bias.data.copy_(block.router.bias)
    experts = block.experts
    for i, expert in enumerate(ours.local_experts):
        e = ours.expert_start + i
        gate_up, bias = experts.gate_up_proj[e].T, experts.gate_up_proj_bias[e]
        expert.gate_up_proj.weight.data.copy_(torch.cat([gate_up[0::2], gate_up[1::2]]))
        expert.gate_up_proj.bias.data.copy_(torch.cat([bias[0::2], bias[1::2]]))
        expert.down_proj.weight.data.copy_(experts.down_proj[e].T)
        expert.down_proj.bias.data.copy_(experts.down_proj_bias[e])
    return block, ours


@torch.inference_mode()
def test_topk_then_softmax_matches_transformers_router():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    torch.manual_seed(0)
    router = GptOssTopKRouter(_gpt_oss_config())
    torch.nn.init.normal_(router.weight, std=0.5)
    torch.nn.init.normal_(router.bias, std=2.0)  # a bias large enough to change the choice
    x = torch.randn(11, 32)
    _, ref_gates, ref_ids = router(x)
    ids, gates = topk_then_softmax(torch.nn.functional.linear(x, router.weight, router.bias), 3)
    assert torch.equal(ids, ref_ids) and gates.dtype == torch.float32
    torch.testing.assert_close(gates, ref_gates, rtol=0, atol=1e-6)
    torch.testing.assert_close(gates.sum(-1), torch.ones(11))
    without_bias = topk_then_softmax(x @ router.weight.T, 3)[0]
    assert not torch.equal(without_bias, ids)


def test_clamped_swiglu_clamps_gate_above_and_up_both_sides():
    gate = torch.tensor([[-20.0, 0.5, 20.0]])
    up = torch.tensor([[-20.0, 0.5, 20.0]])
    out = clamped_swiglu(torch.cat([gate, up], dim=-1), limit=7.0, alpha=1.702)
    g = torch.tensor([-20.0, 0.5, 7.0])  # the gate is clamped from above only
    expected = (torch.tensor([-7.0, 0.5, 7.0]) + 1) * g * torch.sigmoid(1.702 * g)
    torch.testing.assert_close(out[0], expected)


@torch.inference_mode()
def test_moe_layer_matches_transformers_gpt_oss_mlp():
    block, ours = _gpt_oss_mlp_and_ours()
    x = torch.randn(9, 32)
    expected, _ = block(x[None])
    # float32 sums over the router's 32 inputs, the experts' 32 then 24, in two orders
    sums = 32 + 32 + 24
    assert_sums_close(ours(x), expected[0], reduction_len=sums, num_paths=2)
    # two expert-parallel halves (each its own experts, the shared router) sum to the layer
    halves = [_gpt_oss_mlp_and_ours(ExpertShard(rank, 2))[1] for rank in (0, 1)]
    assert [h.expert_start for h in halves] == [0, 3]
    assert_sums_close(sum(h(x) for h in halves), expected[0], reduction_len=sums, num_paths=2)


@pytest.mark.parametrize("rope", [
    # gpt-oss's published settings (truncate false), and a shorter original context
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),
    dict(factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=32),
    # truncate (transformers' default) and DeepSeek's mscale / mscale_all_dim
    dict(factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707,
         original_max_position_embeddings=4096),
])
def test_yarn_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _gpt_oss_config(head_dim=64, max_position_embeddings=131072,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                              **rope})
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    yarn = YarnScaling.from_rope_parameters(config.rope_parameters,
                                            max_position_embeddings=131072)
    inv_freq = yarn_inv_freq(head_dim=64, rope_theta=150000.0, yarn=yarn)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert yarn.resolved_attention_factor() == pytest.approx(ref_factor, rel=1e-12)
    assert not torch.allclose(inv_freq, default_inv_freq(head_dim=64, rope_theta=150000.0))
    cos, sin = rotary_cos_sin(head_dim=64, rope_theta=150000.0, max_positions=8,
                              inv_freq=inv_freq, attention_factor=ref_factor)
    angles = torch.arange(8.0)[:, None] * ref_inv_freq[None, :]
    torch.testing.assert_close(cos[:, :32], angles.cos() * ref_factor)
    torch.testing.assert_close(sin[:, 32:], angles.sin() * ref_factor)


def test_yarn_needs_the_original_context():
    with pytest.raises(ValueError, match="no original_max_position_embeddings"):
        YarnScaling.from_rope_parameters({"rope_type": "yarn", "factor": 4.0},
                                         max_position_embeddings=1024)
    implied = YarnScaling.from_rope_parameters(
        {"rope_type": "yarn", "original_max_position_embeddings": 256},
        max_position_embeddings=1024)
    assert implied.factor == 4.0  # none given: the ratio of the two contexts, as transformers


@torch.inference_mode()
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_attention_layer_matches_transformers(layer_type):
    """Our Attention (biases, sinks, window) on one 20-token prompt equals transformers'
    GptOssAttention with the mask transformers builds for that layer type (window 6)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import (GptOssAttention,
                                                              GptOssRotaryEmbedding)

    from atom.kernels.attention import AttentionMetadata
    from atom.layers.attention import Attention

    torch.manual_seed(0)
    config = _gpt_oss_config(sliding_window=6, layer_types=[layer_type],
                             num_hidden_layers=1)
    config._attn_implementation = "eager"
    block = GptOssAttention(config, layer_idx=0).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = Attention(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, bias=True,
                     sinks=True, sliding_window=6 if layer_type == "sliding_attention" else None)
    ours.qkv_proj.weight.data.copy_(torch.cat([block.q_proj.weight, block.k_proj.weight,
                                               block.v_proj.weight]))
    ours.qkv_proj.bias.data.copy_(torch.cat([block.q_proj.bias, block.k_proj.bias,
                                             block.v_proj.bias]))
    ours.o_proj.weight.data.copy_(block.o_proj.weight)
    ours.o_proj.bias.data.copy_(block.o_proj.bias)
    ours.sinks.data.copy_(block.sinks)
    ours.kv_cache = torch.zeros(2, 4, 8, 2, 8)  # 4 blocks of 8 tokens
    x = torch.randn(1, 20, 32)
    positions = torch.arange(20)[None]
    cos, sin = GptOssRotaryEmbedding(config)(x, positions)
    make_mask = (create_sliding_window_causal_mask if layer_type == "sliding_attention"
                 else create_causal_mask)
    mask = make_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None)
    expected, _ = block(x, (cos, sin), mask)
    meta = AttentionMetadata(slot_mapping=torch.arange(20), query_start_loc=[0, 20],
                             context_lens=[20], block_tables=torch.tensor([[0, 1, 2]]),
                             num_decodes=0, context_lens_tensor=torch.tensor([20]))
    out = ours(x[0], torch.cat([cos[0], cos[0]], -1), torch.cat([sin[0], sin[0]], -1), meta)
    # Outputs reach ~30 with these weights: transformers' float32 result is itself ~4e-5 from its
    # float64 one, and the compiled kernels sum in another order (they are ~2e-5 from it). Terms
    # per output: q/k/v projections (32), q . k (8), p . v (20 tokens), o projection (32).
    assert_sums_close(out, expected[0], reduction_len=32 + 8 + 20 + 32, num_paths=2)
