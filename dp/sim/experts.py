"""The simulator's experts: where routed tokens go, where they run, and what the skew costs.

Three parts, torch-free:

- **a routing source** says how many tokens each rank's step routes to each physical slot:
  :class:`ExpertPopularity` (a skew model: each MoE layer's expert popularity, Zipf with an
  exponent or read from a real run's ``LLM.get_expert_load()`` dump, applied to the step's
  token counts with the engine's replica rule in expectation,
  :func:`atom.dp.eplb.replicas.replica_split`), or :class:`RecordedExpertLoad` (a real run's
  per-tick, per-rank counts from its DP trace's ``eplb_load`` column: the simulator then
  computes no routing at all);
- **the placement**: the contiguous one expert parallelism loads, or, with ``enable_eplb``,
  EPLB's own :class:`~atom.dp.eplb.controller.EplbController`, fed the group's counts (the sum
  the real ranks' all-reduce makes) at the same steps, closing the same windows and computing
  the same plans as the real ranks (:class:`SimExperts`); with ``record_expert_load`` alone the
  same controller records and measures the windows and keeps the contiguous placement;
- **the cost**: every MoE layer's combine waits for the rank with the most routed tokens, so
  the step's expert compute is that of the busiest rank of each layer: the cost model's MLP
  rows are scaled by the step's **imbalance**, Σ_layers max-over-ranks / Σ_layers
  mean-over-ranks of the routed tokens (1 when balanced; 1 / the step's balancedness).

Where the model is coarse: a step's imbalance comes from expected loads (a small batch's
sampling noise is not modelled), and the rows padding every rank's block to the step's largest
(which the real engine routes and computes but never counts) are assumed to follow the same
distribution. A rebalance's pause (plan and weight move, milliseconds on the tiny models here)
is not charged.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from atom.dp.eplb.controller import EplbController, WindowResult
from atom.dp.eplb.replicas import replica_split


class RoutingSource(Protocol):
    """How many tokens each rank's step routes to each slot."""

    num_layers: int
    num_experts: int

    def counts(self, tick: int, num_tokens: Sequence[int], split: np.ndarray) -> np.ndarray:
        """``[W, num_layers, num_physical]``: the tokens each rank's step at DP tick ``tick``
        routes to each slot (expected loads, or recorded counts), its ranks running
        ``num_tokens`` tokens, under the placement whose
        :func:`~atom.dp.eplb.replicas.replica_split` is ``split`` ``[num_layers, E,
        num_physical]``."""


class ExpertPopularity:
    """A routing-skew model: a fixed popularity per MoE layer (module docstring); its counts
    are the expected loads.

    Args:
        popularity: float ``[num_layers, E]``, rows summing to 1: each expert's share of a
            layer's routed (token, expert) pairs.
        top_k: experts per token.
    Raises:
        ValueError: not 2-D or empty, ``top_k`` not 1 to E, a row that does not sum to 1, or a
            share above ``1 / top_k`` (a token picks an expert once).
    """

    def __init__(self, popularity: np.ndarray, *, top_k: int):
        popularity = np.asarray(popularity, dtype=np.float64)
        if popularity.ndim != 2 or popularity.size == 0:
            raise ValueError(f"popularity must be [layers, experts], got shape {popularity.shape}")
        if not 1 <= top_k <= popularity.shape[1]:
            raise ValueError(f"top_k {top_k}: a token picks 1 to {popularity.shape[1]} distinct "
                             f"experts (the layer's number)")
        if not np.allclose(popularity.sum(axis=1), 1.0):
            raise ValueError("popularity must be [layers, experts] with rows summing to 1")
        if (popularity > 1.0 / top_k + 1e-9).any():
            raise ValueError(f"a share above 1/top_k = {1 / top_k:.3f}: a token picks an "
                             f"expert at most once")
        self.popularity, self.top_k = popularity, top_k
        self.num_layers, self.num_experts = popularity.shape

    @classmethod
    def zipf(cls, num_layers: int, num_experts: int, *, top_k: int, exponent: float,
             seed: int = 0) -> ExpertPopularity:
        """Zipf popularity (the ``r``-th most popular expert's share ∝ ``r ** -exponent``,
        capped at ``1 / top_k``), the ranking a seeded random permutation per layer (hot
        experts anywhere); ``exponent`` 0 is uniform. Raises ValueError for no layer or
        expert, a ``top_k`` not 1 to ``num_experts``, or an exponent that is negative or not
        finite."""
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"a Zipf popularity needs a layer and an expert (got {num_layers} "
                             f"layers, {num_experts} experts)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k}: a token picks 1 to {num_experts} distinct experts")
        if not (np.isfinite(exponent) and exponent >= 0):
            raise ValueError(f"Zipf exponent {exponent}: a finite number >= 0 (0 is uniform)")
        rng = np.random.default_rng(seed)
        shares = _capped(np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent,
                         1.0 / top_k)
        return cls(np.stack([shares[rng.permutation(num_experts)] for _ in range(num_layers)]),
                   top_k=top_k)

    @classmethod
    def from_load(cls, load: np.ndarray, *, top_k: int) -> ExpertPopularity:
        """From a recorded load ``[num_layers, E]`` (``LLM.get_expert_load()``), capped at
        ``1 / top_k``. Raises ValueError for a layer with no routed token."""
        load = np.asarray(load, dtype=np.float64)
        if (load.sum(axis=1) <= 0).any():
            raise ValueError("the recorded load has a layer with no routed token")
        return cls(np.stack([_capped(row, 1.0 / top_k) for row in load]), top_k=top_k)

    @classmethod
    def read(cls, path: str | pathlib.Path, *, top_k: int) -> ExpertPopularity:
        """From a dump of ``LLM.get_expert_load()``: ``numpy.save``'s ``.npy``, or JSON (a
        list of per-layer lists). Raises ValueError for anything else."""
        path = pathlib.Path(path)
        load = (np.load(path) if path.suffix == ".npy"
                else np.asarray(json.loads(path.read_text()), dtype=np.float64))
        if load.ndim != 2:
            raise ValueError(f"{path}: expected [layers, experts], got shape {load.shape}")
        return cls.from_load(load, top_k=top_k)

    def counts(self, tick: int, num_tokens: Sequence[int], split: np.ndarray) -> np.ndarray:
        return np.einsum("s,lep->slp", np.asarray(num_tokens, dtype=np.float64),
                         np.einsum("le,lep->lep", self.popularity * self.top_k, split))


class RecordedExpertLoad:
    """A real run's per-tick counts, replayed (module docstring): ``by_tick[tick]`` is every
    rank's flattened ``[num_layers, num_physical]`` row; a tick without one routed nothing that
    was recorded (outside the window) and counts zero."""

    def __init__(self, by_tick: dict[int, list[list[int]]], *, num_layers: int, num_experts: int):
        self.by_tick, self.num_layers, self.num_experts = by_tick, num_layers, num_experts

    @classmethod
    def from_trace(cls, folder: str | pathlib.Path, *, num_layers: int,
                   num_experts: int) -> RecordedExpertLoad:
        """From a DP trace folder (:func:`atom.dp.dp_trace.read_trace`) written with EPLB on."""
        from atom.dp.dp_trace import read_trace

        traces = read_trace(folder)
        by_tick: dict[int, list[list[int]]] = {}
        for trace in traces:
            for row in trace.rows:
                if row.get("eplb_load") is not None:
                    by_tick.setdefault(row["tick"], [[] for _ in traces])[trace.dp_rank] = (
                        row["eplb_load"])
        return cls(by_tick, num_layers=num_layers, num_experts=num_experts)

    def counts(self, tick: int, num_tokens: Sequence[int], split: np.ndarray) -> np.ndarray:
        num_layers, _, num_physical = split.shape
        rows = self.by_tick.get(tick)
        if rows is None:
            return np.zeros((len(num_tokens), num_layers, num_physical), dtype=np.int64)
        return np.asarray(rows, dtype=np.int64).reshape(len(num_tokens), num_layers,
                                                        num_physical)


class EplbRow(NamedTuple):
    """What a rank's trace row carries of EPLB (:func:`atom.dp.dp_trace.tick_row`'s ``eplb``)."""

    last_balancedness: float | None
    tick_load: list[int] | None
    expert_us: None = None  # the real rank's clock; the simulator has none per rank


class SimExperts:
    """The simulated group's experts (module docstring): owns the routing source, the
    placement (EPLB's controller, or the contiguous shards) and the last step's counts.

    Args:
        config: the deployment (``enable_eplb`` and its ``eplb_*`` settings,
            ``eplb_fake_uniform``: every expert the same share).
        source: the routing source.
        num_ranks: the DP size.
    Raises:
        ValueError: fewer experts than ranks, or EPLB slots that do not divide by the ranks.
    """

    def __init__(self, config, source: RoutingSource, *, num_ranks: int):
        num_layers, num_experts = source.num_layers, source.num_experts
        if num_experts < num_ranks:
            raise ValueError(f"{num_experts} experts cannot be spread over {num_ranks} ranks")
        if config.eplb_fake_uniform:
            source = ExpertPopularity(np.full((num_layers, num_experts), 1.0 / num_experts),
                                      top_k=1)
        self.source, self.num_ranks = source, num_ranks
        self.controller = (EplbController.from_config(config, num_layers=num_layers,
                                                      num_logical=num_experts,
                                                      num_ranks=num_ranks)
                           if config.resolved_record_expert_load() else None)
        if self.controller is not None:
            num_slots = self.controller.num_physical
            self._slot_rank = np.arange(num_slots) // self.controller.slots_per_rank
            self._split = replica_split(self.controller.plan)
        else:  # expert e in slot e, the contiguous shards of expert parallelism (maybe uneven)
            # atom.layers.moe.expert_range's starts (that module imports torch)
            starts = [r * num_experts // num_ranks for r in range(num_ranks)]
            self._slot_rank = np.searchsorted(starts, np.arange(num_experts), side="right") - 1
            self._split = np.broadcast_to(np.eye(num_experts), (num_layers, num_experts,
                                                                 num_experts))
        self._tick_counts: np.ndarray | None = None
        self._remainder = 0.0  # what rounding the expected loads to counts has left over
        self.windows: list[tuple[int, WindowResult]] = []  # (DP tick, result) of each window
        self._imbalance_sum, self._num_routed_steps = 0.0, 0

    def step(self, tick: int, num_tokens: Sequence[int]) -> float:
        """Route the step at DP tick ``tick`` (its ranks' token counts), record it while the
        window records; returns the step's imbalance (module docstring)."""
        loads = self.source.counts(tick, num_tokens, self._split)  # [W, L, P]
        recording = self.controller is not None and self.controller.recording
        self._tick_counts = None
        if recording:  # integer counts whose running sum follows the expected loads
            total = self._remainder + loads
            counts = np.floor(total + 1e-9)
            self._remainder = total - counts
            self._tick_counts = counts.astype(np.int64)
            self.controller.record(self._tick_counts.sum(axis=0))
        rank_load = np.zeros((loads.shape[1], self.num_ranks))
        np.add.at(rank_load.T, self._slot_rank, loads.sum(axis=0).T)
        peak = rank_load.max(axis=1).sum()
        if peak == 0:
            return 1.0
        imbalance = float(peak / rank_load.mean(axis=1).sum())
        self._imbalance_sum += imbalance
        self._num_routed_steps += 1
        return imbalance

    def end_step(self, tick: int) -> WindowResult | None:
        """Count the step; at the end of an interval close the window on the group's counts
        (the real ranks' all-reduce) and switch to the new placement."""
        controller = self.controller
        if controller is None or not controller.end_step():
            return None
        result = controller.close_window(controller.take_window())
        if result.rebalanced:
            self._split = replica_split(controller.plan)
        self.windows.append((tick, result))
        return result

    def summary(self) -> dict:
        """The run's expert figures: the mean imbalance of the steps that routed tokens, and
        with EPLB every window (DP tick, balancedness, rebalanced) and the rebalances."""
        out: dict = {"mean_imbalance": self._imbalance_sum / max(1, self._num_routed_steps)}
        if self.controller is not None:
            out["windows"] = [{"tick": tick, "balancedness": w.balancedness,
                               "rebalanced": w.rebalanced} for tick, w in self.windows]
            out["num_rebalances"] = self.controller.num_rebalances
        return out

    def row(self, dp_rank: int) -> EplbRow | None:
        """Rank ``dp_rank``'s EPLB trace columns for the last step (None without EPLB)."""
        if self.controller is None:
            return None
        window = self.controller.last_window
        load = self._tick_counts
        return EplbRow(None if window is None else window.balancedness,
                       None if load is None else load[dp_rank].ravel().tolist())


def _capped(weights: np.ndarray, cap: float) -> np.ndarray:
    """``weights`` normalized to sum 1 with no share above ``cap`` (the excess of capped
    shares spread over the others in proportion)."""
    shares = weights / weights.sum()
    for _ in range(len(shares)):
        over = shares > cap
        if not over.any():
            break
        excess = (shares[over] - cap).sum()
        shares[over] = cap
        free = ~over & (shares < cap)
        shares[free] += excess * shares[free] / shares[free].sum()
    return shares
