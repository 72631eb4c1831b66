"""The pre-norm decoder-only transformer every family here is built on (gpt-fast style), over a
paged KV cache.

:class:`DecoderForCausalLM` is the skeleton: embeddings, a stack of :class:`DecoderLayer`
(``x + attn(norm(x))``, then ``+ mlp(norm(.))``), the final norm and the LM head, rotary tables,
loading from a checkpoint and packing the weights. A family (one file under ``atom/models/``)
subclasses it and says only what differs, each a small override:

- ``parse_family_config(hf)``: its own settings from ``config.json`` (a frozen dataclass, or None),
  refusing the options it does not run;
- ``make_attention(config, layer_idx)`` and ``make_mlp(config, layer_idx, expert_shard)``: the
  attention variant and the MLP (dense :class:`~atom.layers.mlp.GatedMLP` or
  :class:`~atom.layers.moe.MoE`) of each layer;
- ``expert_names``: how its checkpoints name experts (:class:`~atom.layers.weights.ExpertNames`),
  or ``read_moe`` when they store them in a layout of their own;
- ``kv_cache_specs(config)``: each layer's KV cache geometry (:mod:`atom.kv_cache_spec`).

The forward takes the flattened tokens of a mixed batch (prefill chunks and decodes): no batch
dimension, no padding. Attention goes through :mod:`atom.kernels.attention`. Weights are fused at
load (``q/k/v_proj`` → ``qkv_proj``, ``gate/up_proj`` → ``gate_up_proj``): one GEMM instead of
three (two) per layer, which matters for small-batch decode where each GEMM is latency bound.
:meth:`DecoderForCausalLM.pack_weights` then swaps every linear weight for oneDNN's pre-packed
copy (:mod:`atom.kernels.linear`) once the model is final.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from atom.kernels.attention import AttentionMetadata
from atom.kv_cache_spec import KVCacheSpec
from atom.layers.attention import Attention
from atom.layers.linear import Linear
from atom.layers.mlp import GatedMLP
from atom.layers.moe import ExpertShard, MoE
from atom.layers.norm import RMSNorm
from atom.layers.rotary import rotary_cos_sin
from atom.layers.weights import CheckpointReader, ExpertNames, WeightSource, concat, passthrough, \
    read_experts


class DecoderLayer(nn.Module):
    """One pre-norm layer: ``h = x + self_attn(input_layernorm(x))``, output
    ``h + mlp(post_attention_layernorm(h))``."""

    def __init__(self, *, self_attn: nn.Module, mlp: nn.Module, hidden_size: int,
                 rms_norm_eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, h = self.attention_stage(x, cos, sin, meta)
        return x + self.mlp(h)

    def attention_stage(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its MLP: returns (the residual stream after attention, the MLP's
        normalized input), both ``[T, hidden]``. The layer's output is ``x + mlp(h)``; the
        two-batch-overlap executor (:mod:`atom.worker.tbo`) runs the MLP's stages itself."""
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta),
                                          residual=x)  # x += attention output, in place
        return x, h


class DecoderForCausalLM(nn.Module):
    """The decoder plus LM head. Build with :meth:`from_state_dict`.

    Owns its weights and the rotary tables; the KV caches belong to the model runner and are
    bound with :meth:`bind_kv_caches`. ``config`` is an
    :class:`atom.worker.model_loader.ModelArchConfig` (its ``family`` field: what
    :meth:`parse_family_config` returned).

    Args:
        max_positions: size of the rotary tables (positions ``[0, max_positions)``).
        expert_shard: build every MoE layer with only this rank's experts (expert
            parallelism); None = all of them.
    """

    #: the layer class (a family may add per-layer paths: Llama's GGUF decode)
    layer_class: type[DecoderLayer] = DecoderLayer
    #: how the family's checkpoints name experts one by one (None: a dense family)
    expert_names: ExpertNames | None = None

    def __init__(self, config, *, max_positions: int,
                 expert_shard: ExpertShard | None = None) -> None:
        super().__init__()
        self.config = config
        # an explicit weight: nn.Embedding's own init (normal_) imports torch._dynamo under the
        # meta device (seconds of every engine start, and of every recovery from a rank failure)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            self.layer_class(self_attn=self.make_attention(config, i),
                             mlp=self.make_mlp(config, i, expert_shard),
                             hidden_size=config.hidden_size, rms_norm_eps=config.rms_norm_eps)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied embeddings: from_state_dict points lm_head.weight at the embedding matrix.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.max_positions = max_positions

    # ----- what a family says -----

    @classmethod
    def parse_family_config(cls, hf) -> Any:
        """The family's own settings from ``config.json`` (``hf``: an
        :class:`atom.worker.model_loader.HFConfig`), or None when the common fields are all it
        needs. The default refuses what this skeleton does not run: rope scaling and biases.

        Raises:
            ValueError: an option the family does not support, or a required key missing.
        """
        hf.require_default_rope()
        hf.reject_true("attention_bias", "mlp_bias")
        return None

    @classmethod
    def make_attention(cls, config, layer_idx: int) -> nn.Module:
        return Attention(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                         num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim)

    @classmethod
    def make_mlp(cls, config, layer_idx: int, expert_shard: ExpertShard | None) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size)

    @classmethod
    def kv_cache_specs(cls, config) -> list[KVCacheSpec]:
        """Each layer's KV cache (:class:`~atom.kv_cache_spec.KVCacheSpec`), from the config
        alone: the engine sizes the pool before it builds the model."""
        return [KVCacheSpec(num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim)
                ] * config.num_hidden_layers

    @classmethod
    def rotary_tables(cls, config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[max_positions, head_dim]`` float32 (:func:`~atom.layers.rotary.rotary_cos_sin`)."""
        return rotary_cos_sin(head_dim=config.head_dim, rope_theta=config.rope_theta,
                              max_positions=max_positions)

    # ----- building -----

    @classmethod
    def from_state_dict(
        cls, config, state_dict: WeightSource, *, dtype: torch.dtype, max_positions: int,
        device: torch.device | str = "cpu", expert_shard: ExpertShard | None = None,
    ) -> DecoderForCausalLM:
        """Build the model from Hugging Face parameter names, fusing QKV and gate/up.

        Args:
            state_dict: HF names (``model.layers.N.self_attn.q_proj.weight``, ...), read one
                tensor at a time (:class:`~atom.layers.weights.WeightSource`); ``lm_head.weight``
                is ignored when the embeddings are tied. Tensors are cast to ``dtype``.
            max_positions: size of the rotary tables (positions ``[0, max_positions)``).
            expert_shard: read and hold only this rank's experts (see the class).
        Raises:
            ValueError: a missing, unexpected or wrongly shaped weight.
        """
        # Meta device first: skips the random init of ~100M parameters we overwrite anyway.
        with torch.device("meta"):
            model = cls(config, max_positions=max_positions, expert_shard=expert_shard)
        _materialize(model, device=device, dtype=dtype)
        params = dict(model.named_parameters())
        reader = CheckpointReader(state_dict)
        if config.tie_word_embeddings:
            del params["lm_head.weight"]
            reader.skip("lm_head.weight")
        for name, tensor in model.checkpoint_weights(reader):
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for a {config.architecture} model")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(params[name].shape)}: check the model's config")
            params[name].data.copy_(tensor)
            del params[name]
        if params:
            raise ValueError(f"missing weights: {sorted(params)[:8]}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        cos, sin = cls.rotary_tables(config, max_positions)
        model.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        model.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        model.requires_grad_(False)
        return model.eval()

    def checkpoint_weights(self, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
        """(this module's parameter name, tensor) for every checkpoint tensor, one at a time:
        q/k/v and gate/up fused, each MoE layer's experts in either layout (only the local
        ones), the rest under their own names."""
        for i, layer in enumerate(self.layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            yield ours + "self_attn.qkv_proj.weight", concat(
                reader, (f"{hf}self_attn.{n}_proj.weight" for n in "qkv"))
            if f"{hf}self_attn.q_proj.bias" in reader:  # attention biases (gpt-oss)
                yield ours + "self_attn.qkv_proj.bias", concat(
                    reader, (f"{hf}self_attn.{n}_proj.bias" for n in "qkv"))
            mlp = layer.mlp
            if isinstance(mlp, GatedMLP):
                yield ours + "mlp.gate_up_proj.weight", concat(
                    reader, (f"{hf}mlp.{n}_proj.weight" for n in ("gate", "up")))
            elif isinstance(mlp, MoE):
                for name, tensor in self.read_moe(reader, hf, mlp).items():
                    yield ours + "mlp." + name, tensor
        yield from passthrough(reader)

    def read_moe(self, reader: CheckpointReader, prefix: str, moe: MoE) -> dict[str, torch.Tensor]:
        """One MoE layer's router and local experts, under the :class:`MoE`'s parameter names;
        ``prefix`` is the layer's (``model.layers.N.``). By default either layout of
        :func:`~atom.layers.weights.read_experts` named by :attr:`expert_names`; a family whose
        checkpoints store experts otherwise (gpt-oss) overrides this."""
        assert self.expert_names is not None, f"{type(self).__name__} has no expert_names"
        return read_experts(reader, prefix, self.expert_names, num_experts=moe.num_experts,
                            start=moe.expert_start, end=moe.expert_start + moe.num_local_experts)

    def pack_weights(self) -> None:
        """Swap every :class:`~atom.layers.linear.Linear`'s weight for oneDNN's packed copy
        (faster GEMMs on CPU, :mod:`atom.kernels.linear`). Call once the model is final (after
        any MoE split, which reads the dense MLP weights). With tied embeddings the LM head
        keeps a packed copy of the embedding matrix, which the embedding lookup still reads.
        MoE layers whose experts run fused (:meth:`~atom.layers.moe.MoE.fuse_experts`) keep
        their experts' weights stacked for that kernel instead."""
        fused = {id(linear) for layer in self.modules()
                 if isinstance(layer, MoE) and layer.fuse_experts()
                 for linear in layer.local_experts.modules()}
        for module in self.modules():
            if isinstance(module, Linear) and id(module) not in fused:
                module.pack_weight()

    # ----- running -----

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of int64 ``[T]`` ids: ``[T, hidden]`` in the run dtype."""
        return self.embed_tokens(input_ids)

    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor],
                       kv_cache_groups: Sequence[int] | None = None) -> None:
        """Bind each layer's KV cache (runner-owned; shapes from :meth:`kv_cache_specs`) and,
        for a hybrid model, its KV cache group (:mod:`atom.kv_cache_spec`; None: all group 0)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            layer.self_attn.kv_cache = cache
            if kv_cache_groups is not None:
                layer.self_attn.kv_cache_group = kv_cache_groups[i]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
        *, num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]``. Returns the final-norm hidden states ``[T, hidden]``
        in the run dtype. Writes the new tokens' K/V (non-padding slots) to every layer's cache.

        ``num_layers``: run only the first this many layers, then the final norm (the early-exit
        draft of speculative decoding, :mod:`atom.worker.draft_proposer`); None = all."""
        x = self.embed(input_ids)
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        return self.norm(self.run_layers(layers, x, cos, sin, attn_metadata))

    def run_layers(self, layers: Sequence[DecoderLayer], x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x`` ``[T, hidden]`` through ``layers`` in order."""
        for layer in layers:
            x = layer(x, cos, sin, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[S, hidden]`` run dtype → logits ``[S, vocab]`` float32 (GEMM in run dtype,
        as Hugging Face does, then upcast)."""
        return self.lm_head(hidden).float()


def _materialize(model: nn.Module, *, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give every meta-device parameter and buffer of ``model`` uninitialised storage on
    ``device``: floating-point ones in ``dtype``, the others in their own dtype; a tensor shared
    by two modules stays shared. What ``model.to_empty(device=device).to(dtype)`` does, without
    its path through torch's reference ``empty_like``, whose first call imports sympy (about
    0.4 s of every engine start)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            if id(tensor) not in made:
                empty = torch.empty(tensor.shape, device=device,
                                    dtype=dtype if tensor.is_floating_point() else tensor.dtype)
                made[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else empty)
            setattr(module, name, made[id(tensor)])
