"""Mixtral (Mistral AI 2024, arXiv:2401.04088): the Llama decoder with a top-k mixture of
SiLU-gated experts in every layer, softmax routing renormalized over the k
(:func:`atom.layers.moe.softmax_topk`). Checkpoints name the experts ``w1`` (gate), ``w3`` (up)
and ``w2`` (down) under ``block_sparse_moe.``, or keep them fused as transformers v5 does
(:mod:`atom.layers.weights`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from atom.layers.decoder import DecoderForCausalLM
from atom.layers.moe import ExpertShard, MoE
from atom.layers.weights import ExpertNames


@dataclass(frozen=True)
class MixtralConfig:
    """Mixtral's MoE settings (``config.json``): ``num_local_experts`` experts per layer,
    ``num_experts_per_tok`` of them per token; each expert is ``intermediate_size`` wide."""

    num_experts: int
    num_experts_per_tok: int


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: :class:`~atom.layers.decoder.DecoderForCausalLM` with :class:`~atom.layers.moe.MoE`
    MLPs."""

    expert_names = ExpertNames(module="block_sparse_moe.", gate="w1", up="w3", down="w2")

    @classmethod
    def parse_family_config(cls, hf) -> MixtralConfig:
        super().parse_family_config(hf)
        return MixtralConfig(num_experts=hf.required("num_local_experts"),
                             num_experts_per_tok=hf.required("num_experts_per_tok"))

    @classmethod
    def make_mlp(cls, config, layer_idx: int, expert_shard: ExpertShard | None) -> nn.Module:
        return MoE(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_experts=config.family.num_experts, top_k=config.family.num_experts_per_tok,
                   expert_shard=expert_shard)
