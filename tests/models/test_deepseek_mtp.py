"""MTP speculative decoding (``--speculative-method mtp``) on one rank, on a tiny DeepSeek-V3
whose MTP layer the test writes into the safetensors (tests/moe_utils.py ``add_mtp_layer``:
transformers does not model MTP).

- the MTP layer's draft logits equal a reference written from the formula (enorm / hnorm /
  eh_proj / the block / shared_head.norm / the target's head) with transformers' own decoder
  layer as the block, over a prompt, and again after a second catch-up;
- greedy output with mtp (k = 1 and 3) equals spec-off output, with drafts accepted and
  rejected (the "predictable" MTP layer drafts right about half the time), through chunked
  prefill; the KV pool has one more (latent) layer only when mtp is on;
- a checkpoint with MTP layers served without mtp loads and ignores them (the spec-off
  reference runs on that folder); mtp on a model without MTP layers is a one-line error.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from atom.config import EngineConfig
from atom.engine.preflight import check_model_files
from atom.layers.moe import moe_layers
from atom.worker.model_loader import load_model_weights
from atom.worker.model_runner import ModelRunner
from atom.worker.mtp_proposer import MTPProposer
from tests.models.runner_parity import BLOCK_SIZE, NUM_KV_BLOCKS, BlockPool, random_tokens, seq_of
from tests.moe_utils import (add_mtp_layer, build_tiny_deepseek, build_tiny_deepseek_mtp,
                             greedy_in_process, tiny_prompts)
from tests.utils import check_greedy_close


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    return build_tiny_deepseek_mtp(tmp_path_factory.mktemp("deepseek-v3-mtp"))


def _greedy(folder, prompts, **options):
    return greedy_in_process(folder, prompts, max_model_len=256, **options)


@pytest.fixture(scope="module")
def spec_off(mtp_folder):
    """Spec-off greedy on the folder *with* MTP layers: they load and are ignored."""
    return _greedy(mtp_folder, tiny_prompts())


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def _reference_draft_logits(folder, mtp: dict, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's logits at the last position of ``tokens[:-1]`` (input ``tokens[1:]``),
    from the formula, with transformers' layer 2 as the block (the test's MTP block is layer 2
    exactly, see the caller)."""
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(folder).eval()
    eps = hf.config.rms_norm_eps
    ids = torch.tensor([tokens])
    h = hf.model(ids[:, :-1]).last_hidden_state  # after the final norm, positions 0..n-2
    e = hf.model.embed_tokens(ids[:, 1:])
    x = torch.cat([_rms(e, mtp["model.layers.3.enorm.weight"], eps),
                   _rms(h, mtp["model.layers.3.hnorm.weight"], eps)], dim=-1)
    x = x @ mtp["model.layers.3.eh_proj.weight"].T
    positions = torch.arange(x.shape[1])[None]
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    x = hf.model.layers[2](x, attention_mask=mask, position_ids=positions,
                           position_embeddings=hf.model.rotary_emb(x, positions))
    x = x[0] if isinstance(x, tuple) else x
    return hf.lm_head(_rms(x[0, -1], mtp["model.layers.3.shared_head.norm.weight"], eps))


def test_mtp_draft_logits_match_the_formula(tmp_path):
    build_tiny_deepseek(tmp_path)
    add_mtp_layer(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))  # the block = layer 2 exactly
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config, weights = load_model_weights(str(tmp_path), torch.float32)
    runner = ModelRunner(config, weights, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=256, num_mtp_layers=1)
    assert len(runner.kv_caches) == 4 and runner.mtp.layers[0].self_attn.kv_cache is runner.kv_caches[3]
    assert runner.mtp.layers[0].mlp in moe_layers(runner.model)  # expert parallelism reaches it
    proposer = MTPProposer(runner)
    prompt = random_tokens(21, 512, seed=4)
    seq, pool = seq_of(prompt), BlockPool()
    for chunk in (13, 8, 3):  # a prompt in two chunks, then a 3-token "verify" of the next tokens
        pool.grow(seq, seq.num_computed_tokens + chunk)
        out = runner.execute_model([(seq, chunk)])
        proposer.record(out.hidden_states)
        seq.num_computed_tokens += chunk
        if seq.num_computed_tokens == len(seq.token_ids):  # a sampled token follows
            seq.token_ids += random_tokens(3, 512, seed=seq.num_computed_tokens)
        if chunk == 13:
            continue
        entry = proposer._catch_up(seq)
        pool.grow(seq, len(seq.token_ids) + 1)
        ours = runner.mtp.compute_logits(proposer._forward([entry], step_idx=0), step_idx=0)[0]
        ref = _reference_draft_logits(tmp_path, tensors, seq.token_ids[:seq.num_computed_tokens + 1])
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_spec_off(mtp_folder, spec_off, k):
    reference, off_stats = spec_off
    ours, stats = _greedy(mtp_folder, tiny_prompts(), speculative_method="mtp",
                          num_speculative_tokens=k, max_num_batched_tokens=32)  # chunked prompts
    exact = sum(a.token_ids == b.token_ids for a, b in zip(ours, reference))
    check_greedy_close(ours, reference, name=f"mtp k={k}")
    print(f"mtp k={k}: {exact}/{len(ours)} sequences token for token")
    assert stats["spec_num_verifies"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    if k == 3:  # some verify accepted several drafts (a multi-row catch-up followed)
        assert stats["spec_accepted_length_2"] + stats["spec_accepted_length_3"] > 0
    per_position = [stats[f"spec_num_accepted_tokens_pos_{j}"] for j in range(k)]
    assert sum(per_position) == stats["spec_num_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # draft j needs drafts < j
    assert stats["spec_mean_acceptance_length"] == (
        1 + stats["spec_num_accepted_tokens"] / stats["spec_num_verifies"])
    latent = 4 * 40  # bytes per token and layer: fp32 x (kv_lora_rank 32 + rope 8)
    assert stats["kv_cache_bytes_per_token"] == 4 * latent
    assert off_stats["kv_cache_bytes_per_token"] == 3 * latent


def test_mtp_without_mtp_layers_is_a_one_line_error(mtp_folder, tmp_path):
    shutil.copytree(mtp_folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config,
                                                            "num_nextn_predict_layers": 0}))
    options = dict(model=str(tmp_path / "m"), speculative_method="mtp", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0 in") as raised:
        check_model_files(EngineConfig.from_kwargs(**options))
    assert "\n" not in str(raised.value)
    from atom.worker.worker import Worker  # an engine that skips the pre-flight: the worker

    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0 in") as raised:
        Worker(EngineConfig.from_kwargs(**options, dtype="float32", num_kv_blocks=8,
                                        num_threads=1))
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="the embedded model has no MTP layers"):
        check_model_files(EngineConfig.from_kwargs(speculative_method="mtp"))


def test_mtp_through_preemption_and_prefix_hits(mtp_folder, spec_off):
    """A pool too small for every sequence (recomputes after preemption) and every prompt
    twice (the second ones hit the prefix cache): the hidden rows start over where the
    target's forward does, and the output is still spec-off's."""
    reference, _ = spec_off
    prompts = tiny_prompts() * 2
    ours, stats = _greedy(mtp_folder, prompts, speculative_method="mtp",
                          num_speculative_tokens=3, num_kv_blocks=12, block_size=8,
                          max_num_batched_tokens=16)
    check_greedy_close(ours, reference * 2, name="mtp k=3, preemption and prefix hits")
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["spec_num_accepted_tokens"] > 0
