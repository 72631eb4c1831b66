"""Qwen3 and Qwen3-MoE (Qwen3 technical report, arXiv:2505.09388; transformers'
``modeling_qwen3.py`` and ``modeling_qwen3_moe.py`` are the references).

Both are the shared pre-norm decoder (:class:`atom.layers.decoder.DecoderForCausalLM`) with
**QK-norm**: each query and key head is RMSNormed (``q_norm`` / ``k_norm``, weights of
``head_dim``) before the rotary embedding, and ``head_dim`` is its own config key, not
``hidden_size / num_attention_heads``. Qwen3-MoE replaces the MLP of its *sparse* layers
(:func:`is_sparse_layer`) with a mixture of experts routed by a softmax over all experts in
float32, the top ``num_experts_per_tok``, renormalized iff ``norm_topk_prob``
(:func:`atom.layers.moe.softmax_topk`); its other layers keep a dense MLP of
``intermediate_size``, local to each rank under expert parallelism (no collective).

Not supported (refused at load with the option named): ``use_sliding_window``, rope scaling,
``attention_bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from atom.layers.attention import Attention
from atom.layers.decoder import DecoderForCausalLM
from atom.layers.mlp import GatedMLP
from atom.layers.moe import ExpertShard, MoE
from atom.layers.weights import ExpertNames


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (dense): :class:`~atom.layers.decoder.DecoderForCausalLM` with QK-norm."""

    @classmethod
    def parse_family_config(cls, hf) -> None:
        hf.required("head_dim")  # Qwen3 always states it (128 where hidden / heads is 64)
        if hf.get("use_sliding_window"):
            raise ValueError(f"{hf.source}: use_sliding_window=true is not supported yet for "
                             f"{hf.architecture}; set it to false")
        return super().parse_family_config(hf)

    @classmethod
    def make_attention(cls, config, layer_idx: int) -> nn.Module:
        return Attention(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                         num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                         qk_norm_eps=config.rms_norm_eps)


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-MoE's MoE settings (``config.json``).

    Attributes:
        num_experts: experts per sparse layer (``num_experts``; transformers 5 writes
            ``num_local_experts``).
        num_experts_per_tok: experts per token (top-k).
        moe_intermediate_size: one expert's intermediate width (dense layers use
            ``intermediate_size``).
        norm_topk_prob: renormalize the k gates to sum to 1.
        decoder_sparse_step: every this many layers is sparse (see :func:`is_sparse_layer`).
        mlp_only_layers: layer indices that stay dense whatever the step.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]


def is_sparse_layer(layer_idx: int, *, num_experts: int, decoder_sparse_step: int,
                    mlp_only_layers: tuple[int, ...] | list[int]) -> bool:
    """Whether Qwen3-MoE's layer ``layer_idx`` (0-based) has experts: not in
    ``mlp_only_layers``, and ``(layer_idx + 1) % decoder_sparse_step == 0`` (Hugging Face's
    ``Qwen3MoeDecoderLayer``), with at least one expert."""
    return (layer_idx not in mlp_only_layers and num_experts > 0
            and (layer_idx + 1) % decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 with :class:`~atom.layers.moe.MoE` MLPs in its sparse layers."""

    expert_names = ExpertNames()  # mlp.experts.{e}.gate_proj / up_proj / down_proj, mlp.gate

    @classmethod
    def parse_family_config(cls, hf) -> Qwen3MoeConfig:
        super().parse_family_config(hf)
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if num_experts is None:
            hf.required("num_experts")  # raises, naming the key
        step = hf.get("decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"{hf.source}: decoder_sparse_step={step} must be >= 1")
        return Qwen3MoeConfig(
            num_experts=int(num_experts), num_experts_per_tok=hf.required("num_experts_per_tok"),
            moe_intermediate_size=hf.required("moe_intermediate_size"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)), decoder_sparse_step=step,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))

    @classmethod
    def make_mlp(cls, config, layer_idx: int, expert_shard: ExpertShard | None) -> nn.Module:
        moe = config.family
        if not is_sparse_layer(layer_idx, num_experts=moe.num_experts,
                               decoder_sparse_step=moe.decoder_sparse_step,
                               mlp_only_layers=moe.mlp_only_layers):
            return GatedMLP(config.hidden_size, config.intermediate_size)
        return MoE(hidden_size=config.hidden_size, intermediate_size=moe.moe_intermediate_size,
                   num_experts=moe.num_experts, top_k=moe.num_experts_per_tok,
                   renormalize=moe.norm_topk_prob, expert_shard=expert_shard)
