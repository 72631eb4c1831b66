"""gpt-oss against transformers on one rank (fp32), in both checkpoint layouts (float, MXFP4).

The tiny random gpt-oss of tests/moe_utils.py (3 layers: sliding, full, sliding, a window of 8
tokens, shorter than the prompts; random non-zero sinks and biases; YaRN over an original
context of 32; 8 experts, top-2):

- the model runner's logits equal transformers' (prompt logits, decodes, a chunked prompt in a
  mixed batch, every chunk past the window); the KV specs name each layer's window;
- the engine's greedy tokens and top-5 logprobs equal transformers' through the tie-aware
  comparator, on one engine whose options make every case happen: chunked prefill (a token
  budget of 16), preemption (a pool too small for the batch), prefix-cache hits across the
  window boundary (the prompts again, and prompts sharing a 40-token prefix);
- n-gram speculative decoding (several query tokens per sequence through the windowed layers)
  gives the plain engine's greedy tokens;
- MXFP4: atom's dequantization equals transformers' on a tensor quantized in the test; a folder
  with MXFP4 experts loads to the same model as the float folder of the same (dequantized)
  weights and matches transformers' own load of it; an expert-parallel rank reads only its own
  experts' blocks and scales;
- config errors name the key to change.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from atom.config import EngineConfig
from atom.engine.preflight import check_model_files
from atom.kv_cache_spec import (KVCacheSpec, describe_groups, describe_layers, kv_cache_groups,
                                kv_cache_slots)
from atom.layers.moe import ExpertShard, TopKSoftmaxMoE
from atom.layers.weights import dequantize_mxfp4
from atom.models import get_model_class
from atom.worker.model_loader import arch_config_from_hf, load_model_weights
from atom.worker.model_runner import ModelRunner
from tests.models.runner_parity import (BLOCK_SIZE, NUM_KV_BLOCKS, CountingCheckpoint,
                                        check_prefill_then_decode,
                                        check_runner_matches_transformers, random_tokens)
from tests.moe_utils import (build_tiny_gpt_oss, check_engine_parity, check_ngram_speculation,
                             engine_parity_prompts, parity_engine, quantize_mxfp4,
                             save_mxfp4_layout)

WINDOWS = [8, None, 8]


def _runner(folder, *, expert_shard=None) -> ModelRunner:
    config, weights = load_model_weights(str(folder), torch.float32)
    return ModelRunner(config, weights, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                       block_size=BLOCK_SIZE, max_model_len=512, expert_shard=expert_shard)


def _model(folder, weights=None, *, expert_shard=None):
    """The model as loaded, before the runner packs its linears (weights still readable)."""
    config, checkpoint = load_model_weights(str(folder), torch.float32)
    return get_model_class(config.architecture).from_state_dict(
        config, checkpoint if weights is None else weights, dtype=torch.float32,
        max_positions=64, expert_shard=expert_shard)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    return folder, build_tiny_gpt_oss(folder)


def test_runner_logits_match_transformers(family):
    folder, hf_model = family
    runner = _runner(folder)
    layers = runner.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == WINDOWS
    assert all(isinstance(layer.mlp, TopKSoftmaxMoE) for layer in layers)
    check_runner_matches_transformers(runner, hf_model, vocab=512, prompt_len=41)


def test_kv_cache_specs_name_each_layers_window(family):
    config, _ = load_model_weights(str(family[0]), torch.float32)
    specs = ModelRunner.kv_cache_specs_of(config)
    assert specs == [KVCacheSpec(num_kv_heads=2, head_dim=24, sliding_window=w) for w in WINDOWS]
    assert describe_layers(specs) == ("layer 0: K+V 2 heads x 24, window 8; layer 1: K+V 2 heads "
                                      "x 24; layer 2: K+V 2 heads x 24, window 8")
    # two KV cache groups (full: layer 1; window 8: layers 0, 2) sharing cache tensors: a
    # block id holds the larger group's two layers, not all three
    assert [(g.sliding_window, g.layer_ids) for g in kv_cache_groups(specs)] == [
        (None, (1,)), (8, (0, 2))]
    assert kv_cache_slots(specs) == [0, 0, 1]
    assert describe_groups(specs, itemsize=4) == (
        "2 KV cache groups: full 1 layers 384 bytes per token, window 8 2 layers 768 bytes per "
        "token (shared tensors)")
    assert ModelRunner.kv_cache_bytes_per_block(config, dtype=torch.float32, block_size=16) == (
        2 * 16 * 2 * 2 * 24 * 4)


@pytest.fixture(scope="module")
def engine(family):
    """tests/moe_utils.py parity_engine: chunked prefill, preemption."""
    with parity_engine(family[0]) as llm:
        yield llm


def test_engine_greedy_matches_transformers(family, engine):
    prompts = engine_parity_prompts()
    assert min(map(len, prompts)) > 8 and max(map(len, prompts)) > 32  # window, YaRN's context
    check_engine_parity(engine, family[1], prompts)
    # two KV cache groups: the sliding layers release what leaves their window; without that,
    # the 57 + 12 token sequences would need 9 + 9 of the pool's 12 blocks and be cut
    stats = engine.get_stats()
    assert stats["kv_cache_bytes_per_token_full"] == 1 * 2 * 2 * 24 * 4
    assert stats["kv_cache_bytes_per_token_window_8"] == 2 * 2 * 2 * 24 * 4
    assert stats["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 24 * 4  # a block id: the larger group


def test_ngram_speculative_decoding_keeps_the_greedy_tokens(family, engine):
    # repeated motifs whose greedy continuations repeat tokens too (found by trying seeds: a
    # random model rarely repeats itself, and only repeats get drafts accepted)
    rngs = [random.Random(seed) for seed in (1, 3)]
    prompts = [[rng.randrange(3, 512) for _ in range(6)] * 5 for rng in rngs]
    check_ngram_speculation(engine, family[0], prompts, max_tokens=40)


# ----- MXFP4 -----


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * 0.3
    weight[0, 0, :32] = 0.0  # an all-zero block
    blocks, scales = quantize_mxfp4(weight)  # [E, out, in/32, 16], [E, out, in/32]
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # quantized, not lost: within half of FP4's widest step (2) times a block's scale (<= amax / 3)
    assert (ours - weight).abs().max() <= weight.abs().max() / 3
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16).float(), ours)
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[..., 1:])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)


@pytest.fixture(scope="module")
def mxfp4_folders(family, tmp_path_factory):
    """The tiny model with MXFP4 experts, transformers' own load of it (dequantized on the CPU)
    and that load saved as a float folder."""
    mxfp4, dequantized = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("dequantized")
    save_mxfp4_layout(family[1], mxfp4)
    from transformers import GptOssForCausalLM

    hf_model = GptOssForCausalLM.from_pretrained(str(mxfp4), dtype=torch.float32).eval()
    hf_model.save_pretrained(dequantized)
    return mxfp4, dequantized, hf_model


def test_mxfp4_folder_loads_the_dequantized_model(mxfp4_folders):
    mxfp4, dequantized, hf_model = mxfp4_folders
    check_model_files(EngineConfig(model=str(mxfp4), skip_tokenizer_init=True))  # pre-flight
    for (name, a), (_, b) in zip(_model(mxfp4).named_parameters(),
                                 _model(dequantized).named_parameters()):
        assert torch.equal(a, b), name
    runner = _runner(mxfp4)
    check_prefill_then_decode(runner, hf_model, random_tokens(41, 512, seed=6))


def test_preflight_admits_mxfp4_blocks_and_scales_only(mxfp4_folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mxfp4"
    shutil.copytree(mxfp4_folders[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="float32 checkpoints, GptOssForCausalLM's mxfp4 ones"):
        check_model_files(EngineConfig(model=str(folder), skip_tokenizer_init=True))
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.uint8)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"not floats \(model.norm.weight: U8\)"):
        check_model_files(EngineConfig(model=str(folder), skip_tokenizer_init=True))


@pytest.mark.parametrize("layout", ["float", "mxfp4"])
def test_an_expert_parallel_rank_reads_only_its_experts(family, mxfp4_folders, layout):
    folder = family[0] if layout == "float" else mxfp4_folders[0]
    whole = _model(folder)
    source = CountingCheckpoint(load_model_weights(str(folder), torch.float32)[1])
    shard = _model(folder, source, expert_shard=ExpertShard(rank=1, world_size=2))
    for full, part in zip(whole.layers, shard.layers):
        assert part.mlp.expert_start == 4 and part.mlp.num_local_experts == 4
        assert torch.equal(full.mlp.router.bias, part.mlp.router.bias)
        for mine, theirs in zip(part.mlp.local_experts, full.mlp.local_experts[4:]):
            for a, b in zip(mine.parameters(), theirs.parameters()):
                assert torch.equal(a, b)
    expert_tensors = {n for n in source.rows_read if ".mlp.experts." in n}
    assert expert_tensors and not any(".mlp.experts." in n for n in source.read)
    assert {source.rows_read[n] for n in expert_tensors} <= {(e, e + 1) for e in range(4, 8)}
    suffixes = {n.rsplit(".", 1)[1] for n in expert_tensors}
    assert suffixes == ({"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
                        if layout == "float" else {"gate_up_proj_blocks", "gate_up_proj_scales",
                                                   "down_proj_blocks", "down_proj_scales",
                                                   "gate_up_proj_bias", "down_proj_bias"})


# ----- config -----


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["full_attention"]), "layer_types must list 3 entries"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "layer_types must list 3 entries"),
    (dict(sliding_window=0), "sliding_window=0 must be a positive integer"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope scaling 'linear'"),
    (dict(quantization_config={"quant_method": "fp8"}), "atom reads float or MXFP4 experts"),
    (dict(head_dim=None), "has no 'head_dim'"),
])
def test_config_errors_name_what_to_change(family, change, match):
    config = json.loads((family[0] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf({**config, **change})


def test_default_layer_types_alternate_and_default_rope_is_plain(family):
    config = json.loads((family[0] / "config.json").read_text())
    del config["layer_types"], config["rope_parameters"]
    family_config = arch_config_from_hf({**config, "rope_theta": 10000.0}).family
    assert family_config.layer_types == ("sliding_attention", "full_attention",
                                         "sliding_attention")  # transformers' default
    assert family_config.yarn is None


@pytest.mark.parametrize("options, has_full_group, match", [
    (dict(speculative_method="draft", num_speculative_tokens=2, draft_num_layers=1), True,
     "draft model"),
    (dict(kv_events_endpoint="tcp://127.0.0.1:0"), False, "KV events"),
])
def test_what_cannot_serve_kv_cache_groups_refuses_in_one_line(options, has_full_group, match):
    from atom.worker.worker import _check_hybrid_supported

    with pytest.raises(ValueError, match=match):
        _check_hybrid_supported(EngineConfig(**options), has_full_group=has_full_group)
    # KV events describe the full group's blocks: allowed when there is one
    _check_hybrid_supported(EngineConfig(kv_events_endpoint="tcp://127.0.0.1:0"),
                            has_full_group=True)


def test_each_groups_bytes_per_token_is_not_summed_over_ranks():
    from atom.engine.core_client import merge_rank_results

    rank = {"kv_cache_bytes_per_token_full": 384, "kv_cache_bytes_per_token_window_8": 768,
            "num_free_blocks": 12}
    assert merge_rank_results([rank, rank]) == {**rank, "num_free_blocks": 24}
