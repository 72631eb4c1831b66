"""Model implementations, looked up by architecture name (as in HF ``config.architectures``)."""

from __future__ import annotations

from atom.models.llama import LlamaForCausalLM

#: architecture name -> model class with ``from_state_dict``, ``bind_kv_caches``, ``forward``
#: and ``compute_logits``.
MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,  # Llama with MoE MLPs (ModelArchConfig.num_experts)
}


def get_model_class(architecture: str) -> type:
    """The model class for ``architecture``; ``ValueError`` listing the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
