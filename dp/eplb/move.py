"""Moving expert weights between ranks when the placement changes.

Every rank knows the old and the new placement of every layer (both computed locally from the
same values), so every rank derives the same transfer list without asking anyone
(:func:`transfers`): each rank fetches each logical expert it must hold and does not, once,
from the lowest rank that holds it. Per layer, the transfers travel in one
``all_to_all_single`` on EPLB's own gloo group (through :mod:`atom.dp.collectives`, so it is in
the collective log): each sender packs its rows for each receiver in ascending expert order,
each receiver reads them per sender in the same order; a row is one expert's weights as raw
bytes (every expert of a layer has the same tensors). A layer with no transfer anywhere issues
nothing, on every rank. The collective is the gloo equivalent of vLLM's and SGLang's sorted
``batch_isend_irecv``: only the rows that move travel (the splits are uneven), and a separate
group keeps it from ever pairing with a forward's collective on the device group (ATOM's
reason for one).

Then each rank rebuilds the layer's local experts for its new slots: an expert it held before
keeps its module (the first slot that wants it); a second local replica, and every received
expert, is a fresh module of the layer's expert class loaded with the weights and packed for
oneDNN like the rest (:func:`load_expert_tensors`). Modules no slot wants are dropped. A layer
whose experts run fused stacks the new set's weights again (:meth:`MoE.fuse_experts`).

The move happens between two steps, inside one tick, on every rank: the next forward runs the
new placement everywhere (docs/ARCHITECTURE.md, "EPLB").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from atom.dp.collectives import all_to_all_single
from atom.layers.linear import Linear
from atom.layers.moe import MoE, expert_range

Placement = Sequence[Sequence[int]]  # per rank: the logical expert of each local slot, in order


def expert_tensors(expert: nn.Module) -> list[torch.Tensor]:
    """An expert's weights as dense tensors in a fixed order: every :class:`Linear`'s weight
    (read back from oneDNN's packed copy when packed), then every other parameter, module by
    module (``expert.modules()`` order).

    Raises:
        ValueError: a linear holds GGUF blocks (quantized experts are not moved).
    """
    out = []
    for module in expert.modules():
        if isinstance(module, Linear):
            if module.qweight is not None:
                raise ValueError("EPLB cannot move GGUF-quantized expert weights")
            out.append(module.dense_weight())
        out += [p.detach() for name, p in module.named_parameters(recurse=False)
                if not (isinstance(module, Linear) and name == "weight")]
    return out


def load_expert_tensors(expert: nn.Module, tensors: Sequence[torch.Tensor]) -> None:
    """Give ``expert`` the weights :func:`expert_tensors` lists (copied), in that order; its
    linears are packed for oneDNN where they can be."""
    values = iter(tensors)
    for module in expert.modules():
        if isinstance(module, Linear):
            module.weight = nn.Parameter(next(values).clone(), requires_grad=False)
            module.packed_weight = None
            module.pack_weight()
        for name, _ in list(module.named_parameters(recurse=False)):
            if not (isinstance(module, Linear) and name == "weight"):
                setattr(module, name, nn.Parameter(next(values).clone(), requires_grad=False))


def transfers(old: Placement, new: Placement) -> list[tuple[int, int, int]]:
    """``(source rank, destination rank, logical expert)`` for every expert a rank must hold
    under ``new`` and does not under ``old``, fetched once from the lowest rank holding it;
    sorted by destination, then expert.

    Raises:
        ValueError: an expert the new placement needs is held by no rank.
    """
    holders: dict[int, int] = {}
    for rank, experts in enumerate(old):
        for e in experts:
            holders.setdefault(e, rank)
    out = []
    for dst, experts in enumerate(new):
        for e in sorted(set(experts) - set(old[dst])):
            if e not in holders:
                raise ValueError(f"expert {e} is held by no rank: it cannot be moved")
            out.append((holders[e], dst, e))
    return out


def move_layer(layer: MoE, old: Placement, new: Placement, *, rank: int,
               group) -> int:
    """Give ``layer`` (this rank's, holding ``old[rank]``) the experts of ``new[rank]`` as its
    local experts, fetching the missing ones (module docstring). Every rank of ``group`` calls
    it with the same ``old`` and ``new``. Returns the bytes this rank received.

    Raises:
        CollectiveError: the exchange failed.
    """
    moves = transfers(old, new)
    held = list(layer.local_experts)
    template = expert_tensors(held[0])
    received: dict[int, list[torch.Tensor]] = {}
    if moves:
        row_bytes = sum(t.numel() * t.element_size() for t in template)
        sends = [(dst, e) for src, dst, e in moves if src == rank]  # sorted by dst, then e
        recvs = [(src, e) for src, dst, e in sorted(moves) if dst == rank]  # by src, then e
        send = torch.empty(len(sends), row_bytes, dtype=torch.uint8)
        for i, (_, e) in enumerate(sends):
            send[i] = _as_bytes(expert_tensors(held[list(old[rank]).index(e)]))
        recv = torch.empty(len(recvs), row_bytes, dtype=torch.uint8)
        num_ranks = len(old)
        all_to_all_single(recv, send, group,
                          input_split_sizes=[sum(d == r for d, _ in sends) for r in range(num_ranks)],
                          output_split_sizes=[sum(s == r for s, _ in recvs) for r in range(num_ranks)])
        received = {e: _from_bytes(recv[i], template) for i, (_, e) in enumerate(recvs)}
    layer.local_experts = nn.ModuleList(_local_modules(layer, held, list(old[rank]),
                                                       list(new[rank]), received))
    layer.expert_start = rank * len(new[rank])
    if layer.fused_experts is not None:
        layer.fuse_experts()
    return sum(t.numel() * t.element_size() for ts in received.values() for t in ts)


def _local_modules(layer: MoE, held: list[nn.Module], old: list[int], new: list[int],
                   received: dict[int, list[torch.Tensor]]) -> list[nn.Module]:
    free = dict.fromkeys(range(len(held)))  # old modules not yet given to a new slot, in order
    out = []
    for e in new:
        mine = next((i for i in free if old[i] == e), None)
        if mine is not None:
            del free[mine]
            out.append(held[mine])
            continue
        source = next((i for i, x in enumerate(old) if x == e), None)
        module = layer.expert_class(layer.hidden_size, layer.intermediate_size)
        load_expert_tensors(module, expert_tensors(held[source]) if source is not None
                            else received[e])
        out.append(module)
    return out


def _as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _from_bytes(row: torch.Tensor, template: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in template:
        size = t.numel() * t.element_size()
        out.append(row[offset:offset + size].clone().view(t.dtype).view(t.shape))
        offset += size
    return out


def placement_of(phy2log_layer, num_ranks: int) -> list[list[int]]:
    """A plan's layer (``phy2log`` ``[num_physical]``) as per-rank lists of logical experts."""
    slots = len(phy2log_layer) // num_ranks
    return [[int(e) for e in phy2log_layer[r * slots:(r + 1) * slots]] for r in range(num_ranks)]


def shard_placement(num_logical: int, num_ranks: int) -> list[list[int]]:
    """The contiguous shards expert parallelism loads (:func:`atom.layers.moe.expert_range`)
    as per-rank lists."""
    return [list(range(*expert_range(num_logical, r, num_ranks))) for r in range(num_ranks)]
