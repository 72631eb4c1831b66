"""Expert parallelism (EP) across the DP ranks, applied to a single-device model from outside.

:func:`apply_expert_parallel` keeps a contiguous slice of every MoE layer's experts on each rank
(rank r of W owns experts ``[r*E//W, (r+1)*E//W)``, :func:`atom.layers.moe.expert_range`; a
model loaded with that :class:`~atom.layers.moe.ExpertShard` already holds only those, read so
from the checkpoint) and installs an :class:`ExpertParallel` dispatcher in each
:class:`~atom.layers.moe.MoE` layer. The model file knows nothing of it. A dense layer (Qwen3-MoE's
``mlp_only_layers``, a DeepSeek first layer) has no MoE, so no dispatcher and no collective: it
stays local to each rank.

Per MoE layer and step, on the device group:

1. **dispatch** — all-gather every rank's tokens, each rank's padded to ``M``, the largest
   token count of the step (from the batch-shape exchange): ``[T, hidden]`` → ``[W*M, hidden]``;
2. every rank routes all ``W*M`` tokens (the router is a tiny ``[E, hidden]`` GEMM, so computing
   it redundantly is cheaper than shipping its output) and runs its local experts on the tokens
   that chose them;
3. **combine** — reduce-scatter (sum) the ``[W*M, hidden]`` partial outputs: each rank gets its
   own ``M`` rows, summed over every rank's experts, and keeps the first ``T``.

A rank with nothing to run (a dummy batch, ``T = 0``) still takes part with ``M`` zero rows,
so every rank issues the same two collectives per MoE layer, of the same size. When every rank's
batch is empty (``M = 0``) no rank issues them — the same decision everywhere, since ``M`` is a
gathered value.

Why all-gather + reduce-scatter rather than all-to-all (DeepEP-style): the sizes are fixed by
one number every rank already has (``M``), so no per-layer exchange of split sizes and no token
permutation; the cost is ``W×`` the activation traffic of an all-to-all with top-k routing,
irrelevant at the DP sizes of one CPU host (this module is where an all-to-all would go for
large GPU deployments; :func:`atom.dp.collectives.all_to_all_single` already supports uneven
splits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from atom.dp.collectives import (
    CollectiveWork,
    all_gather_into_tensor_async,
    reduce_scatter_tensor_async,
)
from atom.layers.moe import MoE, expert_range, moe_layers


class PendingTokens:
    """Tokens an async collective is still filling: :meth:`wait` for it, then :meth:`result`."""

    def __init__(self, work: CollectiveWork | None, tokens: torch.Tensor):
        self._work, self._tokens = work, tokens

    def wait(self) -> None:
        """Raises CollectiveError when the collective failed."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def result(self) -> torch.Tensor:
        self.wait()
        return self._tokens


class ExpertParallel:
    """The per-step state and collectives shared by every MoE layer of one rank's model.

    Args:
        group: the device group (one member per DP rank).
        rank, world_size: this rank in ``group`` and its size.
    """

    def __init__(self, group: dist.ProcessGroup, *, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.max_num_tokens: int | None = None  # M of the current step; set by begin_step
        self._num_tokens: list[int] = []  # T of the micro-batches dispatched and not combined

    def begin_step(self, max_num_tokens: int) -> None:
        """Set ``M``, the largest token count of this step over all ranks (every rank passes
        the same value, from the batch-shape exchange).

        Raises:
            ValueError: ``max_num_tokens`` is negative.
        """
        if max_num_tokens < 0:
            raise ValueError(f"max_num_tokens={max_num_tokens} must be >= 0")
        self.max_num_tokens = max_num_tokens
        self._num_tokens.clear()  # nothing carries over from a step that failed midway

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` (``T <= M``) → every rank's tokens ``[W*M, hidden]``.

        Raises:
            RuntimeError: no :meth:`begin_step` for this step, or ``T > M``.
        """
        return self.dispatch_async(x).result()

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """``[W*M, hidden]`` partial outputs of the local experts → this rank's ``[T, hidden]``
        outputs summed over all ranks' experts."""
        return self.combine_async(partial).result()

    def dispatch_async(self, x: torch.Tensor) -> PendingTokens:
        """:meth:`dispatch` with the all-gather in flight; ``result()`` waits for it (TBO)."""
        m = self._step_max(x.shape[0])
        self._num_tokens.append(x.shape[0])
        if m == 0:
            return PendingTokens(None, x)
        shard = x.new_zeros(m, x.shape[1])
        shard[:x.shape[0]] = x
        out = x.new_empty(self.world_size * m, x.shape[1])
        return PendingTokens(all_gather_into_tensor_async(out, shard, self.group), out)

    def combine_async(self, partial: torch.Tensor) -> PendingTokens:
        """:meth:`combine` with the reduce-scatter in flight; ``result()`` waits for it (TBO).
        Micro-batches combine in the order they dispatched."""
        num_tokens = self._num_tokens.pop(0)
        m = self._step_max(num_tokens)
        if m == 0:
            return PendingTokens(None, partial)
        out = partial.new_empty(m, partial.shape[1])
        work = reduce_scatter_tensor_async(out, partial.contiguous(), self.group)
        return PendingTokens(work, out[:num_tokens])

    def computing_rows(self) -> tuple[int, int]:
        """``(M, T)`` of the micro-batch whose experts run now (the oldest dispatched and not
        yet combined): the gathered batch holds ``M`` rows per rank, this rank's ``T`` real
        tokens first in its block of rows ``[rank*M, rank*M + T)``, then padding.

        Raises:
            RuntimeError: no micro-batch is dispatched.
        """
        if not self._num_tokens or self.max_num_tokens is None:
            raise RuntimeError("expert parallel: no micro-batch is dispatched")
        return self.max_num_tokens, self._num_tokens[0]

    def _step_max(self, num_tokens: int) -> int:
        m = self.max_num_tokens
        if m is None:
            raise RuntimeError("expert parallel: begin_step() was not called for this step "
                               "(the DP loop calls it after the batch-shape exchange)")
        if num_tokens > m:
            raise RuntimeError(f"expert parallel: {num_tokens} tokens on this rank but the "
                               f"step's agreed maximum is {m}")
        return m


def apply_expert_parallel(model: torch.nn.Module, group: dist.ProcessGroup, *, rank: int,
                          world_size: int) -> ExpertParallel:
    """Shard every MoE layer of ``model`` over ``group`` (a no-op for a layer loaded with this
    rank's experts only) and route its tokens through it.

    Returns the :class:`ExpertParallel` whose :meth:`~ExpertParallel.begin_step` the DP loop
    calls every step.

    Raises:
        ValueError: the model has no MoE layers, or fewer experts than ranks.
    """
    layers: list[MoE] = moe_layers(model)
    if not layers:
        raise ValueError("expert parallelism needs an MoE model")
    ep = ExpertParallel(group, rank=rank, world_size=world_size)
    for layer in layers:
        start, end = expert_range(layer.num_experts, rank, world_size)
        layer.shard_experts(start, end)
        layer.dispatcher = ep
    return ep
