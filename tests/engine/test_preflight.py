"""The front end's pre-flight (issue 38): model folders the cores could not load fail before any
process starts, with a message that names the file and what to change. Real folders saved by
transformers, damaged the way users' copies are."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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


def _as_moe(folder, architecture: str, **keys) -> None:
    """Make ``folder``'s config.json describe an MoE of ``architecture`` (the pre-flight reads
    config.json and the safetensors headers: the tensors' names do not matter here)."""
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=[architecture], num_experts_per_tok=2, **keys)
    (folder / "config.json").write_text(json.dumps(config))


EP2 = dict(data_parallel_size=2, enable_expert_parallel=True)


@pytest.mark.parametrize("architecture, keys, options, message", [
    # what config.json tells of the experts, checked against the options (issue 54)
    ("LlamaForCausalLM", {}, EP2, "--enable-expert-parallel needs an MoE model and {folder} is "
                                  "dense: load an MoE"),
    ("Qwen3MoeForCausalLM", dict(num_experts=8, moe_intermediate_size=32),
     dict(EP2, data_parallel_size=16), "8 experts cannot be sharded over 16 ranks"),
    ("DeepseekV3ForCausalLM", dict(n_routed_experts=4), dict(EP2, data_parallel_size=8),
     "4 experts cannot be sharded over 8 ranks"),  # DeepSeek's
    ("MixtralForCausalLM", dict(num_local_experts=8), dict(moe_split_experts=4),
     "--moe-split-experts splits a dense model's MLPs into experts, but {folder} is an MoE (8 "
     "experts a layer): drop --moe-split-experts"),
    ("MixtralForCausalLM", dict(num_local_experts=8), dict(EP2, data_parallel_size=16),
     "8 experts cannot be sharded over 16 ranks (each rank needs one): use "
     "--data-parallel-size 8 or fewer"),
    ("MixtralForCausalLM", dict(num_local_experts=8),
     dict(EP2, data_parallel_size=3, enable_eplb=True, eplb_num_redundant_experts=2),
     "EPLB: 8 experts + 2 redundant slots = 10 slots a layer, not a multiple of the 3 ranks: set "
     "--eplb-num-redundant-experts to 1 plus a multiple of 3"),
    ("MixtralForCausalLM", dict(num_local_experts=8),
     dict(EP2, enable_eplb=True, eplb_num_redundant_experts=10),
     "EPLB: 10 redundant slots over 2 ranks give each rank 9 slots for 8 experts (a rank would "
     "hold two copies of one): use at most 8 (--eplb-num-redundant-experts)"),
])
def test_expert_options_against_config_json(copy, architecture, keys, options, message):
    _as_moe(copy, architecture, **keys)
    with pytest.raises(ValueError) as info:
        _check(copy, **options)
    assert str(info.value).startswith(message.format(folder=copy)), str(info.value)
    assert "\n" not in str(info.value)


def test_the_expert_check_comes_first_and_imports_no_torch(copy):
    _as_moe(copy, "MixtralForCausalLM", num_local_experts=8)
    code = (f"import sys; from atom.config import EngineConfig; "
            f"from atom.engine.llm_engine import LLMEngine\n"
            f"try: LLMEngine(EngineConfig(model={str(copy)!r}, moe_split_experts=4))\n"
            f"except ValueError as exc: print(exc)\n"
            f"assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("--moe-split-experts splits a dense model's MLPs")


def test_expert_options_that_fit_pass(copy):
    _as_moe(copy, "MixtralForCausalLM", num_local_experts=8)
    _check(copy, **EP2, enable_eplb=True, eplb_num_redundant_experts=8)  # 8 slots a rank
    _check(copy, data_parallel_size=2)  # an MoE without expert parallelism
    with pytest.raises(ValueError, match="the embedded model is dense"):
        check_model_files(EngineConfig(**EP2))
    check_model_files(EngineConfig(**EP2, moe_split_experts=4))  # model (a)
