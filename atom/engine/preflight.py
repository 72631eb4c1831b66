"""The front end's pre-flight: what a deployment's files alone can tell, checked before any
engine-core process starts.

:func:`check_model_files` is called by :class:`~atom.engine.llm_engine.LLMEngine` first thing,
so a folder the cores could not load fails in the user's process, at once and in one line
(``atom generate: error: ...``, exit code 2), instead of seconds later in every rank. What only
an engine core can find (weights that do not fit the model, a KV pool that does not fit in
memory) comes back from the core as :class:`~atom.engine.liveness.EngineStartError`. The
expert options are checked here against what ``config.json`` says of the experts
(:meth:`atom.config.EngineConfig.check_expert_layout`: expert parallelism over a dense model,
fewer experts than ranks, EPLB's redundant slots).

Every check reads headers only: ``config.json``, the safetensors headers (names, dtypes,
shapes; no tensor data), a GGUF file's magic number and metadata. The embedded model is atom's own
(sha256-verified when fetched) and is not checked here.
"""

from __future__ import annotations

import json
import pathlib

from atom.config import EngineConfig

__all__ = ["check_model_files", "TOKENIZER_FILES"]

#: the files transformers builds a tokenizer from (one is enough): a fast tokenizer
#: (tokenizer.json), sentencepiece models, BPE / WordPiece vocabularies, tiktoken files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "tiktoken.model")
#: safetensors dtypes atom converts to its run dtype; anything else is a quantized or
#: integer checkpoint the float loader would corrupt
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: per quant method a family dequantizes at load (:attr:`atom.models.ModelEntry.quant_methods`),
#: the name suffixes of its uint8 tensors (gpt-oss's MXFP4 experts:
#: :func:`atom.layers.weights.dequantize_mxfp4`)
QUANTIZED_TENSOR_SUFFIXES = {"mxfp4": ("_blocks", "_scales")}
_GGUF_MAGIC = b"GGUF"


def check_model_files(config: EngineConfig) -> None:
    """Check the model (and draft model) files of ``config`` before any process starts.

    The checks, in order: the path exists and is a ``.gguf`` file or a folder with
    ``config.json``; a GGUF file starts with the GGUF magic number and is of the llama
    architecture; a folder's ``config.json`` is a JSON object naming an architecture of the
    registry (:func:`atom.models.check_architecture`: one line listing the supported ones)
    without ``quantization_config`` (or with a quant method that family dequantizes at load:
    gpt-oss's MXFP4), its ``*.safetensors`` headers are readable and hold float tensors only
    (and that method's uint8 tensors); the folder has tokenizer files (unless
    ``skip_tokenizer_init``); the expert options fit the model's experts (a GGUF file and the
    embedded model are dense Llamas); ``--speculative-method mtp`` has MTP layers to run
    (``num_nextn_predict_layers`` >= 1 in ``config.json``).

    Raises:
        FileNotFoundError: the path does not exist, or a folder has no ``*.safetensors``.
        ValueError: anything else above; the message names the file and what to change.
    """
    _check_expert_options(config)
    _check_mtp(config)
    if config.model is not None:
        path = _check_weights(config.model)
        if path.is_dir() and not config.skip_tokenizer_init:
            _check_tokenizer_files(path)
    if config.draft_model is not None:
        _check_weights(config.draft_model)


def _check_expert_options(config: EngineConfig) -> None:
    """The expert options against the experts ``config.json`` gives, first and torch-free (so
    a wrong flag fails in well under 2 s; :meth:`EngineConfig.check_expert_layout`). A path
    that is no folder with a ``config.json`` is left to :func:`_check_weights`."""
    if not config.enable_expert_parallel and config.moe_split_experts is None:
        return
    from atom.models import num_routed_experts

    if config.model is None:  # the embedded SmolLM2: a dense Llama
        config.check_expert_layout(None, model="the embedded model")
        return
    path = pathlib.Path(config.model).expanduser()
    if path.is_file():  # a GGUF file: atom reads Llama ones only
        config.check_expert_layout(None, model=str(path))
    elif (path / "config.json").is_file():
        hf_config = _read_config_json(path / "config.json")
        config.check_expert_layout(num_routed_experts(hf_config), model=str(path))


def _check_mtp(config: EngineConfig) -> None:
    """``--speculative-method mtp`` on a model whose ``config.json`` names MTP layers (one
    line naming what is missing). The worker checks it again for an in-process engine."""
    if config.speculative_method != "mtp":
        return
    path = None if config.model is None else pathlib.Path(config.model).expanduser()
    if path is None or not (path / "config.json").is_file():
        raise ValueError(f"--speculative-method mtp needs a Hugging Face DeepSeek-V2/V3 folder "
                         f"with num_nextn_predict_layers >= 1 in config.json; "
                         f"{'the embedded model' if path is None else path} has no MTP layers: "
                         f"use --speculative-method ngram or draft")
    num = _read_config_json(path / "config.json").get("num_nextn_predict_layers") or 0
    if num < 1:
        raise ValueError(f"--speculative-method mtp needs multi-token-prediction layers: "
                         f"num_nextn_predict_layers is {num} in {path / 'config.json'}; use a "
                         f"checkpoint with MTP layers, or --speculative-method ngram or draft")


def _check_weights(model: str) -> pathlib.Path:
    from atom.worker.model_files import resolve_model_path

    path = resolve_model_path(model)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ValueError(f"model file {path} is not a GGUF file (it starts with {magic!r}, "
                             f"not {_GGUF_MAGIC!r}): pass a .gguf file or a Hugging Face folder")
        import gguf

        from atom.worker.model_loader import arch_config_from_gguf

        arch_config_from_gguf(gguf.GGUFReader(str(path)))  # raises for another architecture
        return path
    hf_config = _read_config_json(path / "config.json")
    architecture = _check_architecture(hf_config, path / "config.json")
    quantization = hf_config.get("quantization_config")
    quantized_suffixes: tuple[str, ...] = ()
    if quantization is not None:
        from atom.models import MODEL_REGISTRY

        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        methods = MODEL_REGISTRY[architecture].quant_methods
        if method not in methods:
            theirs = f", {architecture}'s {' / '.join(methods)} ones" if methods else ""
            raise ValueError(f"model folder {path} holds a quantized checkpoint (quant_method="
                             f"{method!r}): atom loads float16 / bfloat16 / float32 checkpoints"
                             f"{theirs}, or GGUF files (--quantization gguf keeps their blocks)")
        quantized_suffixes = QUANTIZED_TENSOR_SUFFIXES[method]
    _check_safetensors(path, quantized_suffixes)
    return path


def _check_architecture(hf_config: dict, file: pathlib.Path) -> str:
    """``config.json``'s architecture; raises with one line naming the supported ones
    (:mod:`atom.models`' registry, torch-free) unless it is one of them."""
    from atom.models import check_architecture, hf_architecture

    architecture = hf_architecture(hf_config) or str(hf_config.get("model_type"))
    check_architecture(architecture, source=str(file))
    return architecture


def _read_config_json(file: pathlib.Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON ({exc}): restore it, e.g. with the "
                         f"model's save_pretrained") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object: restore "
                         f"it, e.g. with the model's save_pretrained")
    return data


def _check_safetensors(folder: pathlib.Path, quantized_suffixes: tuple[str, ...] = ()) -> None:
    """Every ``*.safetensors`` header readable and every tensor a float, but uint8 tensors
    whose names end in ``quantized_suffixes`` (the config's quant method's)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin"))
        found = f" (found {', '.join(others[:3])}: atom reads safetensors only)" if others else ""
        raise FileNotFoundError(f"no *.safetensors in {folder}{found}: save the model with "
                                f"save_pretrained(..., safe_serialization=True)")
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read the weights file {file} ({exc}): it is damaged or "
                             f"incomplete; save or copy it again") from exc
        bad = {name: dtype for name, dtype in dtypes.items() if dtype not in FLOAT_DTYPES
               and not (dtype == "U8" and name.endswith(quantized_suffixes))}
        if bad:
            name, dtype = next(iter(bad.items()))
            raise ValueError(f"{file} holds {len(bad)} tensor(s) that are not floats ({name}: "
                             f"{dtype}): atom loads float checkpoints ({', '.join(FLOAT_DTYPES)})")


def _check_tokenizer_files(folder: pathlib.Path) -> None:
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(
            folder.glob("*.tiktoken")):
        return
    raise ValueError(f"no tokenizer files in {folder}: add tokenizer.json (e.g. "
                     f"tokenizer.save_pretrained(folder)), or use --skip-tokenizer-init "
                     f"(skip_tokenizer_init=True) with token-id prompts "
                     f"(atom generate --prompt-token-ids 1,2,3)")
