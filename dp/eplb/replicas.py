"""Which replica computes a token routed to a replicated expert: the rule, as tables.

With redundant expert slots a logical expert may sit in several physical slots. A token routed
to it goes to exactly one of them, chosen the same way on every rank (every rank routes every
token under all-gather dispatch, and each must agree which of them computes it):

- the replicas on the token's own rank (the rank that dispatched it), if it has any;
- else all of the expert's replicas;

and among those candidates the one at position ``token index % number of candidates`` (the
token's row in the gathered batch), so a hot expert's tokens spread evenly over its replicas.

:func:`replica_table` writes the rule down once per layer and placement;
:class:`atom.dp.eplb.expert_map.ExpertMap` applies it to every token (torch), and the simulator
applies it in expectation (:func:`expected_slot_loads`: each candidate gets an equal share).
Torch-free (numpy).
"""

from __future__ import annotations

import numpy as np

from atom.dp.eplb.plan import EplbPlan


def replica_table(phy2log: np.ndarray, *, num_logical: int,
                  num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's candidates (module docstring).

    Args:
        phy2log: int ``[num_physical]``: the logical expert of each slot (rank ``r`` owns the
            ``r``-th run of ``num_physical / num_ranks`` slots).
        num_logical: logical experts ``E``.
        num_ranks: ranks ``W``.
    Returns:
        (candidates int64 ``[W, E, C]``: for a token from rank ``s`` routed to expert ``e``, its
        candidate slots in ascending order, padded with the first one; counts int64 ``[W, E]``),
        ``C`` the most replicas of any expert.
    Raises:
        ValueError: the slots do not split evenly over the ranks, or an expert has no slot.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_physical = len(phy2log)
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} slots do not split evenly over {num_ranks} ranks")
    slots_per_rank = num_physical // num_ranks
    replicas = [np.flatnonzero(phy2log == e) for e in range(num_logical)]
    if any(len(r) == 0 for r in replicas):
        raise ValueError(f"expert {next(e for e, r in enumerate(replicas) if not len(r))} "
                         f"has no slot")
    width = max(len(r) for r in replicas)
    candidates = np.empty((num_ranks, num_logical, width), dtype=np.int64)
    counts = np.empty((num_ranks, num_logical), dtype=np.int64)
    for e, slots in enumerate(replicas):
        for rank in range(num_ranks):
            mine = slots[slots // slots_per_rank == rank]
            chosen = mine if len(mine) else slots
            counts[rank, e] = len(chosen)
            candidates[rank, e] = np.concatenate([chosen, np.full(width - len(chosen),
                                                                  chosen[0])])
    return candidates, counts


def replica_split(plan: EplbPlan, num_ranks: int) -> np.ndarray:
    """The rule in expectation (the simulator's): float ``[num_layers, W, E, num_physical]``,
    the share of the tokens from rank ``s`` routed to expert ``e`` that each slot computes
    (equal shares over the candidates; each ``[l, s, e]`` row sums to 1)."""
    num_layers, num_physical = plan.phy2log.shape
    num_logical = plan.logcnt.shape[1]
    out = np.zeros((num_layers, num_ranks, num_logical, num_physical))
    for layer in range(num_layers):
        candidates, counts = replica_table(plan.phy2log[layer], num_logical=num_logical,
                                           num_ranks=num_ranks)
        for rank in range(num_ranks):
            for e in range(num_logical):
                out[layer, rank, e, candidates[rank, e, :counts[rank, e]]] = 1.0 / counts[rank, e]
    return out


def expected_slot_loads(load_by_rank: np.ndarray, split: np.ndarray) -> np.ndarray:
    """The slots' expected loads: float ``[num_layers, num_physical]``.

    Args:
        load_by_rank: float ``[W, num_layers, E]``: tokens routed to each logical expert,
            by the rank that dispatched them.
        split: :func:`replica_split` of the placement.
    """
    return np.einsum("sle,lsep->lp", load_by_rank, split)
