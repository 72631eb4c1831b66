"""The model registry: ``config.json``'s ``architectures[0]`` → the model class, in one place.

Each family is one file of this folder on the shared layers of :mod:`atom.layers`
(:class:`atom.layers.decoder.DecoderForCausalLM`). This module imports no torch and no model
file until a class is asked for, so the front end can refuse an unsupported architecture
(:func:`check_architecture`) before it starts any process, and ``atom models`` lists
:data:`MODEL_REGISTRY` without loading anything.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    """One supported architecture: where its class lives and what it covers.

    ``quant_methods``: the ``quantization_config.quant_method`` values its checkpoints may
    carry (dequantized at load); any other quantized folder is refused before start-up.
    ``expert_keys``: the ``config.json`` keys giving an MoE family's experts per MoE layer,
    the first one present wins (the keys its ``parse_family_config`` reads: the front end
    checks the expert options with them before torch is imported); () for a dense family."""

    module: str  # under atom.models
    class_name: str
    description: str
    quant_methods: tuple[str, ...] = ()
    expert_keys: tuple[str, ...] = ()


#: architecture name (Hugging Face ``architectures[0]``) -> where its class is
MODEL_REGISTRY: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(
        "llama", "LlamaForCausalLM",
        "Llama, SmolLM2, Mistral without a sliding window; also GGUF files (llama)"),
    "MixtralForCausalLM": ModelEntry(
        "mixtral", "MixtralForCausalLM", "Mixtral: top-k softmax MoE, experts renormalized",
        expert_keys=("num_local_experts",)),
    "Qwen3ForCausalLM": ModelEntry(
        "qwen3", "Qwen3ForCausalLM", "Qwen3 dense: per-head q/k RMSNorm"),
    "Qwen3MoeForCausalLM": ModelEntry(
        "qwen3", "Qwen3MoeForCausalLM",
        "Qwen3-MoE: q/k norm, softmax top-k (norm_topk_prob), mlp_only_layers, "
        "decoder_sparse_step", expert_keys=("num_experts", "num_local_experts")),
    "GptOssForCausalLM": ModelEntry(
        "gpt_oss", "GptOssForCausalLM",
        "gpt-oss: attention sinks, sliding-window layers, YaRN, router bias, top-k then "
        "softmax, clamped SwiGLU experts (float or MXFP4)", quant_methods=("mxfp4",),
        expert_keys=("num_local_experts",)),
    "DeepseekV2ForCausalLM": ModelEntry(
        "deepseek", "DeepseekV2ForCausalLM",
        "DeepSeek-V2 / V2-Lite: multi-head latent attention (paged latent cache), softmax "
        "greedy or group-limited routing, shared experts, dense first layers; no MTP, no FP8",
        expert_keys=("n_routed_experts", "num_local_experts")),
    "DeepseekV3ForCausalLM": ModelEntry(
        "deepseek", "DeepseekV3ForCausalLM",
        "DeepSeek-V3 / R1: multi-head latent attention (paged latent cache), sigmoid routing "
        "with a selection-only bias, group-limited top-k, shared experts, dense first layers; "
        "MTP layers ignored, FP8 block-scaled weights not supported",
        expert_keys=("n_routed_experts", "num_local_experts")),
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def check_architecture(architecture: str, *, source: str | None = None) -> None:
    """Raise unless ``architecture`` is supported.

    Raises:
        ValueError: one line naming the architecture, where it came from (``source``) and the
            supported ones.
    """
    if architecture not in MODEL_REGISTRY:
        where = f" ({source})" if source else ""
        raise ValueError(f"unsupported architecture {architecture!r}{where}; supported: "
                         f"{', '.join(supported_architectures())} (see `atom models`)")


def hf_architecture(config: dict) -> str:
    """``architectures[0]`` of a parsed ``config.json`` (old Llama configs name only their
    ``model_type``); "" when it names none."""
    archs = config.get("architectures") or (
        ["LlamaForCausalLM"] if config.get("model_type") == "llama" else [])
    return archs[0] if archs else ""


def num_routed_experts(config: dict) -> int | None:
    """Experts of each MoE layer of the model a parsed ``config.json`` describes, from its
    architecture's :attr:`ModelEntry.expert_keys` (torch-free); None for a dense model or an
    architecture outside the registry. (A Qwen3-MoE config whose every layer is in
    ``mlp_only_layers`` counts as an MoE here; the engine core finds it has no MoE layer.)"""
    entry = MODEL_REGISTRY.get(hf_architecture(config))
    if entry is None:
        return None
    value = next((config[k] for k in entry.expert_keys if config.get(k) is not None), None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def get_model_class(architecture: str) -> type:
    """The model class for ``architecture`` (its module imported now).

    Raises:
        ValueError: an unsupported architecture (:func:`check_architecture`).
    """
    check_architecture(architecture)
    entry = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(f"atom.models.{entry.module}"), entry.class_name)


__all__ = ["MODEL_REGISTRY", "ModelEntry", "check_architecture", "get_model_class",
           "hf_architecture", "num_routed_experts", "supported_architectures"]
