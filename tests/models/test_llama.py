"""ModelRunner + Llama model against Hugging Face transformers (fp32 logits parity).

The embedded SmolLM2 GGUF is compared with transformers' own GGUF loader (which also checks our
dequantization and q/k un-permute); a tiny random Llama saved as safetensors checks the HF
folder path, untied heads and GQA with other shapes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atom.worker.model_loader import load_model_weights
from atom.worker.model_runner import ModelRunner
from tests.models.runner_parity import (BLOCK_SIZE, NUM_KV_BLOCKS, BlockPool,
                                        check_chunked_mixed_batch, check_prefill_then_decode,
                                        hf_logits, random_tokens, seq_of)

# --------------------------------------------------------------------------------------------
# embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol_runner():
    config, state_dict = load_model_weights(None, torch.float32)
    return ModelRunner(config, state_dict, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                       block_size=BLOCK_SIZE, max_model_len=512)


def test_smollm2_prefill_and_decode_match_transformers(smol_runner, embedded_hf_model):
    check_prefill_then_decode(smol_runner, embedded_hf_model, random_tokens(37, 49152, seed=0))


def test_smollm2_chunked_prefill_in_mixed_batch_matches_transformers(smol_runner, embedded_hf_model):
    check_chunked_mixed_batch(smol_runner, embedded_hf_model, 49152)


def test_empty_step_and_padding_write_no_kv(smol_runner):
    before = [c.clone() for c in smol_runner.kv_caches]
    for num_padding_tokens in (0, 3):
        out = smol_runner.execute_model([], num_padding_tokens=num_padding_tokens)
        assert out.logits.shape == (0, 49152) and out.logits.dtype == torch.float32
        assert out.sampled_seq_ids == [] and out.prompt_logits == {}
    assert all(torch.equal(a, b) for a, b in zip(before, smol_runner.kv_caches))


def test_runner_rejects_a_step_that_does_not_fit(smol_runner):
    seq = seq_of([1, 2, 3, 4])
    with pytest.raises(ValueError, match="block table"):
        smol_runner.execute_model([(seq, 4)])  # no blocks allocated
    seq.block_table = [0]
    with pytest.raises(ValueError, match="num_new_tokens"):
        smol_runner.execute_model([(seq, 5)])


def test_kv_cache_bytes_per_block():
    config, _ = _tiny_llama_config_and_hf(tie=True)
    # 2 (K and V) x layers x block_size x kv heads x head_dim x 2 bytes (bf16)
    assert ModelRunner.kv_cache_bytes_per_block(
        config, dtype=torch.bfloat16, block_size=16) == 2 * 2 * 16 * 2 * 16 * 2


# --------------------------------------------------------------------------------------------
# tiny random Llama from a Hugging Face folder


def _tiny_llama_config_and_hf(*, tie: bool):
    from atom.worker.model_loader import arch_config_from_hf

    hf_config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=tie,
        initializer_range=0.2)  # peaked logits: argmax comparisons are not decided by noise
    return arch_config_from_hf(hf_config.to_dict()), hf_config


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_llama(request, tmp_path_factory):
    _, hf_config = _tiny_llama_config_and_hf(tie=request.param)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf_config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf_model.save_pretrained(folder)
    config, state_dict = load_model_weights(str(folder), torch.float32)
    runner = ModelRunner(config, state_dict, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=256)
    return runner, hf_model


def test_tiny_llama_prefill_and_decode_match_transformers(tiny_llama):
    runner, hf_model = tiny_llama
    check_prefill_then_decode(runner, hf_model, random_tokens(23, 256, seed=5))


def test_tiny_llama_chunked_prefill_in_mixed_batch_matches_transformers(tiny_llama):
    runner, hf_model = tiny_llama
    check_chunked_mixed_batch(runner, hf_model, 256)


def test_torch_paths_without_compiled_kernels_match_transformers(monkeypatch, tmp_path):
    """With no C++ kernels (no compiler, or ATOM_DISABLE_CPP_KERNELS=1) and no oneDNN packing,
    the torch reference paths (attention, norms, rotary, SiLU, sampling helpers) run instead and
    compute the same model."""
    from atom.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    monkeypatch.setattr("atom.layers.linear.pack_weight", lambda weight: None)
    _, hf_config = _tiny_llama_config_and_hf(tie=True)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    config, state_dict = load_model_weights(str(tmp_path), torch.float32)
    runner = ModelRunner(config, state_dict, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=256)
    assert runner.model.layers[0].mlp.gate_up_proj.weight is not None  # left dense
    check_prefill_then_decode(runner, hf_model, random_tokens(23, 256, seed=5))
    check_chunked_mixed_batch(runner, hf_model, 256)


def test_smollm2_bf16_is_as_close_to_fp32_as_transformers_bf16(embedded_hf_model):
    """bf16 rounds differently from transformers' bf16 (fused GEMMs), so compare error sizes:
    our bf16 logits must be about as far from the fp32 reference as transformers' bf16 are,
    summed over four prompts."""
    import copy

    config, state_dict = load_model_weights(None, torch.bfloat16)
    runner = ModelRunner(config, state_dict, dtype=torch.bfloat16, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=128)
    hf_bf16 = copy.deepcopy(embedded_hf_model).to(torch.bfloat16)
    our_err = hf_err = 0.0
    for seed in (7, 8, 9, 10):
        prompt = random_tokens(40, 49152, seed=seed)
        seq = seq_of(prompt, prompt_logprobs=0)
        BlockPool().grow(seq, len(prompt))
        out = runner.execute_model([(seq, len(prompt))])
        ours = torch.cat([out.prompt_logits[seq.seq_id], out.logits])
        ref_fp32 = hf_logits(embedded_hf_model, prompt)
        our_err += (ours - ref_fp32).abs().mean().item()
        hf_err += (hf_logits(hf_bf16, prompt) - ref_fp32).abs().mean().item()
        top5 = ref_fp32.topk(5, dim=-1).indices
        assert (top5 == ours.argmax(-1, keepdim=True)).any(-1).all()  # bf16 only flips near-ties
    # Both are bf16 noise (~0.1-0.4 on logits of magnitude ~30) that varies by prompt, with
    # single positions swinging 5x: one prompt alone measured our error at 0.22x to 2.03x
    # transformers' on an AVX2-only CPU (seeds 7-14); a real bug (rope, KV dtype, norm) is off
    # by whole units.
    assert our_err < 2.0 * hf_err, (our_err, hf_err)
