"""DeepSeek-V2 and DeepSeek-V3 (DeepSeek-V2, arXiv:2405.04434; DeepSeek-V3, arXiv:2412.19437;
transformers' ``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py`` are the references).

The shared pre-norm decoder (:class:`atom.layers.decoder.DecoderForCausalLM`) with:

- **multi-head latent attention** (:class:`atom.layers.mla.MLAttention`) in every layer, over a
  paged latent cache of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer
  (:meth:`DeepseekV3ForCausalLM.kv_cache_specs`; 576 for DeepSeek-V3's 512 + 64); prefill
  expands the latent to per-head K/V, decode attends in the latent space;
- the rotary embedding over ``qk_rope_head_dim`` values, optionally YaRN (DeepSeek's
  ``mscale`` / ``mscale_all_dim``), and the softmax scale ``(Dn + Dr) ** -0.5`` times
  ``mscale(factor, mscale_all_dim) ** 2`` under YaRN;
- dense MLPs in the first ``first_k_dense_replace`` layers, then **DeepSeekMoE**
  (:class:`DeepSeekMoE`): ``n_routed_experts`` routed experts of ``moe_intermediate_size``
  and ``n_shared_experts`` shared ones (one MLP ``moe_intermediate_size * n_shared_experts``
  wide) that every token runs, on its own rank under expert parallelism (no collective);
- routing (:func:`noaux_tc_topk`, :func:`softmax_group_topk`): DeepSeek-V3's ``noaux_tc``
  (sigmoid scores, a correction bias for the selection only, group-limited top-k, weights from
  the unbiased scores, renormalized iff ``norm_topk_prob``, times ``routed_scaling_factor``);
  DeepSeek-V2's softmax ``greedy`` / ``group_limited_greedy``.

The multi-token-prediction layers of a checkpoint (``num_nextn_predict_layers``: the layers
numbered from ``num_hidden_layers`` on) are read past here; with ``--speculative-method mtp``
:meth:`DeepseekV3ForCausalLM.load_mtp` builds them as the drafter
(:mod:`atom.models.deepseek_mtp`). Not supported (refused at
load): FP8 block-scaled checkpoints (``quantization_config``), ``attention_bias``,
``moe_layer_freq`` other than 1, rope scaling other than YaRN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from atom.kv_cache_spec import KVCacheSpec
from atom.layers.decoder import DecoderForCausalLM
from atom.layers.mla import MLAttention, deinterleave_rows
from atom.layers.mlp import GatedMLP
from atom.layers.moe import ExpertShard, MoE, Pending
from atom.layers.rotary import YarnScaling, rotary_cos_sin, yarn_inv_freq
from atom.layers.weights import CheckpointReader, ExpertNames, concat, passthrough

TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek-V2/V3's own settings (``config.json``).

    Attributes:
        q_lora_rank: the query's low rank, or None (a plain ``q_proj``).
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA's widths (R, Dn,
            Dr, Dv).
        rope_interleave: the checkpoint rotates interleaved pairs (V2 always; V3's flag).
        yarn: YaRN rotary scaling, or None.
        num_experts, num_shared_experts, num_experts_per_tok, moe_intermediate_size: the MoE.
        first_k_dense_replace: the first this many layers are dense.
        topk_method: one of :data:`TOPK_METHODS`.
        n_group, topk_group: expert groups, and how many of them a token may use.
        norm_topk_prob: renormalize the k gates to sum to 1 (before the scaling).
        routed_scaling_factor: the routed experts' output multiplier.
        num_nextn_predict_layers: the checkpoint's multi-token-prediction layers (numbered
            from ``num_hidden_layers`` on; :mod:`atom.models.deepseek_mtp`), 0 = none.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    yarn: YarnScaling | None
    num_experts: int
    num_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int = 0

    def softmax_scale(self) -> float:
        """``(Dn + Dr) ** -0.5``, times ``mscale ** 2`` with ``mscale = 0.1 mscale_all_dim
        ln(factor) + 1`` under YaRN when ``mscale_all_dim`` is set (DeepSeek-V2's
        ``yarn_get_mscale``)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        yarn = self.yarn
        if yarn is not None and yarn.mscale_all_dim and yarn.factor > 1:
            mscale = 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0
            scale *= mscale * mscale
        return scale


def parse_deepseek_config(hf, *, v3: bool) -> DeepseekConfig:
    """:class:`DeepseekConfig` from an :class:`atom.worker.model_loader.HFConfig`.

    Raises:
        ValueError: a required key missing; FP8 (any ``quantization_config``),
            ``attention_bias``, ``moe_layer_freq`` != 1, a rope scaling other than YaRN, an
            unknown ``topk_method`` or ``scoring_func``, or experts not divisible into
            ``n_group`` groups (each message names the key and the file).
    """
    if hf.get("quantization_config") is not None:
        raise ValueError(f"{hf.source}: quantization_config {hf.get('quantization_config')!r} "
                         f"is not supported for {hf.architecture} (FP8 block-scaled weights are "
                         f"not supported yet): use a bfloat16 or float32 checkpoint")
    hf.reject_true("attention_bias")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{hf.source}: moe_layer_freq={hf.get('moe_layer_freq')} is not "
                         f"supported (1 only)")
    rope = hf.rope()
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{hf.source}: rope scaling {rope_type!r} is not supported for "
                         f"{hf.architecture} (default or yarn)")
    topk_method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"{hf.source}: topk_method={topk_method!r}: use one of {TOPK_METHODS}")
    scoring = hf.get("scoring_func") or ("sigmoid" if topk_method == "noaux_tc" else "softmax")
    if scoring != ("sigmoid" if topk_method == "noaux_tc" else "softmax"):
        raise ValueError(f"{hf.source}: scoring_func={scoring!r} with topk_method="
                         f"{topk_method!r} is not supported")
    num_experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if num_experts is None:
        hf.required("n_routed_experts")  # raises, naming the key
    n_group = int(hf.get("n_group") or 1)
    if num_experts % n_group:
        raise ValueError(f"{hf.source}: n_routed_experts={num_experts} is not a multiple of "
                         f"n_group={n_group}")
    return DeepseekConfig(
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf.required("kv_lora_rank"),
        qk_nope_head_dim=hf.required("qk_nope_head_dim"),
        qk_rope_head_dim=hf.required("qk_rope_head_dim"), v_head_dim=hf.required("v_head_dim"),
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        yarn=(YarnScaling.from_rope_parameters(
            rope, max_position_embeddings=hf.get("max_position_embeddings", 4096))
              if rope_type == "yarn" else None),
        num_experts=int(num_experts), num_shared_experts=int(hf.get("n_shared_experts") or 0),
        num_experts_per_tok=hf.required("num_experts_per_tok"),
        moe_intermediate_size=hf.required("moe_intermediate_size"),
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        topk_method=topk_method, n_group=n_group, topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0))


# ----- routing -----


def _group_mask(choice: torch.Tensor, group_scores: torch.Tensor,
                topk_group: int) -> torch.Tensor:
    """bool ``[N, E]``: the experts of the ``topk_group`` best groups of each token."""
    num_groups = group_scores.shape[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return keep.repeat_interleave(choice.shape[1] // num_groups, dim=1)


def noaux_tc_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, *, top_k: int,
                  n_group: int, topk_group: int, renormalize: bool,
                  scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (``topk_method: noaux_tc``; DeepSeek-V3 report, section 2.1.2).

    Sigmoid scores; ``correction_bias`` is added for the *selection* only: each of ``n_group``
    groups scores the sum of its two best biased scores, the ``topk_group`` best groups are
    kept, the top-k biased scores among their experts chosen. The gates are the chosen
    experts' *unbiased* scores, renormalized to sum to 1 iff ``renormalize``, times
    ``scaling_factor``.

    Args:
        router_logits: ``[N, E]``; correction_bias: ``[E]``.
    Returns:
        (expert ids int64 ``[N, k]``, gates float32 ``[N, k]``).
    """
    scores = torch.sigmoid(router_logits.float())
    choice = scores + correction_bias.float()
    # explicit sizes: a micro-batch of no tokens (a dummy step's TBO half) has zero rows
    groups = choice.view(choice.shape[0], n_group, choice.shape[1] // n_group)
    group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(choice, group_scores, topk_group), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    gates = scores.gather(1, ids)
    if renormalize:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, gates * scaling_factor


def softmax_group_topk(router_logits: torch.Tensor, *, top_k: int, n_group: int,
                       topk_group: int, grouped: bool, renormalize: bool,
                       scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing: a softmax over all experts in float32, then the top-k
    (``greedy``), or with ``grouped`` (``group_limited_greedy``) the top-k among the experts of
    the ``topk_group`` groups whose best score is highest; renormalized iff ``renormalize``,
    times ``scaling_factor``.

    Args:
        router_logits: ``[N, E]``.
    Returns:
        (expert ids int64 ``[N, k]``, gates float32 ``[N, k]``).
    """
    scores = torch.softmax(router_logits.float(), dim=-1)
    if grouped:
        group_scores = scores.view(scores.shape[0], n_group,
                                   scores.shape[1] // n_group).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(scores, group_scores, topk_group), 0.0)
    gates, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, gates * scaling_factor


class DeepSeekMoE(MoE):
    """:class:`~atom.layers.moe.MoE` with DeepSeek's routing and shared experts.

    The routed experts go through the MoE's stages (dispatch, route, experts, combine: expert
    parallel like every family); the shared experts (``shared_experts``, a
    :class:`~atom.layers.mlp.GatedMLP`, absent when ``n_shared_experts`` is 0) run on this
    rank's own tokens and are added after the combine, so they need no collective.

    Parameters: as :class:`MoE`, plus ``e_score_correction_bias`` ``[E]`` (``noaux_tc`` only)
    and ``shared_experts.gate_up_proj.weight`` / ``down_proj.weight``.
    """

    def __init__(self, family: DeepseekConfig, *, hidden_size: int,
                 expert_shard: ExpertShard | None) -> None:
        super().__init__(hidden_size=hidden_size, intermediate_size=family.moe_intermediate_size,
                         num_experts=family.num_experts, top_k=family.num_experts_per_tok,
                         renormalize=family.norm_topk_prob, expert_shard=expert_shard)
        self.family = family
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(family.num_experts), requires_grad=False)
            if family.topk_method == "noaux_tc" else None)
        self.shared_experts = (
            GatedMLP(hidden_size, family.moe_intermediate_size * family.num_shared_experts)
            if family.num_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, hidden]`` → (expert ids int64 ``[N, k]``, gates float32 ``[N, k]``)."""
        f = self.family
        logits = self.router(x)
        if self.e_score_correction_bias is not None:
            return noaux_tc_topk(logits, self.e_score_correction_bias, top_k=self.top_k,
                                 n_group=f.n_group, topk_group=f.topk_group,
                                 renormalize=f.norm_topk_prob,
                                 scaling_factor=f.routed_scaling_factor)
        return softmax_group_topk(logits, top_k=self.top_k, n_group=f.n_group,
                                  topk_group=f.topk_group,
                                  grouped=f.topk_method == "group_limited_greedy",
                                  renormalize=f.norm_topk_prob,
                                  scaling_factor=f.routed_scaling_factor)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` → ``[T, hidden]``: routed (across ranks) plus shared (local)."""
        routed = super().forward(x)
        shared = self._shared(x)
        return routed if shared is None else routed + shared

    def forward_overlapped(self, x: torch.Tensor) -> Iterator[Pending]:
        """:meth:`MoE.forward_overlapped` plus the shared experts, which run while the
        dispatch is in flight (two-batch overlap)."""
        if self.dispatcher is None:
            return self(x)
        pending = self.dispatcher.dispatch_async(x)
        shared = self._shared(x)
        yield pending
        tokens = pending.result()
        ids, gates = self.route(tokens)
        pending = self.dispatcher.combine_async(self.experts(tokens, ids, gates))
        yield pending
        routed = pending.result()
        return routed if shared is None else routed + shared


# ----- the models -----


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3: :class:`~atom.layers.decoder.DecoderForCausalLM` with
    :class:`~atom.layers.mla.MLAttention`, dense first layers and :class:`DeepSeekMoE`."""

    expert_names = ExpertNames()  # mlp.experts.{e}.gate_proj / up_proj / down_proj, mlp.gate
    is_v3 = True
    #: decode in the latent space (False: the expanded path, every layer's ``absorb``)
    absorb = True

    @classmethod
    def parse_family_config(cls, hf) -> DeepseekConfig:
        return parse_deepseek_config(hf, v3=cls.is_v3)

    @classmethod
    def make_attention(cls, config, layer_idx: int) -> nn.Module:
        f = config.family
        return MLAttention(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                           q_lora_rank=f.q_lora_rank, kv_lora_rank=f.kv_lora_rank,
                           qk_nope_head_dim=f.qk_nope_head_dim,
                           qk_rope_head_dim=f.qk_rope_head_dim, v_head_dim=f.v_head_dim,
                           scale=f.softmax_scale(), absorb=cls.absorb)

    @classmethod
    def make_mlp(cls, config, layer_idx: int, expert_shard: ExpertShard | None) -> nn.Module:
        family = config.family
        if layer_idx < family.first_k_dense_replace:
            return GatedMLP(config.hidden_size, config.intermediate_size)
        return DeepSeekMoE(family, hidden_size=config.hidden_size, expert_shard=expert_shard)

    @classmethod
    def kv_cache_specs(cls, config) -> list[KVCacheSpec]:
        """One latent of ``kv_lora_rank + qk_rope_head_dim`` values per token in every layer."""
        f = config.family
        return [KVCacheSpec(num_kv_heads=1, head_dim=f.kv_lora_rank + f.qk_rope_head_dim,
                            latent=True)] * config.num_hidden_layers

    @classmethod
    def rotary_tables(cls, config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[max_positions, qk_rope_head_dim]`` float32, YaRN-scaled when set."""
        f = config.family
        dim = f.qk_rope_head_dim
        if f.yarn is None:
            return rotary_cos_sin(head_dim=dim, rope_theta=config.rope_theta,
                                  max_positions=max_positions)
        return rotary_cos_sin(
            head_dim=dim, rope_theta=config.rope_theta, max_positions=max_positions,
            inv_freq=yarn_inv_freq(head_dim=dim, rope_theta=config.rope_theta, yarn=f.yarn),
            attention_factor=f.yarn.resolved_attention_factor())

    @classmethod
    def from_state_dict(cls, config, state_dict, **kwargs) -> DeepseekV3ForCausalLM:
        """:meth:`DecoderForCausalLM.from_state_dict`, then each attention's unpacked
        up-projection blocks (:meth:`MLAttention.prepare_absorbed`)."""
        model = super().from_state_dict(config, state_dict, **kwargs)
        for layer in model.layers:
            layer.self_attn.prepare_absorbed()
        return model

    def load_mtp(self, weights, *, num_layers: int, dtype: torch.dtype,
                 expert_shard: ExpertShard | None = None) -> nn.Module:
        """The checkpoint's first ``num_layers`` multi-token-prediction layers beside this
        model (:meth:`atom.models.deepseek_mtp.DeepseekMTP.from_checkpoint`)."""
        from atom.models.deepseek_mtp import DeepseekMTP

        return DeepseekMTP.from_checkpoint(self, weights, num_layers=num_layers, dtype=dtype,
                                           expert_shard=expert_shard)

    def checkpoint_weights(self, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, tensor) for every checkpoint tensor: the attention's rotary rows
        de-interleaved (:func:`~atom.layers.mla.deinterleave_rows`) when the checkpoint
        interleaves them, gate/up fused, each MoE layer's local experts (either layout), its
        correction bias and shared experts; the multi-token-prediction layers skipped."""
        num_layers = self.config.num_hidden_layers
        for name in reader.unread():  # MTP layers: model.layers.{num_layers + i}.*
            parts = name.split(".")
            if name.startswith("model.layers.") and int(parts[2]) >= num_layers:
                reader.skip(name)
        for i, layer in enumerate(self.layers):
            yield from self.layer_weights(reader, layer, hf=f"model.layers.{i}.",
                                          ours=f"layers.{i}.")
        yield from passthrough(reader)

    def layer_weights(self, reader: CheckpointReader, layer: nn.Module, *, hf: str, ours: str
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """One decoder layer's tensors that need more than a rename (``hf``: its checkpoint
        prefix, ``model.layers.N.``; ``ours``: its parameter prefix): the attention's rotary
        rows, gate/up fused, the MoE's local experts, correction bias and shared experts. An
        MTP layer's block reads through here too (:mod:`atom.models.deepseek_mtp`)."""
        f = self.config.family
        yield from self._attention_weights(reader, hf + "self_attn.", ours + "self_attn.", f)
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            yield ours + "mlp.gate_up_proj.weight", concat(
                reader, (f"{hf}mlp.{n}_proj.weight" for n in ("gate", "up")))
            return
        for name, tensor in self.read_moe(reader, hf, mlp).items():
            yield ours + "mlp." + name, tensor
        if mlp.e_score_correction_bias is not None:
            yield (ours + "mlp.e_score_correction_bias",
                   reader.take(hf + "mlp.gate.e_score_correction_bias"))
        if mlp.shared_experts is not None:
            shared = hf + "mlp.shared_experts."
            yield ours + "mlp.shared_experts.gate_up_proj.weight", concat(
                reader, (f"{shared}{n}_proj.weight" for n in ("gate", "up")))

    def _attention_weights(self, reader: CheckpointReader, hf: str, ours: str,
                           f: DeepseekConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """One layer's MLA projections whose rows hold rotary values, de-interleaved if need
        be (the other attention tensors pass through under their own names)."""
        qk_dim = f.qk_nope_head_dim + f.qk_rope_head_dim
        q_name = "q_proj" if f.q_lora_rank is None else "q_b_proj"
        q = reader.take(f"{hf}{q_name}.weight")
        kv_a = reader.take(f"{hf}kv_a_proj_with_mqa.weight")
        if f.rope_interleave:
            q = deinterleave_rows(q, row_start=f.qk_nope_head_dim, rope_dim=f.qk_rope_head_dim,
                                  stride=qk_dim, count=self.config.num_attention_heads)
            kv_a = deinterleave_rows(kv_a, row_start=f.kv_lora_rank, rope_dim=f.qk_rope_head_dim,
                                     stride=0, count=1)
        yield f"{ours}{q_name}.weight", q
        yield f"{ours}kv_a_proj_with_mqa.weight", kv_a


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 (and V2-Lite: ``q_lora_rank`` null): as DeepSeek-V3 with softmax routing
    (``greedy`` / ``group_limited_greedy``) and no correction bias."""

    is_v3 = False
