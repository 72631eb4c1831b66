"""Mixture-of-experts MLP (Mixtral / Qwen-MoE style) with its stages exposed.

A :class:`MoE` layer replaces a dense MLP: a router (linear ``[E, hidden]``) scores every token,
the top-k experts are chosen, and each chosen expert (a SiLU-gated MLP) contributes its output
times its gate. Routing functions (small, tested one by one in tests/layers/test_moe.py):

- :func:`softmax_topk`: softmax over all experts in float32, top-k, renormalized over the k when
  ``renormalize`` (Mixtral, Mistral AI 2024, arXiv:2401.04088: always; Qwen3-MoE: iff its
  config's ``norm_topk_prob``);
- :func:`unit_routing`: every token to the first k experts with gate 1 (model (a) of
  docs/ARCHITECTURE.md: a dense MLP split along its intermediate dimension, every token to all
  experts, which sums back to the dense MLP);
- :func:`topk_then_softmax`: top-k of the raw logits, softmax over those k only (gpt-oss, whose
  router has a bias: :class:`TopKSoftmaxMoE`).

The forward is four stages, so an executor can interleave them across micro-batches
(:mod:`atom.worker.tbo`, which uses the ``*_async`` forms of dispatch and combine)::

    tokens = self.dispatch(x)           # this rank's tokens → every rank's (expert parallel)
    ids, gates = self.route(tokens)     # top-k expert ids and gates per token
    partial = self.experts(tokens, ids, gates)  # this rank's experts only
    y = self.combine(partial)           # sum over ranks, back to this rank's tokens

(:meth:`MoE.forward_overlapped` is that sequence as a generator that yields at each collective.)

On one rank ``dispatch`` and ``combine`` are the identity and every expert is local. Under expert
parallelism each rank holds only its slice of the experts (:func:`expert_range`): built so at load
(:class:`ExpertShard`; :func:`load_expert_weights` reads only that slice of the checkpoint, in
either layout), or cut later by :meth:`MoE.shard_experts`; and
:func:`atom.dp.expert_parallel.apply_expert_parallel` installs a :class:`Dispatcher` that moves
tokens between ranks. The model code has no expert-parallel branches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from atom.kernels.moe import (fused_moe, fused_moe_applies, fused_moe_packed, pack_experts,
                              packed_layout_applies)
from atom.layers.linear import Linear
from atom.layers.mlp import GatedMLP

GATE_MODES = ("softmax", "unit")


class Pending(Protocol):
    """Tokens an async collective is filling."""

    def wait(self) -> None: ...

    def result(self) -> torch.Tensor: ...


class Dispatcher(Protocol):
    """Moves tokens between ranks around the expert computation (expert parallelism)."""

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens ``[T, hidden]`` → the tokens every local expert must see."""

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial outputs of the local experts for the dispatched tokens → this rank's
        outputs ``[T, hidden]`` summed over every rank's experts."""

    def dispatch_async(self, x: torch.Tensor) -> Pending:
        """:meth:`dispatch` with its collective left in flight (two-batch overlap)."""

    def combine_async(self, partial: torch.Tensor) -> Pending:
        """:meth:`combine` with its collective left in flight (two-batch overlap)."""


class ExpertPlacement(Protocol):
    """Where each routed expert is computed, when experts are re-placed or replicated across
    ranks (expert-parallel load balancing, :mod:`atom.dp.eplb`, installs one per layer)."""

    def to_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids int64 ``[N, k]`` of the dispatched tokens → the physical expert slot
        that computes each, int64 ``[N, k]`` (the slots ``local_experts`` holds are
        ``expert_start ..``)."""


class FusedExperts(nn.Module):
    """A layer's local :class:`~atom.layers.mlp.GatedMLP` experts as two stacked weights, run
    in one compiled call. :meth:`MoE.fuse_experts` builds it. Two layouts, the weights held once
    in either:

    - rows (``packed`` False): ``w13`` ``[E_local, 2 * intermediate, hidden]`` (gate rows, then
      up) and ``w2`` ``[E_local, hidden, intermediate]``, run dtype, contiguous, run by
      :func:`atom.kernels.moe.fused_moe`; the experts' own ``weight`` parameters are views of
      these rows;
    - packed (``packed`` True, bfloat16 where
      :func:`~atom.kernels.moe.packed_layout_applies`): ``w13`` ``[E_local, I/16, H/2, 32, 2]``
      and ``w2`` ``[E_local, H/32, I/2, 32, 2]`` (:func:`~atom.kernels.moe.pack_experts`), run by
      :func:`~atom.kernels.moe.fused_moe_packed` (oneDNN's brgemm, AMX tiles where the CPU has
      them); the experts' linears read their weights back from these blocks on demand
      (:class:`PackedExpertRows`: EPLB's moves, checks).
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, packed: bool = False) -> None:
        super().__init__()
        self.w13, self.w2, self.packed = w13, w2, packed

    def forward(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """x ``[N, hidden]``, local expert ids int64 ``[N, k]`` (outside ``[0, E_local)``:
        another rank's), gates float32 ``[N, k]`` → ``[N, hidden]`` in x's dtype."""
        if self.packed:
            return fused_moe_packed(x, self.w13, self.w2, ids, gates)
        return fused_moe(x, self.w13, self.w2, ids, gates)


class PackedExpertRows:
    """One expert's ``gate_up_proj`` or ``down_proj`` weight inside a layer's packed blocks
    (:class:`FusedExperts`, packed): what the expert's :class:`~atom.layers.linear.Linear` holds
    as its ``packed_weight`` then, so :meth:`~atom.layers.linear.Linear.dense_weight` reads the
    ``[out, in]`` rows back (a new tensor) and nothing holds them twice. The expert's own forward
    does not run on it (the layer's fused call does)."""

    def __init__(self, blocks: torch.Tensor, index: int, *, gate_up: bool) -> None:
        self.blocks, self.index, self.gate_up = blocks, index, gate_up
        self.dtype, self.device = blocks.dtype, blocks.device

    def to_dense(self) -> torch.Tensor:
        b = self.blocks[self.index].permute(0, 2, 1, 3)  # [N/32, 32, K/2, 2]
        rows = b.reshape(b.shape[0], 32, -1)
        if not self.gate_up:
            return rows.reshape(-1, rows.shape[-1]).contiguous()
        hidden = rows.shape[-1]
        return torch.cat([rows[:, :16].reshape(-1, hidden), rows[:, 16:].reshape(-1, hidden)])


# ----- routing -----


def softmax_topk(router_logits: torch.Tensor, top_k: int, *,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, then the top-k; the k gates renormalized to sum to
    1 when ``renormalize`` (Mixtral always; Qwen3-MoE iff ``norm_topk_prob``, Hugging Face's
    ``Qwen3MoeTopKRouter``).

    Args:
        router_logits: ``[N, E]``, any float dtype.
    Returns:
        (expert ids int64 ``[N, k]``, gates float32 ``[N, k]``), highest gate first.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    gates, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return ids, gates


def unit_routing(num_tokens: int, top_k: int, *,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Every token to experts ``0 .. k-1`` with gate 1 (model (a): a dense MLP split into
    experts): (ids int64 ``[N, k]``, gates float32 ``[N, k]``)."""
    ids = torch.arange(top_k, device=device).expand(num_tokens, top_k)
    return ids, torch.ones(num_tokens, top_k, device=device)


# ----- expert parallelism: which experts a rank holds -----


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """The experts ``[start, end)`` rank ``rank`` owns: contiguous, sizes differing by ≤ 1.

    Raises:
        ValueError: fewer experts than ranks (a rank would own none).
    """
    if num_experts < world_size:
        raise ValueError(f"{num_experts} experts cannot be sharded over {world_size} ranks: "
                         f"need at least one expert per rank")
    return rank * num_experts // world_size, (rank + 1) * num_experts // world_size


@dataclass(frozen=True)
class ExpertShard:
    """This rank's share of every MoE layer's experts under expert parallelism: rank ``rank``
    of ``world_size`` (the DP ranks) holds :func:`expert_range` of each layer's experts, and
    only those are read from the checkpoint."""

    rank: int
    world_size: int

    def range(self, num_experts: int) -> tuple[int, int]:
        return expert_range(num_experts, self.rank, self.world_size)


class MoE(nn.Module):
    """Top-k mixture of SiLU-gated experts.

    Args:
        hidden_size, intermediate_size: per expert (``intermediate_size`` of one expert).
        num_experts: E, experts of the whole model.
        top_k: experts per token (``top_k == num_experts`` with unit gates: all of them).
        gate_mode: ``"softmax"`` (:func:`softmax_topk`) or ``"unit"`` (:func:`unit_routing`).
        renormalize: with ``"softmax"``, renormalize the k gates (:func:`softmax_topk`).
        expert_shard: hold only this rank's experts (expert parallelism); None = all.
        expert_class: one expert, built as ``expert_class(hidden_size, intermediate_size)``,
            mapping ``[n, hidden]`` to ``[n, hidden]``; a family whose experts differ (biases, a
            clamped activation) passes its own (a class, or a ``functools.partial`` of one).

    Parameters (run dtype): ``router.weight`` ``[E, hidden]`` (absent with unit gates) and one
    expert module per local expert, ``local_experts[i]`` being expert ``expert_start + i`` (with a
    ``placement``: physical slot ``expert_start + i``, holding the expert the placement says); the
    default :class:`~atom.layers.mlp.GatedMLP` has ``gate_up_proj.weight``
    ``[2 * intermediate, hidden]`` (gate rows first, then up) and ``down_proj.weight``
    ``[hidden, intermediate]``. Where the fused MoE kernel runs (AVX-512 CPUs),
    :meth:`fuse_experts` (called by the model's ``pack_weights``) stacks those weights for one
    compiled call a layer (:class:`FusedExperts`); elsewhere every expert's linears are packed
    for oneDNN like the dense ones and run the fused SiLU-and-mul.

    Raises:
        ValueError: ``top_k`` outside ``[1, num_experts]``, an unknown ``gate_mode``, or fewer
            experts than ranks.
    """

    def __init__(self, *, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, gate_mode: str = "softmax", renormalize: bool = True,
                 expert_shard: ExpertShard | None = None,
                 expert_class: Callable[[int, int], nn.Module] = GatedMLP) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode={gate_mode!r}: use one of {GATE_MODES}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate_mode = gate_mode
        self.renormalize = renormalize
        self.router = Linear(hidden_size, num_experts) if gate_mode == "softmax" else None
        start, end = (0, num_experts) if expert_shard is None else expert_shard.range(num_experts)
        self.local_experts = nn.ModuleList(expert_class(hidden_size, intermediate_size)
                                           for _ in range(start, end))
        self.expert_start = start
        self.expert_class = expert_class
        self.dispatcher: Dispatcher | None = None
        self.placement: ExpertPlacement | None = None
        self.fused_experts: FusedExperts | None = None

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    def set_expert_weights(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy the local experts' weights in: ``gate_up`` ``[E_local, 2 * intermediate,
        hidden]``, ``down`` ``[E_local, hidden, intermediate]`` (transformers v5's fused layout,
        cut to this rank's experts).

        Raises:
            ValueError: the shapes do not match the local experts.
        """
        if gate_up.shape[0] != self.num_local_experts or down.shape[0] != self.num_local_experts:
            raise ValueError(f"{gate_up.shape[0]} / {down.shape[0]} experts' weights for "
                             f"{self.num_local_experts} local experts")
        for expert, gu, d in zip(self.local_experts, gate_up, down):
            expert.gate_up_proj.weight.data.copy_(gu)
            expert.down_proj.weight.data.copy_(d)

    def fuse_experts(self) -> bool:
        """Run the local experts as one :class:`FusedExperts` call from now on, where they are
        plain :class:`~atom.layers.mlp.GatedMLP` s on float weights and
        :func:`~atom.kernels.moe.fused_moe_applies` (AVX-512 CPU builds); each expert's linear
        weights become views of its rows (oneDNN's packed copies dropped), or, where
        :func:`~atom.kernels.moe.packed_layout_applies` (bfloat16, AVX512-BF16 builds), read
        back from the layer's packed blocks on demand (:class:`PackedExpertRows`). Call it again after
        the local experts change (:meth:`shard_experts`, an EPLB move); it keeps the same
        :class:`FusedExperts` module. Returns whether the layer is fused."""
        experts = list(self.local_experts)
        linears = [linear for e in experts for linear in (e.gate_up_proj, e.down_proj)
                   if type(e) is GatedMLP]
        if (len(linears) != 2 * len(experts) or any(x.qweight is not None for x in linears)
                or not fused_moe_applies(linears[0].dtype, linears[0].device)):
            self.fused_experts = None
            return False
        w13 = torch.stack([e.gate_up_proj.dense_weight() for e in experts])
        w2 = torch.stack([e.down_proj.dense_weight() for e in experts])
        packed = packed_layout_applies(w13.dtype, self.hidden_size, self.intermediate_size,
                                       w13.device)
        if packed:  # the stacked rows are dropped when this returns
            w13, w2 = pack_experts(w13, w2)
        for i, expert in enumerate(experts):
            if packed:
                for linear, blocks, gate_up in ((expert.gate_up_proj, w13, True),
                                                (expert.down_proj, w2, False)):
                    linear.weight, linear.small_rows = None, 0
                    linear.packed_weight = PackedExpertRows(blocks, i, gate_up=gate_up)
            else:
                expert.gate_up_proj.set_weight(w13[i])
                expert.down_proj.set_weight(w2[i])
        if self.fused_experts is None:
            self.fused_experts = FusedExperts(w13, w2, packed=packed)
        else:
            self.fused_experts.w13, self.fused_experts.w2 = w13, w2
            self.fused_experts.packed = packed
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` → ``[T, hidden]``, same dtype."""
        tokens = self.dispatch(x)
        ids, gates = self.route(tokens)
        return self.combine(self.experts(tokens, ids, gates))

    def forward_overlapped(self, x: torch.Tensor) -> Iterator[Pending]:
        """:meth:`forward` as a generator for two-batch overlap (:mod:`atom.worker.tbo`): it
        yields right after starting each collective (dispatch, combine) and returns the output
        ``[T, hidden]`` (``y = yield from moe.forward_overlapped(x)``). Without a dispatcher it
        yields nothing."""
        if self.dispatcher is None:
            return self(x)
        pending = self.dispatcher.dispatch_async(x)
        yield pending
        tokens = pending.result()
        ids, gates = self.route(tokens)
        pending = self.dispatcher.combine_async(self.experts(tokens, ids, gates))
        yield pending
        return pending.result()

    # ----- stages -----

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.dispatcher is None else self.dispatcher.dispatch(x)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.dispatcher is None else self.dispatcher.combine(partial)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, hidden]`` → (expert ids int64 ``[N, k]``, gates float32 ``[N, k]``)."""
        if self.gate_mode == "unit":
            return unit_routing(x.shape[0], self.top_k, device=x.device)
        return softmax_topk(self.router(x), self.top_k, renormalize=self.renormalize)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The local experts' gated outputs for ``x`` ``[N, hidden]``, summed per token (zeros
        where a token chose no local expert); ``[N, hidden]`` in x's dtype.

        The ``N * k`` (token, expert) pairs are sorted by expert once, so each expert with work
        runs on one contiguous slice of gathered rows (three ops: its fused gate/up GEMM,
        SiLU-and-mul, down GEMM), and the weighted outputs go back to their pairs with one
        ``index_copy_`` and are summed over the k slots (no per-expert scatter-add). With a
        ``placement``, ``ids`` go to their physical slots first. A fused layer
        (:meth:`fuse_experts`) does all of it in one compiled call."""
        if self.placement is not None:
            ids = self.placement.to_slots(ids)
        if self.fused_experts is not None:
            return self.fused_experts(x, ids - self.expert_start if self.expert_start else ids,
                                      gates)
        n, k = ids.shape
        out = x.new_zeros(n * k, x.shape[1])
        local = (ids - self.expert_start).flatten()
        num_local = self.num_local_experts
        mine = (local >= 0) & (local < num_local)
        counts = torch.bincount(local[mine], minlength=num_local).tolist()
        num_pairs = sum(counts)
        if num_pairs:
            # the pairs of local experts first, grouped by expert; the others after them
            pairs = torch.argsort(torch.where(mine, local, num_local), stable=True)[:num_pairs]
            rows = x.index_select(0, pairs // k)
            outputs, start = [], 0
            for expert, count in zip(self.local_experts, counts):
                if count:
                    outputs.append(expert(rows[start:start + count]))
                    start += count
            weighted = torch.cat(outputs) * gates.flatten()[pairs, None].to(x.dtype)
            out.index_copy_(0, pairs, weighted)
        return out.view(n, k, x.shape[1]).sum(dim=1)

    def shard_experts(self, start: int, end: int) -> None:
        """Keep only experts ``[start, end)`` (expert parallelism); frees the others. A no-op
        when the layer already holds exactly those (sharded at load).

        Raises:
            ValueError: the range is empty or outside this layer's experts.
        """
        if not (self.expert_start <= start < end <= self.expert_start + self.num_local_experts):
            raise ValueError(f"experts [{start}, {end}) are not within this layer's local "
                             f"experts [{self.expert_start}, "
                             f"{self.expert_start + self.num_local_experts})")
        lo, hi = start - self.expert_start, end - self.expert_start
        self.local_experts = self.local_experts[lo:hi]
        self.expert_start = start
        if self.fused_experts is not None:
            self.fuse_experts()


def topk_then_softmax(router_logits: torch.Tensor,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of the raw router logits, then a softmax over those k in float32 (gpt-oss,
    Hugging Face's ``GptOssTopKRouter``); the other experts' logits never enter the softmax.

    Args:
        router_logits: ``[N, E]``, any float dtype (the router's bias already added).
    Returns:
        (expert ids int64 ``[N, k]``, gates float32 ``[N, k]`` summing to 1), highest first.
    """
    logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return ids, torch.softmax(logits, dim=-1)


class TopKSoftmaxMoE(MoE):
    """:class:`MoE` whose router is a linear layer **with a bias** and whose gates are
    :func:`topk_then_softmax` (gpt-oss). Arguments as :class:`MoE` (``gate_mode`` is not one:
    this routing is the class); parameters as :class:`MoE` plus ``router.bias`` ``[E]``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(gate_mode="softmax", **kwargs)
        self.router = Linear(self.hidden_size, self.num_experts, bias=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, hidden]`` → (expert ids int64 ``[N, k]``, gates float32 ``[N, k]``)."""
        return topk_then_softmax(self.router(x), self.top_k)


def moe_from_dense_mlp(gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                       num_experts: int) -> MoE:
    """Model (a) of docs/ARCHITECTURE.md: a SiLU-gated MLP split into ``num_experts`` experts along its
    intermediate dimension, every token routed to all of them with gate 1 — the same function
    as the dense MLP (up to the order of the final sum).

    Args:
        gate_up_weight: the fused ``[2 * I, hidden]`` (gate rows, then up rows).
        down_weight: ``[hidden, I]``.
    Raises:
        ValueError: ``I`` is not a multiple of ``num_experts``.
    """
    intermediate = down_weight.shape[1]
    if num_experts < 1 or intermediate % num_experts:
        raise ValueError(f"cannot split an intermediate size of {intermediate} into "
                         f"{num_experts} equal experts: pick a divisor of {intermediate}")
    size = intermediate // num_experts
    hidden = down_weight.shape[0]
    moe = MoE(hidden_size=hidden, intermediate_size=size, num_experts=num_experts,
              top_k=num_experts, gate_mode="unit").to(down_weight.dtype)
    gate, up = gate_up_weight.split(intermediate, dim=0)
    moe.set_expert_weights(torch.cat([gate.view(num_experts, size, hidden),
                                      up.view(num_experts, size, hidden)], dim=1),
                           down_weight.view(hidden, num_experts, size).permute(1, 0, 2))
    return moe


def split_mlps_into_experts(model: nn.Module, num_experts: int) -> None:
    """Replace every decoder layer's dense ``mlp`` by :func:`moe_from_dense_mlp` (in place).

    Raises:
        ValueError: the model has no dense MLPs, or see :func:`moe_from_dense_mlp`.
    """
    layers = getattr(model, "layers", [])
    if not layers or any(isinstance(layer.mlp, MoE) for layer in layers):
        raise ValueError("--moe-split-experts needs a dense model (Llama-style MLPs)")
    for layer in layers:
        layer.mlp = moe_from_dense_mlp(layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
                                       num_experts)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
