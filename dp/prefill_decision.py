"""What every cross-rank prefill rule shares: the reasons a tick allows or holds, the tick's
decision, and readiness.

Its own module so that the rules (:mod:`atom.dp.prefill_delayer`,
:mod:`atom.dp.prefill_coalescer`) and the decider that runs them
(:mod:`atom.dp.prefill_policy`) all import it and never each other. Torch-free; every value
here is a function of gathered vectors (:class:`atom.dp.sync.GatheredControl`), so it is
identical on every rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from atom.dp.sync import GatheredControl


class DecisionReason(enum.Enum):
    """Why a tick allowed or held prefills; the values are the counter names. Each policy
    documents which it returns (``PrefillPolicy.reasons``)."""

    DISABLED = "disabled"  # none: no policy, always allow
    ALLOW_NONE = "allow_none"  # no rank is ready: nothing to hold
    ALLOW_ALL = "allow_all"  # delayer: every rank with pending prefill work is ready
    HOLD = "hold"  # some ranks with pending work are ready, others are not (alignment)
    TIMEOUT = "timeout"  # delayer: max_delay_passes holds ran back to back
    WATERMARK = "watermark"  # delayer: a ready rank's KV usage is below the low watermark
    FIRE_NO_DECODE = "fire_no_decode"  # coalescer: no rank decodes, nothing hides the wait
    FIRE_KV_HIGH = "fire_kv_high"  # coalescer: a ready rank's KV usage is at the high watermark
    FIRE_PARTIAL = "fire_partial"  # coalescer: a partial prefill was held too long
    FIRE_TTFT = "fire_ttft"  # coalescer: the episode's holds reached ttft_max_ticks
    FIRE_QUEUE_AGE = "fire_queue_age"  # coalescer: a ready rank's oldest request queued too long
    FIRE_FILL = "fire_fill"  # coalescer: the summed prefill tokens fill the target
    FIRE_STALL = "fire_stall"  # coalescer: the sum stopped growing
    HOLD_FILL = "hold_fill"  # coalescer: waiting for the sum to fill the target
    HOLD_DECODE_INTERVAL = "hold_decode_interval"  # interval: a prefill ran within N ticks

    @property
    def holds(self) -> bool:
        return self in HOLDS


HOLDS = frozenset((DecisionReason.HOLD, DecisionReason.HOLD_FILL,
                   DecisionReason.HOLD_DECODE_INTERVAL))


@dataclass(frozen=True)
class Decision:
    """One tick's prefill decision (identical on every rank).

    Attributes:
        reason: why (one counter per reason).
        num_consecutive_holds: holds in a row up to and including this tick (0 on allow).
    """

    reason: DecisionReason
    num_consecutive_holds: int = 0

    @property
    def allow(self) -> bool:
        return not self.reason.holds


@dataclass(frozen=True)
class Readiness:
    """Which ranks could admit a prefill now (*ready*: gathered ``num_admittable`` at least
    ``min_num_admittable``) and which have prefill work at all (*pending*: waiting or
    partial-prefill work, or ready). The one readiness rule of every policy.

    Attributes:
        ready: bool [world_size].
        pending: bool [world_size]; ready implies pending.
    """

    ready: np.ndarray
    pending: np.ndarray

    @classmethod
    def of(cls, gathered: GatheredControl, *, min_num_admittable: int) -> Readiness:
        ready = gathered.num_admittable >= min_num_admittable
        return cls(ready, gathered.has_pending_prefill | ready)

    def any_ready(self) -> bool:
        return bool(self.ready.any())

    def aligned(self) -> bool:
        """Every rank with pending prefill work is ready (ranks without any hold no one)."""
        return bool(np.array_equal(self.ready, self.pending))


def min_num_admittable(*, enable_tbo: bool) -> int:
    """Admittable prefills that make a rank ready: 2 with TBO (a split needs two), else 1."""
    return 2 if enable_tbo else 1
