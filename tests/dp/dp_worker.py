"""One rank of a 2-process ``atom.dp`` test scenario (run as a script, never imported by pytest).

Usage: ``python dp_worker.py SCENARIO OUT_DIR`` with the rank contract in the environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and ``ATOM_TEST_TIMEOUT_S`` (group
timeout). Writes ``OUT_DIR/rank{RANK}.json``: the scenario's results, or the type and message of
the CollectiveError / LockstepError it ended with, and the seconds from set-up to the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from atom.dp import collectives as C
from atom.dp.groups import DPGroups, RankInfo, init_process_groups
from atom.dp.sync import (
    CONTROL_VECTOR_LEN,
    BatchShape,
    ControlState,
    exchange_batch_shape,
    exchange_control,
)

NUM_TICKS = 12
FAULT_TICK = 2  # rank 1 misbehaves here in the fault scenarios (a tick with no optional ops)


def _tick_loop(groups: DPGroups, rank: int, *, fault: str | None = None) -> dict:
    """A DP-engine-like loop: control sync, batch-shape exchange, forward, metrics exchange.

    Rank 0 has work on every tick, rank 1 only on the first four (uneven workloads); forward
    sizes vary per tick (identical on both ranks) and the all-to-all splits differ per rank.
    ``fault`` makes rank 1 misbehave at FAULT_TICK: "skip" drops the tick's last device-group
    collective; "same_group" drops the control-group metrics exchange, which has the control
    vector's size, so rank 0's copy pairs with rank 1's next control sync; "dtype" all-reduces
    float32 where rank 0 all-reduces int32 (same bytes: gloo pairs them without complaint).
    """
    ctl, dev = groups.control, groups.device
    max_tokens = []
    for tick in range(NUM_TICKS):
        has_work = rank == 0 or tick < 4
        state = ControlState(has_work=has_work, num_admittable=(tick + rank) % 3,
                             has_pending_prefill=has_work, tick=tick)
        assert exchange_control(state, ctl).any_has_work()
        shape = BatchShape(num_tokens=(7 * tick + 3 * rank) if has_work else 1,
                           num_seqs=int(has_work), is_dummy=not has_work)
        max_tokens.append(exchange_batch_shape(shape, dev).max_num_tokens)
        misbehave = rank == 1 and tick == FAULT_TICK
        n = 3 + 5 * tick  # uneven sizes across ticks, equal across ranks
        dtype = torch.float32 if misbehave and fault == "dtype" else torch.int32
        x = C.all_reduce(torch.full((n,), rank + 1, dtype=dtype), dev)
        assert fault is not None or x.tolist() == [3] * n
        splits = [(tick + rank + s) % 4 for s in range(2)]  # rows sent to rank s
        out_splits = C.all_to_all_split_sizes(splits, dev)
        out = torch.empty(sum(out_splits), 4)
        C.all_to_all_single(out, torch.full((sum(splits), 4), float(rank)), dev,
                            output_split_sizes=out_splits, input_split_sizes=splits)
        if tick % 3 == 0:
            C.reduce_scatter_tensor(torch.empty(n), torch.ones(2 * n), dev)
        if not (misbehave and fault == "skip"):
            C.all_gather_int64(torch.full((n,), tick, dtype=torch.int64), dev)
        if tick % 5 == 0:
            C.barrier(ctl)
        if not (misbehave and fault == "same_group"):
            C.all_gather_int64(torch.zeros(CONTROL_VECTOR_LEN, dtype=torch.int64), ctl)
        if tick % 4 == 3:
            C.check_lockstep(C.process_collective_log(), ctl)
    log = C.process_collective_log()
    C.check_lockstep(log, ctl)
    return {"num_collectives": log.num_collectives, "hash": log.hash,
            "op_counts": dict(log.op_counts), "max_tokens": max_tokens}


def _all_to_all(groups: DPGroups, rank: int) -> dict:
    """Uneven all-to-all (float rows and async int64), all-gather and reduce-scatter values."""
    dev = groups.device
    splits = [[1, 3], [2, 0]][rank]  # rows rank `rank` sends to rank 0 and rank 1
    rows = torch.tensor([[100 * rank + 10 * dst + i] * 3 for dst in range(2)
                         for i in range(splits[dst])], dtype=torch.float32).reshape(-1, 3)
    out_splits = C.all_to_all_split_sizes(splits, dev)
    out = C.all_to_all_single(torch.empty(sum(out_splits), 3), rows, dev,
                              output_split_sizes=out_splits, input_split_sizes=splits)
    ids = torch.arange(sum(splits), dtype=torch.int64) + 1000 * rank
    ids_out = torch.empty(sum(out_splits), dtype=torch.int64)
    work = C.all_to_all_single_async(ids_out, ids, dev, output_split_sizes=out_splits,
                                     input_split_sizes=splits)
    work.wait()
    gathered = C.all_gather_into_tensor(torch.empty(4, 2), torch.full((2, 2), float(rank)), dev)
    scattered = torch.empty(2)
    C.reduce_scatter_tensor_async(scattered, torch.arange(4.0) * (rank + 1), dev).wait()
    return {"out_splits": out_splits, "rows": out.tolist(), "ids": ids_out.tolist(),
            "gathered": gathered.tolist(), "scattered": scattered.tolist()}


HIDDEN, INTERMEDIATE, NUM_EXPERTS = 8, 4, 8


def expert_weights(layer: int, expert: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of logical expert ``expert`` of layer ``layer`` (gate_up ``[2I, H]``, down
    ``[H, I]``): random, but a function of (layer, expert) only, so any rank can tell which
    expert a slot holds."""
    gen = torch.Generator().manual_seed(1000 * layer + expert)
    return (torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen).to(dtype),
            torch.randn(HIDDEN, INTERMEDIATE, generator=gen).to(dtype))


def _eplb(groups: DPGroups, rank: int) -> dict:
    """EPLB's manager on a stack of two MoE layers (float32 with its experts fused where
    the fused kernel runs, else packed for oneDNN as every bfloat16 linear), experts loaded as
    contiguous shards: forwards of a skewed batch through the
    expert-parallel dispatcher, a window, a rebalance with 4 redundant slots; every local
    slot's weights checked against its logical expert's after the start-up move and after the
    rebalance, and the outputs of the same batch before and after."""
    from atom.config import EngineConfig
    from atom.dp.eplb.manager import EplbManager
    from atom.dp.eplb.move import expert_tensors
    from atom.dp.expert_parallel import apply_expert_parallel
    from atom.layers.moe import MoE, ExpertShard

    dtypes = (torch.float32, torch.bfloat16)
    layers = torch.nn.ModuleList()
    for index, dtype in enumerate(dtypes):
        layer = MoE(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
                    top_k=2, expert_shard=ExpertShard(rank, 2)).to(dtype)
        gen = torch.Generator().manual_seed(index)
        router = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
        router[4:6] += 2.0  # experts 4, 5: hot for positive inputs, on rank 0 (no replica) at first
        layer.router.weight.data.copy_(router)
        for i, expert in enumerate(layer.local_experts):
            gate_up, down = expert_weights(index, layer.expert_start + i, dtype)
            expert.gate_up_proj.weight.data.copy_(gate_up)
            expert.down_proj.weight.data.copy_(down)
            if dtype == torch.bfloat16 or not layer.fuse_experts():
                expert.gate_up_proj.pack_weight()
                expert.down_proj.pack_weight()
        layer.router.pack_weight()
        layers.append(layer)
    ep = apply_expert_parallel(layers, groups.device, rank=rank, world_size=2)
    config = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                          eplb_num_redundant_experts=4, eplb_window_size=2,
                          eplb_step_interval=2, eplb_min_balancedness=0.9)
    manager = EplbManager(config, layers, ep, rank=rank, world_size=2, timeout_s=30.0)

    def slots_hold_their_experts() -> bool:
        phy2log = manager.controller.plan.phy2log
        for index, (layer, dtype) in enumerate(zip(layers, dtypes)):
            for i, expert in enumerate(layer.local_experts):
                logical = int(phy2log[index, layer.expert_start + i])
                want = expert_weights(index, logical, dtype)
                if not all(torch.equal(a, b) for a, b in zip(expert_tensors(expert), want)):
                    return False
        return True

    checks = {"after_start": slots_hold_their_experts()}
    x = torch.rand(6 + 3 * rank, HIDDEN, generator=torch.Generator().manual_seed(10 + rank))
    outputs, windows = [], []
    for step in range(4):
        ep.begin_step(9)  # the larger rank's batch
        outputs.append([layer(x.to(dtype)).float() for layer, dtype in zip(layers, dtypes)])
        result = manager.end_step(tick=step)
        if result is not None:
            windows.append({"balancedness": result.balancedness,
                            "rebalanced": result.rebalanced,
                            "predicted": result.predicted_balancedness,
                            "load": result.logical_load.tolist()})
    checks["after_rebalance"] = slots_hold_their_experts()
    log = C.process_collective_log()
    C.check_lockstep(log, groups.control)
    return {"checks": checks, "windows": windows,
            "phy2log": manager.controller.plan.phy2log.tolist(),
            "local_slots": [[layer.expert_start, len(layer.local_experts)] for layer in layers],
            "fused_rows_are_the_experts": [
                layer.fused_experts is None or all(
                    torch.equal(layer.fused_experts.w13[i], e.gate_up_proj.dense_weight())
                    and torch.equal(layer.fused_experts.w2[i], e.down_proj.dense_weight())
                    for i, e in enumerate(layer.local_experts)) for layer in layers],
            "fused": [layer.fused_experts is not None for layer in layers],
            "max_output_change": [max(float((a - b).abs().max()) for a, b in
                                      zip(outputs[0], outputs[step])) for step in range(4)],
            "all_to_alls": log.op_counts["all_to_all"],
            "stats": manager.stats()}


SCENARIOS = {
    "uneven_sequence": lambda g, r: _tick_loop(g, r),
    "skip": lambda g, r: _tick_loop(g, r, fault="skip"),
    "same_group": lambda g, r: _tick_loop(g, r, fault="same_group"),
    "dtype": lambda g, r: _tick_loop(g, r, fault="dtype"),
    "all_to_all": _all_to_all,
    "eplb": _eplb,
}


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    info = RankInfo.from_env()
    groups = init_process_groups(info, timeout_s=float(os.environ["ATOM_TEST_TIMEOUT_S"]))
    start = time.monotonic()
    result: dict = {"rank": info.rank, "error_type": None}
    try:
        result.update(SCENARIOS[scenario](groups, info.rank))
    except (C.CollectiveError, C.LockstepError) as e:
        result.update(error_type=type(e).__name__, error=str(e))
    result["elapsed_s"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f)
    if result["error_type"] is None:
        groups.destroy()
        return
    # After an error the groups are out of step: no collective teardown, and no normal
    # interpreter exit either, whose destructors can meet gloo's still-running threads and
    # abort ("terminate called without an active exception", exit -6: seen about 1 run in 6).
    # The result is already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
