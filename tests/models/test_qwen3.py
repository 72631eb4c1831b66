"""Qwen3 and Qwen3-MoE against transformers on one rank (fp32), and both checkpoint layouts.

Tiny random models built by transformers (tests/moe_utils.py: large init scale, random norms,
``head_dim`` not ``hidden / heads``, a dense middle layer among the sparse ones of Qwen3-MoE):

- the model runner's logits equal transformers' (prompt logits, decodes, a chunked prompt in a
  mixed batch), for the dense and the MoE family; the KV cache geometry is the model's
  (``head_dim`` 24); Qwen3-MoE's sparse-layer rule;
- the engine's greedy tokens and top-5 logprobs equal transformers' through the tie-aware
  comparator, on one engine whose options make every case happen: chunked prefill (a token
  budget of 16), preemption (a pool too small for the batch), prefix-cache hits (the prompts
  again, and prompts sharing a prefix);
- a Qwen3-MoE and a Mixtral checkpoint saved in transformers v5's fused layout (3-D expert
  tensors) load to the same weights and logits as the per-expert one ``save_pretrained``
  writes, and an expert-parallel rank reads only its own experts from either;
- n-gram speculative decoding gives the greedy tokens of the plain engine.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom.kv_cache_spec import KVCacheSpec
from atom.layers.moe import ExpertShard, MoE
from atom.models import get_model_class
from atom.models.qwen3 import is_sparse_layer
from atom.worker.model_loader import load_model_weights
from atom.worker.model_runner import ModelRunner
from tests.models.runner_parity import (BlockPool, CountingCheckpoint,
                                        check_runner_matches_transformers, fp32_runner,
                                        random_tokens, seq_of)
from tests.moe_utils import (build_tiny_mixtral, build_tiny_qwen3, check_engine_parity,
                             check_ngram_speculation, engine_parity_prompts, parity_engine,
                             save_fused_layout)


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3", "qwen3_moe"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-moe" if request.param else "qwen3")
    return folder, build_tiny_qwen3(folder, moe=request.param)


def test_runner_logits_match_transformers(family):
    folder, hf_model = family
    runner = fp32_runner(folder)
    layers = runner.model.layers
    assert layers[0].self_attn.q_norm is not None and layers[0].self_attn.head_dim == 24
    if hf_model.config.model_type == "qwen3_moe":  # layer 1 is in mlp_only_layers
        assert [isinstance(layer.mlp, MoE) for layer in layers] == [True, False, True]
    check_runner_matches_transformers(runner, hf_model, vocab=512)


def test_kv_cache_geometry_comes_from_the_model(family):
    folder, _ = family
    config, _ = load_model_weights(str(folder), torch.float32)
    specs = ModelRunner.kv_cache_specs_of(config)
    assert specs == [KVCacheSpec(num_kv_heads=2, head_dim=24)] * config.num_hidden_layers
    # K and V x layers x block_size x KV heads x head_dim (24, not hidden / heads = 16) x 2 bytes
    assert ModelRunner.kv_cache_bytes_per_block(config, dtype=torch.bfloat16, block_size=16) == (
        2 * config.num_hidden_layers * 16 * 2 * 24 * 2)


@pytest.mark.parametrize("layer_idx, step, mlp_only, sparse", [
    (0, 1, (), True), (1, 1, (1,), False), (2, 1, (1,), True),
    (0, 2, (), False), (1, 2, (), True), (3, 2, (3,), False), (5, 3, (), True),
])
def test_qwen3_moe_sparse_layer_rule(layer_idx, step, mlp_only, sparse):
    assert is_sparse_layer(layer_idx, num_experts=8, decoder_sparse_step=step,
                           mlp_only_layers=mlp_only) == sparse
    assert not is_sparse_layer(layer_idx, num_experts=0, decoder_sparse_step=step,
                               mlp_only_layers=mlp_only)


@pytest.fixture(scope="module")
def engine(family):
    """One engine per family (tests/moe_utils.py parity_engine)."""
    with parity_engine(family[0]) as llm:
        yield llm


def test_engine_greedy_matches_transformers(family, engine):
    check_engine_parity(engine, family[1], engine_parity_prompts())


# ----- checkpoint layouts -----


@pytest.mark.parametrize("builder", ["qwen3_moe", "mixtral"])
def test_both_expert_layouts_load_the_same_model(tmp_path, builder):
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    if builder == "mixtral":
        hf_model = build_tiny_mixtral(per_expert)
    else:
        hf_model = build_tiny_qwen3(per_expert)
    save_fused_layout(hf_model, fused)
    for (name, pa), (_, pb) in zip(_model(per_expert).named_parameters(),
                                   _model(fused).named_parameters()):
        assert torch.equal(pa, pb), name
    a, b = fp32_runner(per_expert), fp32_runner(fused)
    prompt = random_tokens(30, 512, seed=9)
    outs = []
    for runner in (a, b):
        seq = seq_of(prompt)
        BlockPool().grow(seq, len(prompt))
        outs.append(runner.execute_model([(seq, len(prompt))]).logits)
    assert torch.equal(outs[0], outs[1])

    # an expert-parallel rank (1 of 2: experts 4-7 of 8) reads only its own experts
    whole = _model(per_expert)
    for folder, layout in ((per_expert, "per_expert"), (fused, "fused")):
        source = CountingCheckpoint(load_model_weights(str(folder), torch.float32)[1])
        shard = _model(folder, source, expert_shard=ExpertShard(rank=1, world_size=2))
        for full, part in zip(_moe_layers(whole), _moe_layers(shard)):
            assert part.expert_start == 4 and part.num_local_experts == 4
            for mine, theirs in zip(part.local_experts, full.local_experts[4:]):
                assert torch.equal(mine.gate_up_proj.weight, theirs.gate_up_proj.weight)
                assert torch.equal(mine.down_proj.weight, theirs.down_proj.weight)
        if layout == "fused":
            assert source.rows_read and set(source.rows_read.values()) == {(4, 8)}
        else:
            assert not source.rows_read
            assert not [n for n in source.read if any(f"experts.{e}." in n for e in range(4))]
            assert any("experts.7." in n for n in source.read)


def _model(folder, weights=None, *, expert_shard=None):
    """The model as loaded, before the runner packs its linears (weights still readable)."""
    config, checkpoint = load_model_weights(str(folder), torch.float32)
    return get_model_class(config.architecture).from_state_dict(
        config, checkpoint if weights is None else weights, dtype=torch.float32,
        max_positions=64, expert_shard=expert_shard)


def _moe_layers(model) -> list[MoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


# ----- speculative decoding -----


def test_ngram_speculative_decoding_keeps_the_greedy_tokens(family, engine):
    folder, hf_model = family
    if hf_model.config.model_type != "qwen3_moe":
        pytest.skip("n-gram speculation is checked on the MoE family")
    rng = random.Random(5)
    motif = [rng.randrange(3, 512) for _ in range(6)]
    prompts = [motif * 5, [rng.randrange(3, 512) for _ in range(20)] + motif * 3]
    check_ngram_speculation(engine, folder, prompts, max_tokens=24)
