"""EPLB's clock and decisions: the step counter, the window, the rebalance decision.

Shared by the engine (:class:`atom.dp.eplb.manager.EplbManager`, one per DP rank) and the
simulator (:mod:`atom.dp.sim`), so a simulated run rebalances at the same ticks with the same
plans as a real one. Torch-free; it issues no collective (the caller all-reduces the window).

**The clock.** :attr:`EplbController.step` counts the group's forward steps: every stepping
tick of the DP loop, dummy batches included (vLLM's ``eplb_state`` rule). Every rank steps at
every stepping tick (a rank with nothing to run takes a dummy batch), so the counter is the
same on every rank without any exchange; a counter that skipped dummy steps would advance on
a per-rank condition, and the ranks would reach the rebalance at different ticks and hang in
its all-reduce. Ticks that end a wave run no step and count nothing (on every rank).

**The window.** Of each interval of ``eplb_step_interval`` steps, the last
``eplb_window_size`` are recorded (:attr:`recording`): the tokens routed to each physical
slot, as counted by the rank that dispatched them (:mod:`atom.dp.eplb.expert_map`), kept as
each logical expert's load and each rank's load (the slots it owns) under the placement of the
step. After the interval's last step the caller sums the window's counts over the ranks (one
int64 SUM all-reduce of :meth:`take_window`) and :meth:`close_window` decides, identically on
every rank (integer sums; the plan's ties broken by index):

- the window's **balancedness** (Σ_layers mean-over-ranks / Σ_layers max-over-ranks of the
  ranks' routed tokens, vLLM's definition) under the placement it ran on;
- recording only (``rebalance=False``: ``record_expert_load`` without ``enable_eplb``): the
  placement stays, whatever the balancedness;
- at or above ``eplb_min_balancedness`` (or nothing routed): the placement stays;
- else DeepSeek's plan (:func:`atom.dp.eplb.plan.rebalance`) on the window's logical loads;
  it replaces the placement when it predicts a balancedness on those loads at least
  :data:`MIN_GAIN` above the current one's (both with a replicated expert's load split evenly
  over its replicas).

The new placement applies from the next step: the caller moves the weights in between, in the
same tick, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atom.dp.eplb.plan import EplbPlan, balancedness, rank_loads, rebalance

#: the least gain in predicted balancedness a new placement must bring to replace the current
#: one: windows of the same load differ a little, and near-equal plans would otherwise
#: alternate at every window, each time pausing every rank for a move
MIN_GAIN = 0.01
#: upper bounds (seconds) of the rebalance-time histogram's buckets (``/metrics``)
REBALANCE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)


@dataclass(frozen=True)
class WindowResult:
    """What :meth:`EplbController.close_window` decided (identical on every rank).

    Attributes:
        step: the step count when the window closed (the rebalance tick's step).
        balancedness: of the window's routed tokens under the placement they ran on.
        num_routed: (token, expert) pairs routed in the window, all ranks.
        rebalanced: a new placement applies from the next step.
        predicted_balancedness: the new placement's on the window's loads (None if kept).
        logical_load: int64 ``[num_layers, num_logical]``: the window's load per expert.
    """

    step: int
    balancedness: float
    num_routed: int
    rebalanced: bool
    predicted_balancedness: float | None
    logical_load: np.ndarray

    def event(self, *, tick: int, phy2log: np.ndarray, timings: dict | None = None) -> dict:
        """The DP trace's ``eplb_window`` event (:mod:`atom.dp.dp_trace`) for this window,
        closed at DP tick ``tick``; ``phy2log`` (the placement from the next step on) is
        included when it changed; ``timings`` (the real run's ``plan_ms``, ``move_ms``) are
        added as they are."""
        event = {"event": "eplb_window", "tick": tick, "step": self.step,
                 "balancedness": self.balancedness, "num_routed": self.num_routed,
                 "rebalanced": self.rebalanced,
                 "predicted_balancedness": self.predicted_balancedness,
                 "logical_load": self.logical_load.tolist()}
        if self.rebalanced:
            event["phy2log"] = np.asarray(phy2log).tolist()
        return {**event, **(timings or {})}


def initial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> np.ndarray:
    """The placement before any rebalance: slot ``i`` holds expert ``i mod E`` (contiguous
    experts; the redundant slots, on the last ranks, repeat experts 0, 1, ...)."""
    return np.tile(np.arange(num_physical, dtype=np.int64) % num_logical, (num_layers, 1))


class EplbController:
    """One rank's (or the simulated group's) EPLB state: the step counter, this rank's window
    counts, the current placement and the last window's result. Mutated only by its owner
    (the rank's :class:`~atom.dp.eplb.manager.EplbManager`, or the simulator).

    Args:
        window_size, step_interval, min_balancedness, num_redundant: ``EngineConfig``'s
            ``eplb_*`` settings (:meth:`from_config`).
        num_layers: MoE layers.
        num_logical: experts of each layer.
        num_ranks: ranks of the EP group.
        num_groups, num_nodes: the plan's hierarchical mode (:func:`~atom.dp.eplb.plan.rebalance`).
        rebalance: False = record and measure the windows only, never move an expert.
    Raises:
        ValueError: the physical slots (experts + redundant) are not a multiple of the ranks.
    """

    def __init__(self, *, window_size: int, step_interval: int, min_balancedness: float,
                 num_redundant: int, num_layers: int, num_logical: int, num_ranks: int,
                 num_groups: int = 1, num_nodes: int = 1, rebalance: bool = True):
        self.num_physical = num_logical + num_redundant
        if self.num_physical % num_ranks and not rebalance:
            raise ValueError(f"record_expert_load: {num_logical} experts do not divide by the "
                             f"{num_ranks} ranks (the window counts each rank's share of "
                             f"equal slots): pick a DP size that divides {num_logical}")
        if self.num_physical % num_ranks:
            raise ValueError(f"EPLB: {num_logical} experts + {num_redundant} redundant slots = "
                             f"{self.num_physical} slots per layer, not a multiple of the "
                             f"{num_ranks} ranks: set eplb_num_redundant_experts so that the "
                             f"sum divides by the DP size")
        self.window_size, self.step_interval = window_size, step_interval
        self.min_balancedness = min_balancedness
        self.rebalance = rebalance
        self.num_layers, self.num_logical, self.num_ranks = num_layers, num_logical, num_ranks
        self.num_groups, self.num_nodes = num_groups, num_nodes
        self.plan = EplbPlan.from_phy2log(
            initial_phy2log(num_layers, num_logical, self.num_physical), num_logical)
        self.step = 0
        self.num_rebalances = 0
        self.last_window: WindowResult | None = None
        self._logical = np.zeros((num_layers, num_logical), dtype=np.int64)
        self._rank = np.zeros((num_layers, num_ranks), dtype=np.int64)

    @classmethod
    def from_config(cls, config, **sizes) -> EplbController:
        """From an :class:`~atom.config.EngineConfig`'s ``eplb_*`` fields and the model's
        ``sizes`` (the other keyword arguments); it rebalances only with ``enable_eplb``
        (``record_expert_load`` alone records)."""
        return cls(window_size=config.eplb_window_size, step_interval=config.eplb_step_interval,
                   min_balancedness=config.eplb_min_balancedness,
                   num_redundant=config.eplb_num_redundant_experts,
                   rebalance=config.enable_eplb, **sizes)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def recording(self) -> bool:
        """Whether the step about to run is in the window (module docstring)."""
        return self.step % self.step_interval >= self.step_interval - self.window_size

    def record(self, slot_counts: np.ndarray) -> None:
        """Add one step's routed tokens per slot, int ``[num_layers, num_physical]`` (this
        rank's tokens; the group's in the simulator), under the current placement. Call only
        while :attr:`recording`."""
        counts = np.asarray(slot_counts, dtype=np.int64)
        for layer in range(self.num_layers):
            self._logical[layer] += np.bincount(self.plan.phy2log[layer], weights=counts[layer],
                                                minlength=self.num_logical).astype(np.int64)
        self._rank += counts.reshape(self.num_layers, self.num_ranks, -1).sum(axis=2)

    def end_step(self) -> bool:
        """Count one step; True when it ended an interval (the window closes now: all-reduce
        :meth:`take_window`, then :meth:`close_window`)."""
        self.step += 1
        return self.step % self.step_interval == 0

    def take_window(self) -> np.ndarray:
        """This rank's window counts as one int64 vector (the logical loads ``[L, E]``, then
        the ranks' loads ``[L, W]``, flattened) for the SUM all-reduce; resets them."""
        vector = np.concatenate([self._logical.ravel(), self._rank.ravel()])
        self._logical[:] = 0
        self._rank[:] = 0
        return vector

    def close_window(self, totals: np.ndarray) -> WindowResult:
        """Decide on the window (module docstring) from ``totals``, :meth:`take_window` summed
        over the ranks; switches :attr:`plan` when it rebalances."""
        totals = np.asarray(totals, dtype=np.int64)
        split = self.num_layers * self.num_logical
        logical = totals[:split].reshape(self.num_layers, self.num_logical)
        ranks = totals[split:].reshape(self.num_layers, self.num_ranks)
        measured = balancedness(ranks)
        plan = predicted = None
        if self.rebalance and measured < self.min_balancedness:
            plan = rebalance(logical, num_physical=self.num_physical, num_ranks=self.num_ranks,
                             num_groups=self.num_groups, num_nodes=self.num_nodes)
            predicted = balancedness(rank_loads(logical, plan, self.num_ranks))
            current = balancedness(rank_loads(logical, self.plan, self.num_ranks))
            if predicted < current + MIN_GAIN:
                plan = predicted = None  # no placement worth a move for this load
        if plan is not None:
            self.plan = plan
            self.num_rebalances += 1
        self.last_window = WindowResult(step=self.step, balancedness=measured,
                                        num_routed=int(ranks.sum()), rebalanced=plan is not None,
                                        predicted_balancedness=predicted, logical_load=logical)
        return self.last_window
