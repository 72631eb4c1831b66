"""Load a model's architecture config, weights and tokenizer.

Three sources, one result (Hugging Face parameter names, the run dtype):

- ``None``: the embedded SmolLM2-135M-Instruct GGUF
  (:func:`atom.worker.embedded_model.ensure_embedded_gguf`);
- a path to a ``.gguf`` file (llama architecture), read with the ``gguf`` package;
- a Hugging Face folder (``config.json`` + ``*.safetensors``) of a supported architecture
  (:mod:`atom.models`: the registry), read lazily (:class:`atom.worker.checkpoint.Checkpoint`).

The architecture config (:class:`ModelArchConfig`) has the fields every family reads; what a
family needs besides is its own dataclass, parsed from ``config.json`` by its model class
(``parse_family_config``) into ``ModelArchConfig.family``. A required key that is missing is a
``ValueError`` naming the key, the file and the architecture (:class:`HFConfig`).

GGUF specifics: GGUF lists tensor dimensions in the reverse order of torch (``gguf`` already
hands back numpy arrays in torch order), and llama.cpp's converter permutes the rows of
``attn_q``/``attn_k`` so that rotary pairs are interleaved; we undo that permutation exactly as
transformers' GGUF loader does (``LlamaTensorProcessor._reverse_permute_weights``) so the model
uses Hugging Face's ``rotate_half`` rotary.

Dequantizing takes seconds, so the result is cached on disk as one safetensors file per
(source file, dtype) under ``cache_dir()/weights/`` (written atomically; the arch config rides
in its metadata), and the GGUF tokenizer is saved once with ``save_pretrained`` under
``cache_dir()/tokenizer/``. The cache key is the file's name, size and mtime: re-fetching or
editing the GGUF invalidates it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from atom.models import check_architecture, get_model_class, hf_architecture
from atom.worker.checkpoint import Checkpoint
from atom.worker.embedded_model import cache_dir
from atom.worker.model_files import file_cache_key, gguf_field, resolve_model_path

logger = logging.getLogger(__name__)

_CACHE_FORMAT_VERSION = "1"
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# GGUF tensor name (per block: "blk.N.<key>") -> Hugging Face parameter name.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class ModelArchConfig:
    """What the model code needs to know about an architecture (read from GGUF or config.json).

    Attributes:
        architecture: Hugging Face class name, e.g. ``"LlamaForCausalLM"``.
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: as in HF configs.
        num_attention_heads, num_key_value_heads, head_dim: query heads, KV heads (GQA) and the
            per-head size (``hidden_size / num_attention_heads`` unless the config says otherwise).
        rope_theta: rotary base (rope scaling is a family's own setting: gpt-oss's YaRN).
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        max_position_embeddings: the longest context the model was trained for, in tokens.
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_ids: ids that end generation (first one is the tokenizer's EOS).
        family: the family's own settings (a frozen dataclass its model class parsed from
            ``config.json``: Mixtral's and Qwen3-MoE's experts, ...), or None.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    family: Any = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    def to_json(self) -> str:
        """The config as JSON, for the GGUF weights cache (GGUF files are Llama: no family)."""
        if self.family is not None:
            raise ValueError(f"{self.architecture}: a config with family settings has no JSON form")
        d = dataclasses.asdict(self)
        del d["family"]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ModelArchConfig:
        d = json.loads(text)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        for legacy in ("num_experts", "num_experts_per_tok"):  # caches written before families
            d.pop(legacy, None)
        return cls(**d)


class HFConfig:
    """A parsed ``config.json`` whose errors name the file and the architecture.

    Attributes:
        data: the parsed JSON.
        architecture: ``architectures[0]``.
        source: where it came from (for messages).
    """

    def __init__(self, data: dict, *, architecture: str, source: str) -> None:
        self.data, self.architecture, self.source = data, architecture, source

    def get(self, key: str, default=None):
        return self.data.get(key, default)

    def required(self, key: str):
        """``data[key]``.

        Raises:
            ValueError: the key is missing or null.
        """
        value = self.data.get(key)
        if value is None:
            raise ValueError(f"{self.source} has no {key!r}, which {self.architecture} needs: "
                             f"is this a complete {self.architecture} config?")
        return value

    def rope(self) -> dict:
        """The rope settings: transformers 5's ``rope_parameters`` or 4's ``rope_scaling``."""
        return self.data.get("rope_parameters") or self.data.get("rope_scaling") or {}

    def require_default_rope(self) -> None:
        """Raises ValueError for any rope scaling (only the default rope is implemented)."""
        rope = self.rope()
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{self.source}: rope scaling {rope!r} is not supported for "
                             f"{self.architecture} (only the default rope)")

    def reject_true(self, *flags: str) -> None:
        """Raises ValueError when one of ``flags`` is set (an option the family does not run)."""
        for flag in flags:
            if self.data.get(flag):
                raise ValueError(f"{self.source}: {flag}=True is not supported by atom's "
                                 f"{self.architecture}")


# ---------------------------------------------------------------------------------------------
# source resolution


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# GGUF


def arch_config_from_gguf(reader) -> ModelArchConfig:
    """Read a :class:`ModelArchConfig` from an open ``gguf.GGUFReader``'s metadata.

    Raises:
        ValueError: an architecture other than ``llama``, or rope scaling.
    """
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{sorted(_GGUF_ARCHITECTURES)}")
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"GGUF rope scaling ({scaling!r} / rope_freqs) is not supported")
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelArchConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        vocab_size=int(gguf_field(reader, f"{arch}.vocab_size", int(embd.shape[-1]))),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=hidden // num_heads,
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length")),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _reverse_llama_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp stores each head's rows as interleaved rotary pairs; HF keeps the two halves
    apart (``rotate_half``). w: ``[num_heads * head_dim, hidden]``.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def _dequantize_gguf(
    reader, config: ModelArchConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:  # unquantized tensors come back as a view of the mmap
            array = array.copy()
        # gguf lists dims innermost first; the dequantized array is already in torch order.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        w = torch.from_numpy(array.reshape(shape)).float()
        if tensor.name.endswith("attn_q.weight"):
            w = _reverse_llama_permute(w, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            w = _reverse_llama_permute(w, config.num_key_value_heads)
        state_dict[name] = w.to(dtype).contiguous()
    return state_dict


def _load_gguf(path: pathlib.Path, dtype: torch.dtype, *, use_cache: bool):
    from safetensors import safe_open

    name = f"{file_cache_key(path)}-{_dtype_name(dtype)}.safetensors"
    cache_file = cache_dir() / "weights" / name
    if use_cache and cache_file.is_file():
        with safe_open(str(cache_file), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("atom_cache_version") == _CACHE_FORMAT_VERSION:
            logger.info("weights: cache hit %s", cache_file)
            return (ModelArchConfig.from_json(meta["arch_config"]),
                    Checkpoint.from_safetensors([cache_file], dtype))
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = arch_config_from_gguf(reader)
    state_dict = _dequantize_gguf(reader, config, dtype)
    if use_cache:
        _save_atomically(cache_file, state_dict, {
            "atom_cache_version": _CACHE_FORMAT_VERSION, "arch_config": config.to_json(),
            "source": str(path)})
    return config, Checkpoint.from_tensors(state_dict)


def _save_atomically(
    target: pathlib.Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> None:
    """Write a safetensors file via a temp file in the same folder + ``os.replace`` (atomic),
    so a concurrent reader (another rank) never sees a partial file."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, target)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


def arch_config_from_hf(config: dict, generation_config: dict | None = None, *,
                        source: str = "config.json") -> ModelArchConfig:
    """Build a :class:`ModelArchConfig` from a parsed ``config.json`` (transformers 4 or 5 keys):
    the common fields here, the family's own through its model class's ``parse_family_config``.

    Raises:
        ValueError: unsupported architecture or option, or a required key missing.
    """
    arch = hf_architecture(config) or str(config.get("model_type"))
    check_architecture(arch, source=source)
    hf = HFConfig(config, architecture=arch, source=source)
    family = get_model_class(arch).parse_family_config(hf)
    num_heads = hf.required("num_attention_heads")
    eos: list[int] = []
    for values in (config, generation_config or {}):
        value = values.get("eos_token_id")
        for token in ([value] if isinstance(value, int) else value or []):
            if token not in eos:
                eos.append(int(token))
    return ModelArchConfig(
        architecture=arch,
        vocab_size=hf.required("vocab_size"),
        hidden_size=hf.required("hidden_size"),
        intermediate_size=hf.required("intermediate_size"),
        num_hidden_layers=hf.required("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rope_theta=float(config.get("rope_theta") or hf.rope().get("rope_theta") or 10000.0),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        family=family,
    )


def _load_hf_folder(path: pathlib.Path, dtype: torch.dtype):
    config = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    arch_config = arch_config_from_hf(config, gen, source=str(path / "config.json"))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; save the model with "
                                f"save_pretrained(..., safe_serialization=True)")
    return arch_config, Checkpoint.from_safetensors(files, dtype)


# ---------------------------------------------------------------------------------------------
# public API


def load_model_weights(
    model: str | os.PathLike | None, dtype: torch.dtype, *, use_cache: bool = True,
) -> tuple[ModelArchConfig, Checkpoint]:
    """Load the architecture config and the weights (HF parameter names, ``dtype``, CPU).

    Args:
        model: ``None`` (embedded SmolLM2 GGUF), a ``.gguf`` path or a Hugging Face folder.
        dtype: run dtype, e.g. ``torch.bfloat16`` or ``torch.float32``.
        use_cache: for GGUF, read/write the dequantized weights under ``cache_dir()/weights/``.
    Returns:
        ``(config, checkpoint)``: a :class:`~atom.worker.checkpoint.Checkpoint` (a mapping of
        tensors, read when asked for); with tied embeddings there is no ``lm_head.weight``.
    Raises:
        FileNotFoundError: missing path or weight files.
        ValueError: unsupported file type, architecture or config option.
        RuntimeError: the embedded model cannot be fetched.
    """
    start = time.perf_counter()
    path = resolve_model_path(model)
    if path.is_file():
        config, state_dict = _load_gguf(path, dtype, use_cache=use_cache)
    else:
        config, state_dict = _load_hf_folder(path, dtype)
    logger.info("loaded %s weights (%s, %s) in %.2f s", config.architecture, path.name,
                _dtype_name(dtype), time.perf_counter() - start)
    return config, state_dict


def load_gguf_blocks(model: str | os.PathLike | None) -> dict:
    """The GGUF's linear weights in their own quantized blocks (``--quantization gguf``).

    Every tensor of a type the kernels read (:data:`atom.kernels.gguf.TYPE_NAMES`: Q4_1, Q8_0)
    becomes a :class:`~atom.kernels.gguf.QuantizedWeight` under its Hugging Face name, rows in
    torch order (``attn_q`` / ``attn_k`` un-permuted like the float weights); tensors of other
    types are left out (their layers run on the float weights). The blocks are copied out of
    the file's memory map into planes (97 MB for the embedded model; no dequantization).

    Args:
        model: ``None`` (embedded SmolLM2 GGUF) or a ``.gguf`` path.
    Returns:
        ``{hf_name: QuantizedWeight}``.
    Raises:
        ValueError: ``model`` is not a GGUF file, or its architecture is unsupported.
        FileNotFoundError: as :func:`resolve_model_path`.
    """
    import gguf
    import numpy as np

    from atom.kernels.gguf import TYPE_NAMES, QuantizedWeight

    path = resolve_model_path(model)
    if not path.is_file():
        raise ValueError(f"--quantization gguf reads a GGUF file's blocks; {path} is a folder: "
                         f"pass a .gguf file, or drop --quantization")
    reader = gguf.GGUFReader(str(path))
    config = arch_config_from_gguf(reader)
    blocks = {}
    for tensor in reader.tensors:
        if int(tensor.tensor_type) not in TYPE_NAMES:
            continue
        rows = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
        if tensor.name.endswith("attn_q.weight"):
            rows = _reverse_llama_permute(rows, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            rows = _reverse_llama_permute(rows, config.num_key_value_heads)
        blocks[_hf_name(tensor.name)] = QuantizedWeight.from_gguf_blocks(
            rows.contiguous(), int(tensor.tensor_type))
    return blocks


def release_freed_heap() -> None:
    """Hand the memory freed since start-up back to the OS (glibc's ``malloc_trim(0)``).

    A load frees hundreds of MB in chunks of a few MB: the dequantized state dict once the
    model has copied it, and under ``--quantization gguf`` the float weights of the linears that
    run on GGUF blocks. glibc keeps chunks that size in its heap, so without a trim the RSS stays
    where the load left it (embedded model, gguf mode, a 64-block KV pool: 1.02 GiB before,
    0.43 after; docs/PERFORMANCE.md). A no-op where the C library has no ``malloc_trim`` (musl,
    macOS).
    """
    import ctypes
    import gc

    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
