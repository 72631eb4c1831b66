"""PrefillDelayer: cross-rank prefill alignment (DESIGN.md, "PrefillDelayer").

With expert parallelism every rank runs the same MoE collectives in every step, so a step lasts
as long as its slowest rank. A rank that prefills while the others decode stretches everyone's
step to a prefill's length for one rank's benefit; prefills that start in the same step on every
rank share that cost. The delayer therefore holds prefills on all ranks while only some of the
ranks with pending prefill work could admit one, for a bounded number of ticks.

Per tick, each rank computes its inputs from the scheduler's own admission dry run
(:meth:`PrefillDelayer.local_inputs`), the control sync gathers them (:mod:`atom.dp.sync`), and
:meth:`PrefillDelayer.decide` turns the gathered values into one :class:`Decision`, identical on
every rank, which the DP loop hands to the scheduler as a plain value
(``schedule(allow_prefill=decision.allow)``). A rank is *ready* when ``num_admittable >= 1``
(``>= 2`` with TBO on: a split needs two prefills).

================  ===============================================================  =========
status            condition (over the gathered ranks)                              decision
================  ===============================================================  =========
``none``          no rank is ready: nothing to align                               allow
``all``           every rank with pending prefill work is ready (ranks without     allow
                  pending work have nothing to align and hold no one)
``mixed``         some ranks with pending work are ready, others are not           hold …
  ↳ watermark     … unless a ready rank's gathered KV usage is below the low       allow
                  watermark
  ↳ timeout       … unless ``max_delay_passes`` holds ran back to back             allow
================  ===============================================================  =========

The hold counter resets on every allow, so no hold lasts more than ``max_delay_passes`` ticks.

Lineage: SGLang #14201 / #16269, ATOM #930 / #1017. Failure modes designed out: per-rank wall
clocks (SGLang #30521; here every input is gathered and the only state is a tick counter that
evolves identically on every rank); unbounded holds and never-decaying inputs (SGLang #32880;
holds are bounded, inputs are recomputed every tick); readiness that differs from admission
(SGLang #31835, ATOM #930; inputs come from ``Scheduler.preview_admission``, the dry run of the
scheduler's own admission).
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from atom.config import EngineConfig
from atom.dp.groups import rank_logger
from atom.dp.sync import GatheredControl, kv_usage_to_ppm

logger = logging.getLogger(__name__)

# num_admittable is capped: readiness needs at most 2, and a small cap keeps the dry run short
MAX_NUM_ADMITTABLE = 4


class AlignmentStatus(enum.Enum):
    NONE = "none"
    ALL = "all"
    MIXED = "mixed"


class DecisionReason(enum.Enum):
    """Why the tick allowed or held prefills (the values are the counter names)."""

    ALLOW_NONE = "allow_none"
    ALLOW_ALL = "allow_all"
    HOLD = "hold"
    TIMEOUT = "timeout"
    WATERMARK = "watermark"
    DISABLED = "disabled"


@dataclass(frozen=True)
class Decision:
    """One tick's decision (identical on every rank)."""

    reason: DecisionReason
    status: AlignmentStatus
    num_ready_ranks: int
    num_pending_ranks: int  # ranks with pending prefill work
    num_consecutive_holds: int  # holds in a row up to and including this tick (0 on allow)

    @property
    def allow(self) -> bool:
        return self.reason is not DecisionReason.HOLD


@dataclass(frozen=True)
class PrefillInputs:
    """This rank's delayer fields of the control vector (see :class:`atom.dp.sync.ControlState`)."""

    num_admittable: int
    has_pending_prefill: bool
    kv_usage_ppm: int


class _KVPool(Protocol):
    @property
    def kv_usage(self) -> float: ...


class AdmissionSource(Protocol):
    """What the delayer reads from a rank's scheduler (``atom.scheduler.Scheduler``)."""

    block_manager: _KVPool

    def preview_admission(self): ...  # -> atom.scheduler.AdmissionPreview

    def has_pending_prefill(self) -> bool: ...


class PrefillDelayer:
    """The DP prefill decision of one rank: owns the hold counter and the decision counters.

    Call :meth:`local_inputs` before the control sync and :meth:`decide` once per tick with the
    gathered values, before ``schedule()``. Its state is a pure function of the sequence of
    gathered values (and of the deployment's config, identical on every rank), so it is
    identical on every rank.

    Args:
        config: the engine config: ``resolved_prefill_delayer()`` (enabled),
            ``prefill_delayer_max_delay_passes``, ``prefill_delayer_kv_low_watermark`` and
            ``enable_tbo`` (readiness needs 2 admittable prefills) are read; validated there.
        dp_rank: for the log prefix.
        log_every_n_decisions: log the counters every N decisions at INFO; None never.
    Raises:
        ValueError: ``log_every_n_decisions`` below 1.
    """

    def __init__(self, config: EngineConfig, *, dp_rank: int = 0,
                 log_every_n_decisions: int | None = 1000):
        if log_every_n_decisions is not None and log_every_n_decisions < 1:
            raise ValueError(f"log_every_n_decisions={log_every_n_decisions!r}: use an integer "
                             f">= 1, or None to never log")
        self.enabled = config.resolved_prefill_delayer()
        self.max_delay_passes = config.prefill_delayer_max_delay_passes
        watermark = config.prefill_delayer_kv_low_watermark
        self.kv_low_watermark_ppm = None if watermark is None else kv_usage_to_ppm(watermark)
        # readiness needs two admittable prefills with TBO: a split needs two
        self.min_num_admittable = 2 if config.enable_tbo else 1
        self.log_every_n_decisions = log_every_n_decisions
        self._log = rank_logger(logger, dp_rank)
        self._num_consecutive_holds = 0
        self._max_consecutive_holds = 0
        self._num_decisions = 0
        self._num_ready_ticks = 0
        self._num_mixed_ticks = 0
        self._counts: Counter[DecisionReason] = Counter()

    def local_inputs(self, scheduler: AdmissionSource) -> PrefillInputs:
        """This rank's inputs, from the scheduler's side-effect-free admission dry run."""
        return PrefillInputs(
            num_admittable=min(scheduler.preview_admission().num_prefills, MAX_NUM_ADMITTABLE),
            has_pending_prefill=scheduler.has_pending_prefill(),
            kv_usage_ppm=kv_usage_to_ppm(scheduler.block_manager.kv_usage))

    def decide(self, gathered: GatheredControl) -> Decision:
        """Classify the tick and decide (table in the module docstring); updates the counters."""
        ready = gathered.num_admittable >= self.min_num_admittable
        pending = gathered.has_pending_prefill | ready  # ready implies pending work
        if not ready.any():
            status = AlignmentStatus.NONE
        elif np.array_equal(ready, pending):
            status = AlignmentStatus.ALL
        else:
            status = AlignmentStatus.MIXED
        reason = self._reason(status, ready, gathered.kv_usage_ppm)
        if reason is DecisionReason.HOLD:
            self._num_consecutive_holds += 1
            self._max_consecutive_holds = max(self._max_consecutive_holds,
                                              self._num_consecutive_holds)
        else:
            self._num_consecutive_holds = 0
        decision = Decision(reason, status, int(ready.sum()), int(pending.sum()),
                            self._num_consecutive_holds)
        self._count(decision)
        return decision

    def _reason(self, status: AlignmentStatus, ready: np.ndarray,
                kv_usage_ppm: np.ndarray) -> DecisionReason:
        if not self.enabled:
            return DecisionReason.DISABLED
        if status is AlignmentStatus.NONE:
            return DecisionReason.ALLOW_NONE
        if status is AlignmentStatus.ALL:
            return DecisionReason.ALLOW_ALL
        watermark = self.kv_low_watermark_ppm
        if watermark is not None and (ready & (kv_usage_ppm < watermark)).any():
            return DecisionReason.WATERMARK
        if self._num_consecutive_holds >= self.max_delay_passes:
            return DecisionReason.TIMEOUT
        return DecisionReason.HOLD

    def _count(self, decision: Decision) -> None:
        self._num_decisions += 1
        self._counts[decision.reason] += 1
        if decision.status is not AlignmentStatus.NONE:
            self._num_ready_ticks += 1
        if decision.status is AlignmentStatus.MIXED:
            self._num_mixed_ticks += 1
        self._log.debug("prefill delayer: %s (%s, %d/%d pending ranks ready, %d holds in a row)",
                        decision.reason.value, decision.status.value, decision.num_ready_ranks,
                        decision.num_pending_ranks, decision.num_consecutive_holds)
        every = self.log_every_n_decisions
        if every is not None and self._num_decisions % every == 0:
            self._log.info("prefill delayer: %s", ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in self.stats().items()))

    @property
    def hold_rate(self) -> float:
        """Holds ÷ ticks where some rank was ready (0.0 before any such tick)."""
        holds = self._counts[DecisionReason.HOLD]
        return holds / self._num_ready_ticks if self._num_ready_ticks else 0.0

    def stats(self) -> dict[str, int | float]:
        """Counters for metrics: decisions per reason, ready and mixed ticks, hold rate, and the
        longest run of consecutive holds (never more than ``max_delay_passes``)."""
        out: dict[str, int | float] = {"num_decisions": self._num_decisions}
        out.update({reason.value: self._counts[reason] for reason in DecisionReason})
        out.update(num_ready_ticks=self._num_ready_ticks, num_mixed_ticks=self._num_mixed_ticks,
                   hold_rate=self.hold_rate, max_consecutive_holds=self._max_consecutive_holds)
        return out
