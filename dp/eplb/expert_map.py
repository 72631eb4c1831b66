"""One MoE layer's expert placement at run time: routed expert → physical slot, and the counts.

An :class:`ExpertMap` is the layer's :class:`~atom.layers.moe.ExpertPlacement`
(``MoE.placement``, installed by :class:`atom.dp.eplb.manager.EplbManager`): inside
``MoE.experts`` it turns the router's logical expert ids of the gathered batch into the
physical slots that compute them (:mod:`atom.dp.eplb.replicas`' rule, the same on every rank:
every rank routes every token, and exactly one slot must compute each choice), so the layer's
local experts are this rank's slots.

**Counting.** While the window records, the map counts the slots chosen for this rank's own
tokens only: the rows ``[rank*M, rank*M + T)`` of the gathered batch
(:meth:`~atom.dp.expert_parallel.ExpertParallel.computing_rows`). All-gather dispatch shows
every rank every token, so counting every row would count each token once per rank (the
EP-size overcount vLLM documents); counting by the dispatching rank counts each (token,
expert) pair exactly once over the group, and the window's SUM all-reduce gives the group's
counts. The owner of a slot cannot count its hits alone: the padding rows (every rank's block
is padded to ``M``) are indistinguishable from tokens on the other ranks, under two-batch
overlap and the draft's forwards as much as in a plain step, while the dispatching rank knows
its own ``T``. Padding rows are routed and computed (as without EPLB) but never counted.

**Fake uniform** (``eplb_fake_uniform``): the router's choices are replaced by experts
``(row * k + j) mod E`` (distinct for a token's k choices, every expert equally often): the
balanced upper bound of a measurement, never a serving mode (it changes the output).
"""

from __future__ import annotations

import numpy as np
import torch

from atom.dp.eplb.replicas import replica_table


class ExpertMap:
    """Owns one layer's slot table and its counts; the DP loop's
    :class:`~atom.dp.eplb.manager.EplbManager` sets the placement and takes the counts
    between steps.

    Args:
        expert_parallel: the model's :class:`~atom.dp.expert_parallel.ExpertParallel`
            (the gathered batch's ``M`` and this rank's ``T``).
        num_logical: experts ``E``.
        num_physical: slots of the layer over all ranks.
        fake_uniform: replace the routing (module docstring).
    """

    def __init__(self, expert_parallel, *, num_logical: int, num_physical: int,
                 fake_uniform: bool = False):
        self.ep = expert_parallel
        self.num_logical, self.num_physical = num_logical, num_physical
        self.fake_uniform = fake_uniform
        self.recording = False
        self.counts = torch.zeros(num_physical, dtype=torch.int64)  # this rank's tokens
        self._replicas = torch.empty(0, dtype=torch.int64)  # [E, C]: each expert's slots
        self._num_replicas = torch.empty(0, dtype=torch.int64)  # [E]
        self._single = False  # every expert in one slot: no choice to make

    def set_placement(self, phy2log: np.ndarray) -> None:
        """Use the placement ``phy2log`` int ``[num_physical]`` from the next forward on."""
        replicas, counts = replica_table(phy2log, num_logical=self.num_logical)
        self._replicas = torch.from_numpy(replicas)
        self._num_replicas = torch.from_numpy(counts)
        self._single = bool((counts == 1).all())

    def to_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids int64 ``[N, k]`` of the gathered batch → slot ids int64 ``[N, k]``
        (module docstring); counts this rank's tokens while :attr:`recording`."""
        n, k = ids.shape
        if n == 0:
            return ids
        if self.fake_uniform:
            ids = (torch.arange(n * k, device=ids.device) % self.num_logical).view(n, k)
        if self._single:
            slots = self._replicas[ids, 0]
        else:
            rows = torch.arange(n, device=ids.device)[:, None]
            slots = self._replicas[ids, rows % self._num_replicas[ids]]
        m, t = self.ep.computing_rows()
        if self.recording and t:
            start = self.ep.rank * m
            self.counts += torch.bincount(slots[start:start + t].flatten(),
                                          minlength=self.num_physical)
        return slots

    def take_counts(self) -> torch.Tensor:
        """This rank's counts since the last call, int64 ``[num_physical]``; resets them."""
        counts = self.counts.clone()
        self.counts.zero_()
        return counts
