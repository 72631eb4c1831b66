"""Model loader: GGUF config and weights, the on-disk caches, HF folders, errors."""

from __future__ import annotations

import json

import pytest
import torch

from atom.worker import model_loader
from atom.worker.embedded_model import ensure_embedded_gguf
from atom.worker.model_files import load_tokenizer
from atom.worker.model_loader import ModelArchConfig, arch_config_from_hf, load_model_weights


@pytest.fixture(scope="module")
def gguf_path():
    return ensure_embedded_gguf()


@pytest.fixture(scope="module")
def cold_load(gguf_path, tmp_path_factory):
    """Load the embedded GGUF into an empty cache folder (dequantizes, writes the cache)."""
    cache = tmp_path_factory.mktemp("atom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOM_CACHE_DIR", str(cache))
        config, state_dict = load_model_weights(str(gguf_path), torch.bfloat16)
    return cache, config, state_dict


def test_gguf_arch_config(cold_load):
    _, config, _ = cold_load
    assert config == ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rope_theta=1e5, rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,))
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_gguf_state_dict_names_and_shapes(cold_load):
    _, config, sd = cold_load
    assert "lm_head.weight" not in sd  # tied
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.29.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert len(sd) == 2 + 9 * config.num_hidden_layers
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


def test_warm_load_reads_the_disk_cache(cold_load, gguf_path, monkeypatch):
    cache, config, sd = cold_load
    files = list((cache / "weights").glob("*-bfloat16.safetensors"))
    assert len(files) == 1, files
    assert not list((cache / "weights").glob("*.part"))  # atomic write left no temp file
    monkeypatch.setenv("ATOM_CACHE_DIR", str(cache))

    def no_dequantize(*args, **kwargs):
        raise AssertionError("warm load must not dequantize")

    monkeypatch.setattr(model_loader, "_dequantize_gguf", no_dequantize)
    warm_config, warm_sd = load_model_weights(str(gguf_path), torch.bfloat16)
    assert warm_config == config
    assert warm_sd.keys() == sd.keys()
    assert all(torch.equal(warm_sd[k], sd[k]) for k in sd)


def test_reverse_permute_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, applied to HF rows.
    def permute(w, n_head):
        half = w.shape[0] // n_head // 2
        return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(3 * 8, 5)
    assert torch.equal(model_loader._reverse_llama_permute(permute(w, 3), 3), w)


def test_gguf_tokenizer_is_cached_with_chat_template(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    built = load_tokenizer(str(gguf_path))
    folders = list((tmp_path / "tokenizer").iterdir())
    assert len(folders) == 1 and folders[0].is_dir()
    cached = load_tokenizer(str(gguf_path))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for tok in (built, cached):
        assert tok.is_fast
        assert tok.eos_token_id == 2
        assert "<|im_start|>" in tok.chat_template
    assert (cached.apply_chat_template(messages, add_generation_prompt=True)
            == built.apply_chat_template(messages, add_generation_prompt=True))
    text = "Hello, world! The quick brown fox."
    assert cached.encode(text) == built.encode(text)


def _tiny_config(**overrides) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [2, 7]}
    config.update(overrides)
    return config


def test_arch_config_from_hf_reads_transformers_5_keys():
    config = arch_config_from_hf(_tiny_config(), {"eos_token_id": [7, 9]})
    assert config.rope_theta == 5e5
    assert config.head_dim == 8
    assert config.eos_token_ids == (2, 7, 9)
    legacy = _tiny_config(rope_theta=1e4, eos_token_id=3)
    del legacy["rope_parameters"]
    assert arch_config_from_hf(legacy).rope_theta == 1e4
    assert arch_config_from_hf(legacy).eos_token_ids == (3,)


@pytest.mark.parametrize("overrides, match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3"}}, "rope scaling"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_arch_config_from_hf_rejects_unsupported(overrides, match):
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf(_tiny_config(**overrides))


def test_bad_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model_weights(str(tmp_path / "missing"), torch.float32)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model_weights(str(tmp_path / "weights.bin"), torch.float32)
    with pytest.raises(ValueError, match="no config.json"):
        load_model_weights(str(tmp_path), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_weights(str(tmp_path), torch.float32)


def test_quantization_gguf_needs_a_gguf_file_and_float32(tmp_path):
    from atom.config import EngineConfig
    from atom.worker.model_loader import load_gguf_blocks

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="pass a .gguf file, or drop --quantization"):
        load_gguf_blocks(str(tmp_path))
    with pytest.raises(ValueError, match="use dtype='float32' or 'auto'"):
        EngineConfig(quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        EngineConfig(quantization="awq")
    assert EngineConfig(quantization="gguf").resolved_dtype() == "float32"


def _tiny_qwen3_moe_config(**overrides) -> dict:
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "head_dim": 16,
              "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
              "use_sliding_window": False, "sliding_window": None,
              "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    config.update(overrides)
    return config


def test_arch_config_from_hf_parses_the_family_settings():
    from atom.models.qwen3 import Qwen3MoeConfig

    config = arch_config_from_hf(_tiny_qwen3_moe_config())
    assert config.head_dim == 16 and config.rope_theta == 1e6
    assert config.family == Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(1,))
    # transformers 5 writes num_local_experts where published checkpoints say num_experts
    renamed = _tiny_qwen3_moe_config(num_local_experts=4)
    del renamed["num_experts"]
    assert arch_config_from_hf(renamed).family == config.family


@pytest.mark.parametrize("overrides, match", [
    ({"moe_intermediate_size": None}, "config.json has no 'moe_intermediate_size', which "
                                      "Qwen3MoeForCausalLM needs"),
    ({"num_experts": None}, "no 'num_experts'"),
    ({"head_dim": None}, "no 'head_dim'"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true is not "
                                                         "supported"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"architectures": ["Glm4MoeForCausalLM"]}, "unsupported architecture 'Glm4MoeForCausalLM'"),
])
def test_qwen3_moe_config_errors_name_what_to_change(overrides, match):
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf(_tiny_qwen3_moe_config(**overrides))
