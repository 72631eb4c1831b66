"""DeepSeek-V2 and DeepSeek-V3 against transformers on one rank (fp32), and the latent KV cache.

Tiny random models built by transformers (tests/moe_utils.py: large init scale, random norms, a
random non-zero ``e_score_correction_bias``, ``n_group`` 4 > ``topk_group`` 2 > 1, a shared
expert, a dense first layer, ``q_lora_rank`` set for V3 and null for V2, ``v_head_dim`` !=
``qk_nope + qk_rope``):

- the model runner's logits equal transformers' (prompt logits, decodes through the absorbed
  latent path, a chunked prompt in a mixed batch), with YaRN too;
- the engine's greedy tokens and top-5 logprobs equal transformers' (tie-aware), with chunked
  prefill, preemption and prefix-cache hits (tests/moe_utils.py check_engine_parity);
- the routing functions equal transformers' routers on random logits;
- the KV cache is the latent (``kv_lora_rank + qk_rope_head_dim`` per token and layer): 576 for
  DeepSeek-V3's real dimensions, and the pool holds budget / latent bytes per token tokens;
- multi-token-prediction layers in a checkpoint are ignored; FP8 checkpoints are refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from atom.kv_cache_spec import KVCacheSpec
from atom.models.deepseek import DeepSeekMoE, noaux_tc_topk, softmax_group_topk
from atom.worker.model_loader import arch_config_from_hf, load_model_weights
from atom.worker.model_runner import ModelRunner
from tests.models.runner_parity import (BlockPool, check_prefill_then_decode,
                                        check_runner_matches_transformers, fp32_runner,
                                        random_tokens, seq_of)
from tests.moe_utils import (DEEPSEEK_V3, build_tiny_deepseek, check_engine_parity,
                             engine_parity_prompts, parity_engine)

LATENT = DEEPSEEK_V3["kv_lora_rank"] + DEEPSEEK_V3["qk_rope_head_dim"]  # 40 values per token


@pytest.fixture(scope="module", params=[True, False], ids=["deepseek_v3", "deepseek_v2"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v3" if request.param else "deepseek-v2")
    return folder, build_tiny_deepseek(folder, v3=request.param)


def test_runner_logits_match_transformers(family):
    folder, hf_model = family
    runner = fp32_runner(folder)
    layers = runner.model.layers
    assert [isinstance(layer.mlp, DeepSeekMoE) for layer in layers] == [False, True, True]
    moe = layers[1].mlp
    assert moe.shared_experts is not None
    assert (moe.e_score_correction_bias is not None) == (hf_model.config.model_type ==
                                                         "deepseek_v3")
    assert (layers[0].self_attn.q_lora_rank is None) == (hf_model.config.q_lora_rank is None)
    check_runner_matches_transformers(runner, hf_model, vocab=512)


def test_yarn_runner_logits_match_transformers(tmp_path):
    """YaRN over the rotary dims (DeepSeek's mscale / mscale_all_dim: the cos/sin factor and
    the softmax scale's mscale squared), past the original context of 16 positions."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}
    hf_model = build_tiny_deepseek(tmp_path, rope_parameters=yarn, max_position_embeddings=64)
    runner = fp32_runner(tmp_path)
    assert runner.model.layers[0].self_attn.scale == pytest.approx(
        hf_model.model.layers[0].self_attn.scaling) != 24 ** -0.5
    check_prefill_then_decode(runner, hf_model, random_tokens(40, 512, seed=5))


def test_kv_cache_is_the_latent(family):
    folder, _ = family
    config, _ = load_model_weights(str(folder), torch.float32)
    assert ModelRunner.kv_cache_specs_of(config) == [
        KVCacheSpec(num_kv_heads=1, head_dim=LATENT, latent=True)] * 3
    # one array per token (no separate K and V): layers x block_size x 40 values x 2 bytes
    assert ModelRunner.kv_cache_bytes_per_block(config, dtype=torch.bfloat16, block_size=16) == (
        3 * 16 * LATENT * 2)


def test_deepseek_v3_real_dimensions_cache_576_values_per_token_per_layer():
    # DeepSeek-V3's config.json (the fields the cache and the families read)
    real = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                routed_scaling_factor=2.5, num_nextn_predict_layers=1, rope_theta=10000,
                max_position_embeddings=163840,
                rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1,
                                  mscale=1.0, mscale_all_dim=1.0,
                                  original_max_position_embeddings=4096))
    config = arch_config_from_hf(real)
    specs = ModelRunner.kv_cache_specs_of(config)
    assert len(specs) == 61 and {s.values_per_token() for s in specs} == {576}
    assert ModelRunner.kv_cache_bytes_per_block(config, dtype=torch.bfloat16, block_size=1) == (
        61 * 576 * 2)  # 70,272 bytes per token (expanded K/V of 128 heads: 61 x 128 x 320 x 2)
    # YaRN's mscale enters the softmax scale squared: (0.1 ln 40 + 1)^2 / sqrt(192)
    assert config.family.softmax_scale() == pytest.approx(
        (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2 / 192 ** 0.5)


def test_routing_matches_transformers():
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen)
    settings = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
                    n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                    topk_group=2, routed_scaling_factor=2.5)
    for v3, renormalize in ((True, True), (True, False), (False, False)):
        if v3:
            router = DeepseekV3TopkRouter(DeepseekV3Config(**settings,
                                                           norm_topk_prob=renormalize))
            router.e_score_correction_bias.copy_(torch.rand(16, generator=gen))
        else:
            router = DeepseekV2TopkRouter(DeepseekV2Config(**settings,
                                                           topk_method="group_limited_greedy"))
        with torch.no_grad():
            router.weight.copy_(torch.randn(16, 16, generator=gen))
            _, ref_gates, ref_ids = router(x)
        logits = x @ router.weight.T
        if v3:
            ids, gates = noaux_tc_topk(logits, router.e_score_correction_bias, top_k=3,
                                       n_group=4, topk_group=2, renormalize=renormalize,
                                       scaling_factor=2.5)
        else:
            ids, gates = softmax_group_topk(logits, top_k=3, n_group=4, topk_group=2,
                                            grouped=True, renormalize=False, scaling_factor=2.5)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        torch.testing.assert_close(gates.gather(1, order), ref_gates.gather(1, ref_order))
    # no tokens (a dummy step's micro-batch): empty ids and gates, no error
    for ids, gates in (noaux_tc_topk(torch.zeros(0, 16), torch.zeros(16), top_k=3, n_group=4,
                                     topk_group=2, renormalize=True, scaling_factor=2.5),
                       softmax_group_topk(torch.zeros(0, 16), top_k=3, n_group=4, topk_group=2,
                                          grouped=True, renormalize=False, scaling_factor=1.0)):
        assert ids.shape == gates.shape == (0, 3)
    # the correction bias changes the choice, never the gates' source (unbiased scores)
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, 1, 1])
    ids, gates = noaux_tc_topk(logits, bias, top_k=2, n_group=1, topk_group=1,
                               renormalize=False, scaling_factor=1.0)
    assert sorted(ids[0].tolist()) == [6, 7] and torch.allclose(gates, torch.full((1, 2), 0.5))


@pytest.fixture(scope="module")
def engine(family):
    with parity_engine(family[0]) as llm:
        yield llm


def test_engine_greedy_matches_transformers(family, engine):
    check_engine_parity(engine, family[1], engine_parity_prompts())
    stats = engine.get_stats()
    assert stats["kv_cache_bytes_per_token"] == 3 * LATENT * 4  # 3 layers x 40 x float32


def test_kv_pool_holds_budget_over_latent_bytes_per_token(family):
    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine

    folder, _ = family
    bytes_per_token = 3 * LATENT * 4
    budget = 1000 * bytes_per_token + 123
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(folder), dtype="float32", kv_cache_memory_bytes=budget, block_size=16,
        max_model_len=128, num_threads=1, skip_tokenizer_init=True))
    try:
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert stats["kv_cache_bytes_per_token"] == bytes_per_token
    assert stats["num_total_blocks"] == budget // (16 * bytes_per_token)  # 62 blocks, 992 tokens
    assert stats["kv_cache_bytes"] == stats["num_total_blocks"] * 16 * bytes_per_token


def test_dp_stats_sum_the_pool_bytes_but_not_the_bytes_per_token():
    from atom.engine.core_client import merge_rank_results

    rank = {"kv_cache_bytes": 62 * 16 * 480, "kv_cache_bytes_per_token": 480}
    assert merge_rank_results([rank, rank]) == {"kv_cache_bytes": 2 * 62 * 16 * 480,
                                                "kv_cache_bytes_per_token": 480}


def test_mtp_layers_are_ignored_and_fp8_is_refused(family, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, hf_model = family
    if hf_model.config.model_type != "deepseek_v3":
        pytest.skip("checked on DeepSeek-V3")
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:  # an MTP layer 3
        tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    prompt = random_tokens(20, 512, seed=3)
    logits = []
    for source in (folder, tmp_path):
        seq = seq_of(prompt)
        BlockPool().grow(seq, len(prompt))
        logits.append(fp32_runner(source).execute_model([(seq, len(prompt))]).logits)
    assert torch.equal(logits[0], logits[1])
    fp8 = {**config, "quantization_config": {"quant_method": "fp8",
                                             "weight_block_size": [128, 128]}}
    with pytest.raises(ValueError, match="FP8 block-scaled"):
        arch_config_from_hf(fp8)
