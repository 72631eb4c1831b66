"""gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925;
transformers' ``modeling_gpt_oss.py`` is the reference).

The shared pre-norm decoder (:class:`atom.layers.decoder.DecoderForCausalLM`) with:

- attention with biases on q/k/v/o, a learned **sink** logit per head in every softmax's
  denominator, and a **sliding window** (``sliding_window`` tokens) in the layers
  ``layer_types`` marks ``sliding_attention`` (every other layer in the published models); the
  full layers see everything (:mod:`atom.kernels.attention`). The windowed layers form their
  own KV cache group (:func:`GptOssForCausalLM.kv_cache_specs` says their window;
  :func:`atom.kv_cache_spec.kv_cache_groups`): they share cache tensors with the full layers
  through a block table of their own, whose blocks before the window the block manager
  releases (:mod:`atom.core.block_manager`);
- YaRN rotary (:class:`atom.layers.rotary.YarnScaling`, ``rope_scaling`` / ``rope_parameters``);
- a mixture of experts in every layer: a router linear **with a bias**, the top
  ``num_experts_per_tok`` logits softmaxed over those k
  (:class:`atom.layers.moe.TopKSoftmaxMoE`), and experts with biases and a clamped SwiGLU
  (:class:`atom.layers.mlp.ClampedSwiGLUMLP`: ``swiglu_limit``, ``swiglu_alpha``).

Checkpoints keep the experts fused (:meth:`GptOssForCausalLM.read_moe`): as float tensors
``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (gate and up columns *interleaved*) and
``mlp.experts.down_proj`` ``[E, I, H]`` (transformers' layout), or in MXFP4 as the published
checkpoints are (``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` and ``_scales`` ``[E, 2I, H/32]``,
``down_proj_blocks`` / ``_scales`` likewise; ``quantization_config.quant_method = "mxfp4"``),
dequantized at load to the run dtype (:func:`atom.layers.weights.dequantize_mxfp4`); biases are
float either way. Under expert parallelism only this rank's experts are read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from atom.kv_cache_spec import KVCacheSpec
from atom.layers.attention import Attention
from atom.layers.decoder import DecoderForCausalLM
from atom.layers.mlp import ClampedSwiGLUMLP
from atom.layers.moe import ExpertShard, MoE, TopKSoftmaxMoE
from atom.layers.rotary import YarnScaling, rotary_cos_sin, yarn_inv_freq
from atom.layers.weights import CheckpointReader, dequantize_mxfp4

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssConfig:
    """gpt-oss's own settings (``config.json``).

    Attributes:
        num_experts: experts per layer (``num_local_experts``); each ``intermediate_size`` wide.
        num_experts_per_tok: experts per token (top-k).
        swiglu_limit, swiglu_alpha: the experts' clamp and sigmoid gain.
        attention_bias: q/k/v/o have biases (true in the published models).
        layer_types: per layer, ``sliding_attention`` or ``full_attention``.
        sliding_window: the window of the sliding layers, in tokens (None: every layer full,
            as transformers reads a config without one).
        yarn: the rotary scaling, or None for the default rope.
    """

    num_experts: int
    num_experts_per_tok: int
    swiglu_limit: float
    swiglu_alpha: float
    attention_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    yarn: YarnScaling | None

    def window_of(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None


def parse_gpt_oss_config(hf) -> GptOssConfig:
    """:class:`GptOssConfig` from an :class:`atom.worker.model_loader.HFConfig`.

    Raises:
        ValueError: a required key missing, ``layer_types`` of the wrong length or with an
            unknown type, a non-positive ``sliding_window``, a rope scaling other than YaRN, or a
            quantization other than MXFP4 (each message names the key and the file).
    """
    hf.required("head_dim")  # 64 in the published models, where hidden / heads is 45
    num_layers = hf.required("num_hidden_layers")
    layer_types = tuple(hf.get("layer_types") or (
        SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)))  # transformers' default
    if len(layer_types) != num_layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ValueError(f"{hf.source}: layer_types must list {num_layers} entries, each "
                         f"{SLIDING!r} or {FULL!r}; got {list(layer_types)}")
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{hf.source}: sliding_window={window!r} must be a positive integer")
    rope = hf.rope()
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{hf.source}: rope scaling {rope_type!r} is not supported for "
                         f"{hf.architecture} (default or yarn)")
    quantization = hf.get("quantization_config")
    if quantization is not None and (not isinstance(quantization, dict)
                                     or quantization.get("quant_method") != "mxfp4"):
        raise ValueError(f"{hf.source}: quantization_config {quantization!r} is not supported "
                         f"for {hf.architecture}: atom reads float or MXFP4 experts")
    return GptOssConfig(
        num_experts=hf.required("num_local_experts"),
        num_experts_per_tok=hf.required("num_experts_per_tok"),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        attention_bias=bool(hf.get("attention_bias", True)), layer_types=layer_types,
        sliding_window=window,
        yarn=(YarnScaling.from_rope_parameters(
            rope, max_position_embeddings=hf.get("max_position_embeddings", 131072))
              if rope_type == "yarn" else None))


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss: :class:`~atom.layers.decoder.DecoderForCausalLM` with sink and sliding-window
    attention, YaRN rotary and :class:`~atom.layers.moe.TopKSoftmaxMoE` layers."""

    @classmethod
    def parse_family_config(cls, hf) -> GptOssConfig:
        return parse_gpt_oss_config(hf)

    @classmethod
    def make_attention(cls, config, layer_idx: int) -> nn.Module:
        family = config.family
        return Attention(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                         num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                         bias=family.attention_bias, sinks=True,
                         sliding_window=family.window_of(layer_idx))

    @classmethod
    def make_mlp(cls, config, layer_idx: int, expert_shard: ExpertShard | None) -> nn.Module:
        family = config.family
        return TopKSoftmaxMoE(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_experts=family.num_experts, top_k=family.num_experts_per_tok,
            expert_shard=expert_shard,
            expert_class=functools.partial(ClampedSwiGLUMLP, limit=family.swiglu_limit,
                                           alpha=family.swiglu_alpha))

    @classmethod
    def kv_cache_specs(cls, config) -> list[KVCacheSpec]:
        """K and V of every layer, the sliding layers' window named (they form a second KV
        cache group: :func:`atom.kv_cache_spec.kv_cache_groups`)."""
        return [KVCacheSpec(num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                            sliding_window=config.family.window_of(i))
                for i in range(config.num_hidden_layers)]

    @classmethod
    def rotary_tables(cls, config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        yarn = config.family.yarn
        if yarn is None:
            return super().rotary_tables(config, max_positions)
        return rotary_cos_sin(
            head_dim=config.head_dim, rope_theta=config.rope_theta, max_positions=max_positions,
            inv_freq=yarn_inv_freq(head_dim=config.head_dim, rope_theta=config.rope_theta,
                                   yarn=yarn),
            attention_factor=yarn.resolved_attention_factor())

    def read_moe(self, reader: CheckpointReader, prefix: str, moe: MoE) -> dict[str, torch.Tensor]:
        """The router and this rank's experts (``[start, end)``) from the fused float or MXFP4
        layout (module docstring), one expert at a time: each expert's gate/up rows
        de-interleaved (gate rows first, then up, as :class:`ClampedSwiGLUMLP` keeps them).

        Raises:
            ValueError: a tensor of the layout found is missing, or MXFP4 blocks that do not
                pair with their scales.
        """
        experts = prefix + "mlp.experts."
        out = {f"router.{kind}": reader.take(f"{prefix}mlp.router.{kind}")
               for kind in ("weight", "bias")}
        for i, e in enumerate(range(moe.expert_start, moe.expert_start + moe.num_local_experts)):
            gate_up_bias = reader.take_rows(experts + "gate_up_proj_bias", e, e + 1)[0]
            gate_up, down = (_expert_matrix(reader, experts + name, e, gate_up_bias.dtype)
                             for name in ("gate_up_proj", "down_proj"))
            ours = f"local_experts.{i}."
            out[ours + "gate_up_proj.weight"] = torch.cat([gate_up[0::2], gate_up[1::2]])
            out[ours + "gate_up_proj.bias"] = torch.cat([gate_up_bias[0::2], gate_up_bias[1::2]])
            out[ours + "down_proj.weight"] = down
            out[ours + "down_proj.bias"] = reader.take_rows(experts + "down_proj_bias", e, e + 1)[0]
        return out


def _expert_matrix(reader: CheckpointReader, name: str, expert: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s ``name`` (``.../gate_up_proj`` or ``.../down_proj``) as a linear
    weight ``[out, in]`` in ``dtype``: dequantized from ``name_blocks`` / ``name_scales``
    (stored ``[out, in/32, 16]``) when the checkpoint has them, else the float tensor (stored
    ``[in, out]``, transformers' layout) transposed."""
    if name + "_blocks" in reader:
        return dequantize_mxfp4(reader.take_rows(name + "_blocks", expert, expert + 1)[0],
                                reader.take_rows(name + "_scales", expert, expert + 1)[0],
                                dtype=dtype)
    return reader.take_rows(name, expert, expert + 1)[0].t()
