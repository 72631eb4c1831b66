"""The model registry: every entry resolves to a family class on the shared decoder, the
registry imports no torch (the front end checks a model before it starts anything), and an
unsupported architecture is refused in one line naming the supported ones, before any process
starts: by ``LLM`` and by the ``atom`` command; ``atom models`` lists them."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import psutil
import pytest

from atom.models import MODEL_REGISTRY, check_architecture, get_model_class, supported_architectures

ATOM = str(pathlib.Path(sys.executable).parent / "atom")


def test_every_entry_is_a_decoder_family():
    from atom.layers.decoder import DecoderForCausalLM

    for name in MODEL_REGISTRY:
        cls = get_model_class(name)
        assert issubclass(cls, DecoderForCausalLM) and cls.__name__ == name


def test_the_registry_imports_no_torch():
    code = ("import sys, atom.models as m; m.check_architecture('Qwen3MoeForCausalLM'); "
            "assert m.num_routed_experts({'architectures': ['MixtralForCausalLM'], "
            "'num_local_experts': 8}) == 8; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_registrys_expert_count_is_the_familys():
    """num_routed_experts (torch-free, for the pre-flight) reads the experts each MoE family's
    parse_family_config reads, on the tests' tiny configs as transformers writes them."""
    from transformers import (DeepseekV2Config, DeepseekV3Config, GptOssConfig, LlamaConfig,
                              MixtralConfig, Qwen3MoeConfig)

    from atom.models import num_routed_experts
    from atom.worker.model_loader import arch_config_from_hf
    from tests.moe_utils import DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS, QWEN3_MOE

    configs = [MixtralConfig(num_local_experts=6, num_hidden_layers=1), Qwen3MoeConfig(**QWEN3_MOE),
               GptOssConfig(**GPT_OSS), DeepseekV3Config(**DEEPSEEK_V3),
               DeepseekV2Config(**DEEPSEEK_V2)]
    for hf in configs:
        data = {**hf.to_dict(), "architectures": [type(hf).__name__.replace("Config", "ForCausalLM")]}
        family = arch_config_from_hf(data).family
        assert num_routed_experts(data) == family.num_experts > 0, data["architectures"]
    dense = {**LlamaConfig().to_dict(), "architectures": ["LlamaForCausalLM"]}
    assert num_routed_experts(dense) is None


def test_check_architecture_names_the_supported_ones():
    with pytest.raises(ValueError) as info:
        check_architecture("GPT2LMHeadModel", source="/m/config.json")
    message = str(info.value)
    assert "\n" not in message and "'GPT2LMHeadModel' (/m/config.json)" in message
    assert all(name in message for name in supported_architectures())


@pytest.fixture
def gpt2_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return tmp_path


def test_llm_refuses_an_unsupported_architecture_before_starting_a_process(gpt2_folder):
    from atom import LLM

    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as info:
        LLM(str(gpt2_folder), skip_tokenizer_init=True)
    assert "Qwen3MoeForCausalLM" in str(info.value)
    assert psutil.Process().children() == []


def test_atom_command_refuses_it_in_one_line(gpt2_folder):
    proc = subprocess.run([ATOM, "generate", "--prompt", "x", "--model", str(gpt2_folder)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith("atom generate: error: unsupported architecture "
                                  "'GPT2LMHeadModel'")
    assert "see `atom models`" in proc.stderr


def test_atom_models_lists_the_registry():
    proc = subprocess.run([ATOM, "models"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name, entry in MODEL_REGISTRY.items():
        assert name in proc.stdout and f"atom/models/{entry.module}.py" in proc.stdout
    assert "atom serve --model /path/to/folder" in proc.stdout
