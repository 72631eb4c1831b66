"""One DP rank's expert-parallel load balancer: what the DP loop calls once per step.

:class:`EplbManager` owns everything EPLB keeps on a rank: the
:class:`~atom.dp.eplb.controller.EplbController` (step counter, window, placement), one
:class:`~atom.dp.eplb.expert_map.ExpertMap` per MoE layer (installed as the layer's
``placement``), EPLB's own gloo process group, and the figures it reports. The DP loop
(:mod:`atom.dp.dp_core_proc`) builds it after expert parallelism is applied and calls
:meth:`EplbManager.end_step` after every step's forward, dummy steps included; nothing else in
the loop knows about EPLB but the trace columns and the utilities it serves.

At start-up every rank moves its experts from the contiguous shard it loaded to the initial
placement (the same when there are no redundant slots: nothing moves). At the end of each
interval (:mod:`atom.dp.eplb.controller`), in the same tick on every rank:

1. one int64 SUM all-reduce of the window's counts on EPLB's group (in the collective log);
2. the decision and, if it rebalances, the plan, computed locally (the same on every rank);
3. the move, layer by layer (:mod:`atom.dp.eplb.move`), and the maps switched: the next step
   runs the new placement on every rank.

With ``record_expert_load`` and EPLB off the manager is the same with the controller's
``rebalance`` off: it counts, all-reduces and measures every window at the same ticks (the
collectives of a run with EPLB on and a placement that never changes), and moves nothing.

Group-limited routing (DeepSeek-V3's ``n_group``): a family whose MoE layers carry
``num_expert_groups`` > 1 gets the plan's hierarchical mode (groups packed onto nodes, the
nodes counted from ``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import datetime
import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from atom.dp.collectives import all_reduce
from atom.dp.eplb.controller import REBALANCE_SECONDS_BUCKETS, EplbController, WindowResult
from atom.dp.eplb.expert_map import ExpertMap
from atom.dp.eplb.move import move_layer, placement_of, shard_placement
from atom.dp.rank_contract import rank_logger
from atom.layers.moe import MoE, moe_layers

logger = logging.getLogger(__name__)

#: the utilities a DP rank serves for EPLB (``LLM.get_expert_load`` / ``get_expert_placement``)
EPLB_UTILITIES = ("get_expert_load", "get_expert_placement")


class EplbManager:
    """See the module docstring. Owns the controller, the maps, EPLB's process group and the
    last rebalance's figures; mutates the model's MoE layers (their local experts, their
    ``expert_start`` and ``placement``).

    Args:
        config: the engine options (``eplb_*``).
        model: the rank's model, expert parallelism already applied.
        expert_parallel: its :class:`~atom.dp.expert_parallel.ExpertParallel`.
        rank, world_size: this DP rank and the DP size.
        num_nodes: nodes the ranks span (the plan's hierarchical mode).
        timeout_s: EPLB group's collective timeout (``dp_group_timeout_s``).
        trace: the DP trace writer (each closed window is an ``eplb_window`` event), or None.
    Raises:
        ValueError: the model has no MoE layers, or the slots do not divide by the DP size.
    """

    def __init__(self, config, model, expert_parallel, *, rank: int, world_size: int,
                 num_nodes: int = 1, timeout_s: float = 600.0, trace=None):
        self.layers: list[MoE] = moe_layers(model)
        if not self.layers:
            raise ValueError("EPLB and record_expert_load need an MoE model")
        num_logical = self.layers[0].num_experts
        self.rank, self.world_size, self.trace = rank, world_size, trace
        self._log = rank_logger(logger, rank)
        self.controller = EplbController.from_config(
            config, num_layers=len(self.layers), num_logical=num_logical, num_ranks=world_size,
            num_groups=getattr(self.layers[0], "num_expert_groups", 1),
            num_nodes=num_nodes if world_size % num_nodes == 0 else 1)
        # new_group is a collective over every rank: every rank builds its manager at the same
        # point of start-up (atom.dp.dp_core_proc.run_rank)
        self.group = dist.new_group(backend="gloo", group_desc="atom_eplb",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.maps = [ExpertMap(expert_parallel, num_logical=num_logical,
                               num_physical=self.controller.num_physical,
                               fake_uniform=config.eplb_fake_uniform) for _ in self.layers]
        for layer, expert_map in zip(self.layers, self.maps):
            layer.placement = expert_map
        self.last_plan_ms = self.last_move_ms = 0.0
        self.last_move_bytes = 0
        self.rebalance_seconds_sum = 0.0
        self.rebalance_seconds_buckets = [0] * (len(REBALANCE_SECONDS_BUCKETS) + 1)
        self.tick_load: list[int] | None = None  # this rank's counts of the last step (trace)
        self.expert_us: int | None = None  # µs in this rank's experts in the last step (trace)
        self._expert_ns = 0
        self._expert_start_ns = 0
        self._hooks: list = []
        self._last_local_load: np.ndarray | None = None  # this rank's part of the last window
        shards = shard_placement(num_logical, world_size)
        self._move([shards] * len(self.layers))
        self._set_recording()
        if trace is not None:
            self._time_experts()

    # ----- the step -----

    def end_step(self, *, tick: int) -> WindowResult | None:
        """After every step's forward (dummy steps included), on every rank: record this
        rank's counts, advance the step counter, and at the end of an interval close the
        window (module docstring). ``tick``: the DP tick (for the trace event). Returns the
        closed window's result, else None.

        Raises:
            CollectiveError: the all-reduce or a move failed.
        """
        controller = self.controller
        if controller.recording:
            counts = torch.stack([m.take_counts() for m in self.maps]).numpy()
            controller.record(counts)
            self.tick_load = counts.ravel().tolist()
        else:
            self.tick_load = None
        if self._hooks:
            self.expert_us, self._expert_ns = self._expert_ns // 1000, 0
        result = self._close_window(tick) if controller.end_step() else None
        self._set_recording()
        return result

    def _close_window(self, tick: int) -> WindowResult:
        controller = self.controller
        local = controller.take_window()
        self._last_local_load = local[:len(self.layers) * controller.num_logical].reshape(
            len(self.layers), controller.num_logical).copy()
        start = time.perf_counter()
        totals = all_reduce(torch.from_numpy(local), self.group).numpy()  # in place
        old = controller.plan
        result = controller.close_window(totals)
        planned = time.perf_counter()
        self.last_plan_ms = (planned - start) * 1e3
        if result.rebalanced:
            self.last_move_bytes = self._move([placement_of(old.phy2log[layer], self.world_size)
                                               for layer in range(len(self.layers))])
            seconds = time.perf_counter() - start
            self.last_move_ms = (seconds - (planned - start)) * 1e3
            self.rebalance_seconds_sum += seconds
            if self._hooks:
                self._time_experts()  # new modules
            self.rebalance_seconds_buckets[int(np.searchsorted(REBALANCE_SECONDS_BUCKETS,
                                                               seconds))] += 1
            self._log.info("EPLB at tick %d (step %d): balancedness %.3f of the window -> %.3f "
                           "predicted; plan %.1f ms, move %.1f ms (%d bytes in)", tick,
                           result.step, result.balancedness, result.predicted_balancedness,
                           self.last_plan_ms, self.last_move_ms, self.last_move_bytes)
        if self.trace is not None:
            self.trace.write_event(result.event(
                tick=tick, phy2log=controller.plan.phy2log,
                timings={"plan_ms": self.last_plan_ms, "move_ms": self.last_move_ms}
                if result.rebalanced else {}))
        return result

    def _move(self, old: list[list[list[int]]]) -> int:
        """Every layer from the per-rank placements ``old`` to the controller's plan; the
        maps switched. Returns the bytes this rank received."""
        received = 0
        for index, (layer, expert_map) in enumerate(zip(self.layers, self.maps)):
            new_layer = self.controller.plan.phy2log[index]
            received += move_layer(layer, old[index], placement_of(new_layer, self.world_size),
                                   rank=self.rank, group=self.group)
            expert_map.set_placement(new_layer)
        return received

    def _time_experts(self) -> None:
        """Time every local expert's forward, or a fused layer's one call for all of them
        (with the trace on: its ``eplb_expert_us`` column, this rank's MoE expert compute per
        step, wall clock)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for layer in self.layers:
            for expert in ([layer.fused_experts] if layer.fused_experts is not None
                           else layer.local_experts):
                self._hooks.append(expert.register_forward_pre_hook(self._expert_begins))
                self._hooks.append(expert.register_forward_hook(self._expert_ends))

    def _expert_begins(self, module, args) -> None:
        self._expert_start_ns = time.perf_counter_ns()

    def _expert_ends(self, module, args, output) -> None:
        self._expert_ns += time.perf_counter_ns() - self._expert_start_ns

    def _set_recording(self) -> None:
        recording = self.controller.recording
        for expert_map in self.maps:
            expert_map.recording = recording

    # ----- what it reports -----

    @property
    def last_balancedness(self) -> float | None:
        """The last closed window's balancedness (None before the first)."""
        window = self.controller.last_window
        return None if window is None else window.balancedness

    def stats(self) -> dict[str, int | float | list[int]]:
        """``eplb_step``, ``eplb_num_windows``, ``eplb_num_rebalances`` (identical on every
        rank), ``eplb_balancedness`` (the last window's, once one closed), the last
        rebalance's ``eplb_last_plan_ms`` / ``eplb_last_move_ms`` / ``eplb_last_move_bytes``
        (this rank's clock and bytes), and the rebalances' seconds
        (``eplb_rebalance_seconds_sum``, ``eplb_rebalance_seconds_buckets``: counts per bucket
        of :data:`~atom.dp.eplb.controller.REBALANCE_SECONDS_BUCKETS`, the last one above).
        Recording only (``record_expert_load``): the first two and the balancedness."""
        c = self.controller
        out: dict[str, int | float | list[int]] = {
            "eplb_step": c.step, "eplb_num_windows": c.step // c.step_interval}
        if c.rebalance:
            out.update({
                "eplb_num_rebalances": c.num_rebalances, "eplb_last_plan_ms": self.last_plan_ms,
                "eplb_last_move_ms": self.last_move_ms,
                "eplb_last_move_bytes": self.last_move_bytes,
                "eplb_rebalance_seconds_sum": self.rebalance_seconds_sum,
                "eplb_rebalance_seconds_buckets": list(self.rebalance_seconds_buckets)})
        if c.last_window is not None:
            out["eplb_balancedness"] = c.last_window.balancedness
        return out

    def call_utility(self, method: str) -> dict[str, list[int]]:
        """``get_expert_load``: this rank's tokens routed to each logical expert in the last
        closed window (zeros before the first), ``{"shape": [layers, experts], "values":
        [...]}`` (the front end sums the ranks); ``get_expert_placement``: the current
        ``phy2log``, ``{"shape": [layers, slots], "values": [...]}``.

        Raises:
            ValueError: not one of :data:`EPLB_UTILITIES`.
        """
        if method == "get_expert_load":
            load = self._last_local_load
            if load is None:
                load = np.zeros((len(self.layers), self.controller.num_logical), np.int64)
            return {"shape": list(load.shape), "values": load.ravel().tolist()}
        if method == "get_expert_placement":
            phy2log = self.controller.plan.phy2log
            return {"shape": list(phy2log.shape), "values": phy2log.ravel().tolist()}
        raise ValueError(f"unknown EPLB utility {method!r}; known: {list(EPLB_UTILITIES)}")
