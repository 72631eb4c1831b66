"""Which replica computes a token routed to a replicated expert: the rule, as tables.

With redundant expert slots a logical expert may sit in several physical slots. A token routed
to it goes to exactly one of them, chosen the same way on every rank (every rank routes every
token under all-gather dispatch, and each must agree which slot computes it): the expert's
replica at position ``token index % number of replicas`` (replicas in ascending slot order;
the token's index is its row in the gathered batch), so a hot expert's tokens split evenly
over its replicas, which is what the plan assumes (:func:`atom.dp.eplb.plan.rank_loads`).

Why not prefer a replica on the token's own rank (the rule issue 39 proposed, and the right
one for an all-to-all dispatch, where a token computed at home never travels): all-gather
dispatch sends every token to every rank whatever computes it, so the preference saves no
traffic, and it makes each replica's share follow the share of tokens its rank dispatched
instead of the even split the plan packed for. Simulated while this was written (bursty
arrivals, DP 8 and 32, Zipf 1.0 over 64 experts, top-4, one redundant slot a rank, windows of
50 ticks every 100), the windows after the first rebalance measured balancedness 0.6-0.86 with
the preference, the plan changing at almost every window (35 and 16 rebalances), against
0.95-0.98 spreading by token index (1 and 4 rebalances).

:func:`replica_table` writes the rule down once per layer and placement;
:class:`atom.dp.eplb.expert_map.ExpertMap` applies it to every token (torch), and the simulator
applies it in expectation (:func:`replica_split`: each replica gets an equal share).
Torch-free (numpy).
"""

from __future__ import annotations

import numpy as np

from atom.dp.eplb.plan import EplbPlan


def replica_table(phy2log: np.ndarray, *, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's replicas (module docstring).

    Args:
        phy2log: int ``[num_physical]``: the logical expert of each slot.
        num_logical: logical experts ``E``.
    Returns:
        (replicas int64 ``[E, C]``: each expert's slots in ascending order, padded with its
        first; counts int64 ``[E]``), ``C`` the most replicas of any expert.
    Raises:
        ValueError: an expert has no slot.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    replicas = [np.flatnonzero(phy2log == e) for e in range(num_logical)]
    missing = [e for e, slots in enumerate(replicas) if not len(slots)]
    if missing:
        raise ValueError(f"expert {missing[0]} has no slot")
    width = max(len(slots) for slots in replicas)
    table = np.stack([np.concatenate([slots, np.full(width - len(slots), slots[0])])
                      for slots in replicas])
    return table, np.array([len(slots) for slots in replicas], dtype=np.int64)


def replica_split(plan: EplbPlan) -> np.ndarray:
    """The rule in expectation (the simulator's): float ``[num_layers, E, num_physical]``, the
    share of the tokens routed to expert ``e`` that each slot computes (equal shares over its
    replicas; each ``[l, e]`` row sums to 1)."""
    num_layers, num_physical = plan.phy2log.shape
    out = np.zeros((num_layers, plan.logcnt.shape[1], num_physical))
    for layer in range(num_layers):
        out[layer, plan.phy2log[layer], np.arange(num_physical)] = (
            1.0 / plan.logcnt[layer, plan.phy2log[layer]])
    return out
