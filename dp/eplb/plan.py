"""The EPLB placement plan: which logical expert each physical expert slot holds.

DeepSeek's expert-parallel load balancer (deepseek-ai/EPLB, ``eplb.py``; the algorithm of the
DeepSeek-V3 report, arXiv:2412.19437, section 3.4), written here from its description. Given a
window's routed-token counts per layer and logical expert, it chooses for every layer:

1. **groups to nodes** (hierarchical mode only): the expert groups (DeepSeek-V3's routing
   groups) are packed onto nodes, the same number of groups per node, balancing the groups'
   summed load (so group-limited routing keeps traffic inside a node);
2. **replicas**: each node's ``num_physical / num_nodes`` slots hold every one of its logical
   experts once, and the remaining (redundant) slots go one by one to the logical expert with
   the largest load per replica (so a hot expert's load splits over several slots);
3. **slots to ranks**: the node's physical experts (each carrying its expert's load divided by
   its replica count) are packed onto the node's ranks, the same number per rank, balancing
   the ranks' load.

The global mode (expert groups that do not divide by the nodes, or no groups) is the same with
one group and one node. Packing is greedy, heaviest item first, onto the lightest pack that
still has room (the longest-processing-time rule with equal pack sizes).

Every tie is broken by the lower index (experts, groups, packs), and the arithmetic is float64
on integer counts, so every rank that runs :func:`rebalance` on the same all-reduced counts
computes the identical plan: the plan itself is never communicated.

Torch-free (numpy): the simulator (``atom.dp.sim``) runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EplbPlan:
    """A placement for every MoE layer.

    Attributes:
        phy2log: int64 ``[num_layers, num_physical]``: the logical expert of each physical
            slot; rank ``r`` owns slots ``r * S .. (r + 1) * S - 1`` (``S`` slots per rank).
        log2phy: int64 ``[num_layers, num_logical, max_replicas]``: each logical expert's
            physical slots in ascending order, padded with -1.
        logcnt: int64 ``[num_layers, num_logical]``: replicas of each logical expert (>= 1).
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray

    @classmethod
    def from_phy2log(cls, phy2log: np.ndarray, num_logical: int) -> EplbPlan:
        """The plan of a given ``phy2log`` ``[num_layers, num_physical]`` (its inverse maps
        derived; slots of one expert in ascending order).

        Raises:
            ValueError: some logical expert has no slot, or a slot names no logical expert.
        """
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.min(initial=0) < 0 or phy2log.max(initial=0) >= num_logical:
            raise ValueError(f"phy2log names experts outside 0..{num_logical - 1}")
        num_layers = phy2log.shape[0]
        logcnt = np.zeros((num_layers, num_logical), dtype=np.int64)
        for layer in range(num_layers):
            logcnt[layer] = np.bincount(phy2log[layer], minlength=num_logical)
        if (logcnt == 0).any():
            layer, expert = map(int, np.argwhere(logcnt == 0)[0])
            raise ValueError(f"layer {layer}: logical expert {expert} has no physical slot")
        log2phy = np.full((num_layers, num_logical, int(logcnt.max())), -1, dtype=np.int64)
        for layer in range(num_layers):
            filled = np.zeros(num_logical, dtype=np.int64)
            for slot, expert in enumerate(phy2log[layer]):
                log2phy[layer, expert, filled[expert]] = slot
                filled[expert] += 1
        return cls(phy2log, log2phy, logcnt)

    @classmethod
    def identity(cls, num_layers: int, num_logical: int) -> EplbPlan:
        """The placement before any rebalance: slot ``i`` holds expert ``i`` (contiguous
        experts per rank, as expert parallelism shards them without EPLB)."""
        return cls.from_phy2log(np.tile(np.arange(num_logical, dtype=np.int64), (num_layers, 1)),
                                num_logical)


def balanced_packing(weights: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of ``n / num_packs`` items each,
    heaviest item first onto the lightest pack with room (ties: the lower pack index; items of
    equal weight in index order).

    Args:
        weights: float ``[n]`` item weights (loads).
        num_packs: number of packs; must divide ``n``.
    Returns:
        (pack of each item, position of each item within its pack), both int64 ``[n]``.
    Raises:
        ValueError: ``num_packs`` does not divide ``n``.
    """
    num_items = len(weights)
    if num_packs < 1 or num_items % num_packs:
        raise ValueError(f"{num_items} items do not pack evenly into {num_packs} packs")
    per_pack = num_items // num_packs
    pack_of = np.empty(num_items, dtype=np.int64)
    position = np.empty(num_items, dtype=np.int64)
    load = np.zeros(num_packs, dtype=np.float64)
    count = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable"):
        open_packs = np.flatnonzero(count < per_pack)
        pack = open_packs[np.argmin(load[open_packs])]  # argmin: the first of equal loads
        pack_of[item], position[item] = pack, count[pack]
        load[pack] += weights[item]
        count[pack] += 1
    return pack_of, position


def replicate_experts(weights: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """Give ``num_physical`` slots to ``n`` logical experts: one each, then every redundant
    slot to the expert with the largest load per replica (ties: the lower expert index).

    Args:
        weights: float ``[n]`` logical experts' loads.
        num_physical: slots, at least ``n``.
    Returns:
        (the logical expert of each slot ``[num_physical]`` — slots ``0 .. n-1`` hold experts
        ``0 .. n-1``, the redundant ones follow in the order they were given; the replica count
        of each expert ``[n]``), int64.
    """
    num_logical = len(weights)
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} experts")
    weights = np.asarray(weights, dtype=np.float64)
    phy2log = np.concatenate([np.arange(num_logical), np.empty(num_physical - num_logical)]
                             ).astype(np.int64)
    logcnt = np.ones(num_logical, dtype=np.int64)
    for slot in range(num_logical, num_physical):
        expert = int(np.argmax(weights / logcnt))
        phy2log[slot] = expert
        logcnt[expert] += 1
    return phy2log, logcnt


def _layer_plan(load: np.ndarray, *, num_physical: int, num_groups: int, num_nodes: int,
                num_ranks: int) -> np.ndarray:
    """One layer's ``phy2log`` (see the module docstring's three steps)."""
    num_logical = len(load)
    group_size = num_logical // num_groups
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks
    ranks_per_node = num_ranks // num_nodes
    # 1. groups to nodes: node_experts[node] lists the node's logical experts in order
    group_node, group_position = balanced_packing(load.reshape(num_groups, group_size).sum(1),
                                                  num_nodes)
    node_experts = np.empty((num_nodes, experts_per_node), dtype=np.int64)
    for group in range(num_groups):
        start = group_position[group] * group_size
        node_experts[group_node[group], start:start + group_size] = np.arange(
            group * group_size, (group + 1) * group_size)
    phy2log = np.empty(num_physical, dtype=np.int64)
    for node in range(num_nodes):
        experts = node_experts[node]
        # 2. replicas within the node (indices local to the node's expert list)
        local_of_slot, count = replicate_experts(load[experts], slots_per_node)
        # 3. the node's slots to its ranks, each slot carrying its expert's load per replica
        slot_load = load[experts][local_of_slot] / count[local_of_slot]
        rank_of_slot, position = balanced_packing(slot_load, ranks_per_node)
        first = node * slots_per_node
        phy2log[first + rank_of_slot * slots_per_rank + position] = experts[local_of_slot]
    return phy2log


def rebalance(load: np.ndarray, *, num_physical: int, num_ranks: int, num_groups: int = 1,
              num_nodes: int = 1) -> EplbPlan:
    """The placement plan for a window's routed-token counts.

    Hierarchical (groups packed onto nodes first) when ``num_groups`` divides by
    ``num_nodes``; otherwise global (one group, one node), as DeepSeek's balancer does.

    Args:
        load: int64 ``[num_layers, num_logical]`` tokens routed to each logical expert over
            the window, summed over the EP group (identical on every rank).
        num_physical: physical expert slots per layer (logical experts + redundant ones), a
            multiple of ``num_ranks``.
        num_ranks: ranks of the EP group; rank ``r`` owns the ``r``-th run of
            ``num_physical / num_ranks`` slots.
        num_groups: expert groups (``n_group`` of group-limited routing; 1 without).
        num_nodes: nodes of the EP group (ranks on one node share a fast interconnect).
    Returns:
        The :class:`EplbPlan`.
    Raises:
        ValueError: sizes that do not divide as required.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"load must be [num_layers, num_logical], got shape {load.shape}")
    num_layers, num_logical = load.shape
    if num_physical < num_logical or num_physical % num_ranks:
        raise ValueError(f"num_physical={num_physical} must be >= the {num_logical} logical "
                         f"experts and a multiple of num_ranks={num_ranks}")
    if num_logical % num_groups:
        raise ValueError(f"{num_logical} experts do not split into {num_groups} groups")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} is not a multiple of num_nodes={num_nodes}")
    if num_groups % num_nodes:  # groups cannot be kept on nodes: balance globally
        num_groups = num_nodes = 1
    phy2log = np.stack([
        _layer_plan(load[layer], num_physical=num_physical, num_groups=num_groups,
                    num_nodes=num_nodes, num_ranks=num_ranks)
        for layer in range(num_layers)]) if num_layers else np.empty((0, num_physical), np.int64)
    return EplbPlan.from_phy2log(phy2log, num_logical)


def rank_loads(load: np.ndarray, plan: EplbPlan, num_ranks: int) -> np.ndarray:
    """float ``[num_layers, num_ranks]``: each rank's share of the routed tokens under
    ``plan``, when a replicated expert's tokens split evenly over its replicas."""
    load = np.asarray(load, dtype=np.float64)
    per_slot = np.take_along_axis(load / plan.logcnt, plan.phy2log, axis=1)
    return per_slot.reshape(load.shape[0], num_ranks, -1).sum(axis=2)


def balancedness(rank_load: np.ndarray) -> float:
    """Σ_layers mean-over-ranks / Σ_layers max-over-ranks of ``rank_load`` ``[num_layers,
    num_ranks]`` (vLLM's definition): 1.0 is perfectly balanced; 1.0 too when nothing was
    routed."""
    rank_load = np.asarray(rank_load, dtype=np.float64)
    peak = rank_load.max(axis=1).sum() if rank_load.size else 0.0
    return float(rank_load.mean(axis=1).sum() / peak) if peak > 0 else 1.0
