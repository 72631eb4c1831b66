"""The model's files as the front end reads them: where a model is, its tokenizer (and chat
template) and the sampling it recommends. Torch-free, so the front-end process (``LLM``,
``atom serve``, ``atom generate``) never imports torch; the worker's loader
(:mod:`atom.worker.model_loader`) resolves paths through the same functions.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import tempfile

from atom.worker.embedded_model import cache_dir, ensure_embedded_gguf

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | os.PathLike | None) -> pathlib.Path:
    """The file or folder ``model`` names (``None`` = the embedded GGUF, fetched if needed).

    Raises:
        FileNotFoundError: the path does not exist (hub ids are not downloaded).
        ValueError: a file that is not ``.gguf``, or a folder without ``config.json``.
    """
    if model is None:
        return ensure_embedded_gguf()
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a path to a .gguf file or to a Hugging Face "
            f"folder (config.json + *.safetensors), or omit it for the embedded SmolLM2 model "
            f"(hub ids are not downloaded)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a folder")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"model folder {path} has no config.json; pass a Hugging Face model folder")
    return path.resolve()


def file_cache_key(path: pathlib.Path) -> str:
    """A cache key for ``path``: its name, size and mtime (a re-fetched or edited file
    gets a new key)."""
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def gguf_field(reader, key: str, default=None):
    """Metadata ``key`` of an open ``gguf.GGUFReader`` (``default`` when absent)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()



#: llama.cpp's GGUF keys for a model's recommended sampling, and generation_config.json's
_GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                       "general.sampling.top_k": "top_k"}
_HF_SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def recommended_sampling(model: str | os.PathLike | None) -> dict[str, float | int]:
    """The sampling settings the model's own files recommend (``temperature``, ``top_p``,
    ``top_k``): a Hugging Face folder's ``generation_config.json``, or a GGUF's
    ``general.sampling.*`` metadata (llama.cpp's keys); ``{}`` when they carry none (the
    embedded SmolLM2 GGUF carries none).

    Raises:
        FileNotFoundError: the model cannot be found (see :func:`resolve_model_path`).
    """
    if model is None:  # the embedded GGUF (sha256-pinned) carries none: skip a 2-4 s read
        return {}
    path = resolve_model_path(model)
    if path.is_dir():
        gen = path / "generation_config.json"
        config = json.loads(gen.read_text()) if gen.is_file() else {}
        return {k: config[k] for k in _HF_SAMPLING_KEYS if isinstance(config.get(k), (int, float))}
    import gguf  # lazy, as in _load_gguf

    reader = gguf.GGUFReader(str(path))
    found = {name: gguf_field(reader, key) for key, name in _GGUF_SAMPLING_KEYS.items()}
    return {name: value for name, value in found.items() if isinstance(value, (int, float))}


def load_tokenizer(model: str | os.PathLike | None, *, use_cache: bool = True):
    """A transformers fast tokenizer (with the chat template) for ``model`` (same forms as
    :func:`atom.worker.model_loader.load_model_weights`).

    A folder with ``tokenizer.json`` loads as transformers' ``PreTrainedTokenizerFast`` (the
    ``tokenizers`` library underneath; chat templates through transformers' template code),
    which imports no torch: the front end stays torch-free. A folder with only slow-tokenizer
    files (``tokenizer.model``, ``vocab.json``, ...) goes through ``AutoTokenizer``, whose
    conversion imports torch. For a GGUF file transformers builds the tokenizer from the GGUF
    metadata (``AutoTokenizer``: seconds, and torch); it is saved once under
    ``cache_dir()/tokenizer/<key>/`` (``make setup`` does it for the embedded model) and loaded
    from there afterwards.

    Raises:
        FileNotFoundError / ValueError: as :func:`resolve_model_path`.
    """
    path = resolve_model_path(model)
    folder = path
    if path.is_file():
        folder = cache_dir() / "tokenizer" / file_cache_key(path)
        if not (use_cache and folder.is_dir()):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if not use_cache:
                return tokenizer
            _save_tokenizer_atomically(tokenizer, folder)
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    tokenizer = tokenizer_class.from_pretrained(str(folder))
    if getattr(tokenizer, "chat_template", None) is None:  # said where chat is used, not here
        logger.info("tokenizer of %s has no chat template: chat requests will fail", path)
    return tokenizer


def _save_tokenizer_atomically(tokenizer, folder: pathlib.Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, folder)  # atomic; fails if another process got there first
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_json(model: str | None) -> str:
    """``model``'s tokenizer as ``tokenizer.json`` text, padding and truncation off (what
    llguidance wraps; called on the grammar thread at the first constrained request)."""
    import copy

    from atom.worker.model_files import load_tokenizer

    backend = copy.copy(load_tokenizer(model).backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
