"""The front end's pre-flight (issue 38): model folders the cores could not load fail before any
process starts, with a message that names the file and what to change. Real folders saved by
transformers, damaged the way users' copies are."""

from __future__ import annotations

import json
import shutil

import numpy as np
import psutil
import pytest
from safetensors.numpy import load_file, save_file

from atom.config import EngineConfig
from atom.engine.llm_engine import LLMEngine
from atom.engine.preflight import check_model_files
from tests.utils import save_tiny_llama


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    save_tiny_llama(folder)
    return folder


@pytest.fixture
def copy(good, tmp_path):
    """A fresh copy of the good folder to damage."""
    folder = tmp_path / "model"
    shutil.copytree(good, folder)
    return folder


def _check(folder, **options):
    check_model_files(EngineConfig(model=str(folder), **options))


def test_a_good_folder_and_the_embedded_model_pass(good, tmp_path):
    _check(good)
    check_model_files(EngineConfig())  # the embedded model is atom's own: not checked here
    draft = tmp_path / "draft"
    save_tiny_llama(draft, tokenizer=False)  # a draft needs no tokenizer of its own
    _check(good, speculative_method="draft", draft_model=str(draft))


def test_no_tokenizer_files_says_what_to_add_or_which_flag(copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).unlink()
    with pytest.raises(ValueError) as info:
        _check(copy)
    assert str(info.value).startswith(f"no tokenizer files in {copy}: add tokenizer.json")
    assert "--skip-tokenizer-init" in str(info.value) and "--prompt-token-ids" in str(info.value)
    _check(copy, skip_tokenizer_init=True)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_safetensors_file_is_named(copy, damage):
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\0" * 100 if damage == "garbage" else data[:-100])
    with pytest.raises(ValueError, match=f"cannot read the weights file {weights} .*damaged"):
        _check(copy)


def test_integer_or_quantized_checkpoints_are_refused(copy):
    weights = copy / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) that are not floats \(model.norm.weight: I8\)"):
        _check(copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized checkpoint \\(quant_method='fp8'\\)"):
        _check(copy)
    config["quantization_config"] = {"quant_method": "mxfp4"}  # gpt-oss's, not Llama's
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='mxfp4'\\): atom loads float16 / "
                                         "bfloat16 / float32 checkpoints, or GGUF"):
        _check(copy)


def test_bad_config_json_missing_weights_and_a_file_that_is_not_gguf(copy, tmp_path):
    (copy / "config.json").write_text('{"architectures": [')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        _check(copy)
    (copy / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        _check(copy)
    (copy / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="unsupported architecture 'None'"):
        _check(copy)
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    (copy / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin: atom reads safetensors"):
        _check(copy)
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\3\4 not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        _check(fake)


def test_the_engine_checks_before_any_process_starts(copy):
    (copy / "tokenizer.json").unlink()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLMEngine(EngineConfig(model=str(copy)), client_factory=_no_client)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def _no_client(config, extra_eos):
    raise AssertionError("the pre-flight must fail before the client is built")
