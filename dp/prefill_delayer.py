"""PrefillDelayer: cross-rank prefill alignment (docs/ARCHITECTURE.md, "Across ranks"), the
``--prefill-policy delayer`` (the default with DP > 1; the interface is in
:mod:`atom.dp.prefill_policy`).

Prefills that start in the same step on every rank share the cost of a prefill-length step; a
rank that prefills alone stretches everyone's step for one rank's benefit. The delayer therefore
holds prefills on all ranks while only some of the ranks with pending prefill work could admit
one, for a bounded number of ticks. A rank is *ready* when its gathered ``num_admittable`` (the
scheduler's admission dry run) is ``>= 1`` (``>= 2`` with TBO on: a split needs two prefills).

==============  =================================================================  =========
reason          condition (over the gathered ranks)                                decision
==============  =================================================================  =========
``allow_none``  no rank is ready: nothing to align                                 allow
``allow_all``   every rank with pending prefill work is ready (ranks without       allow
                pending work have nothing to align and hold no one)
``hold``        *mixed*: some ranks with pending work are ready, others are not    hold …
``watermark``   … unless a ready rank's gathered KV usage is below the low         allow
                watermark
``timeout``     … unless ``max_delay_passes`` holds ran back to back               allow
==============  =================================================================  =========

The hold run (counted by :class:`~atom.dp.prefill_policy.PrefillDecider`) ends on every allow,
so no hold lasts more than ``max_delay_passes`` ticks.

Lineage: SGLang #14201 / #16269, ATOM #930 / #1017. Failure modes designed out: per-rank wall
clocks (SGLang #30521; here every input is gathered and the only state is a tick counter that
evolves identically on every rank); unbounded holds and never-decaying inputs (SGLang #32880;
holds are bounded, inputs are recomputed every tick); readiness that differs from admission
(SGLang #31835, ATOM #930; inputs come from ``Scheduler.preview_admission``, the dry run of the
scheduler's own admission).
"""

from __future__ import annotations

import numpy as np

from atom.config import EngineConfig
from atom.dp.prefill_decision import DecisionReason, Readiness, min_num_admittable
from atom.dp.sync import GatheredControl, kv_usage_to_ppm


class PrefillDelayer:
    """The delayer rule (a :class:`~atom.dp.prefill_policy.PrefillPolicy`): owns the mixed
    tick counter.

    Its state is a pure function of the sequence of gathered values (and of the deployment's
    config, identical on every rank), so it is identical on every rank.

    Args:
        config: ``prefill_delayer_max_delay_passes``, ``prefill_delayer_kv_low_watermark`` and
            ``enable_tbo`` (readiness needs 2 admittable prefills) are read; validated there.
    """

    name = "delayer"
    reasons = (DecisionReason.ALLOW_NONE, DecisionReason.ALLOW_ALL, DecisionReason.HOLD,
               DecisionReason.TIMEOUT, DecisionReason.WATERMARK)

    def __init__(self, config: EngineConfig):
        self.max_delay_passes = config.prefill_delayer_max_delay_passes
        watermark = config.prefill_delayer_kv_low_watermark
        self.kv_low_watermark_ppm = None if watermark is None else kv_usage_to_ppm(watermark)
        self.min_num_admittable = min_num_admittable(enable_tbo=config.enable_tbo)
        self._num_mixed_ticks = 0

    def decide(self, gathered: GatheredControl, num_holds: int) -> DecisionReason:
        """Classify the tick and decide (table in the module docstring; ``num_holds``: the
        delayer's holds in a row before this tick)."""
        readiness = Readiness.of(gathered, min_num_admittable=self.min_num_admittable)
        if not readiness.any_ready():
            reason = DecisionReason.ALLOW_NONE
        elif readiness.aligned():
            reason = DecisionReason.ALLOW_ALL
        else:
            reason = self._mixed(readiness.ready, gathered.kv_usage_ppm, num_holds)
        self._num_mixed_ticks += reason not in (DecisionReason.ALLOW_NONE,
                                                DecisionReason.ALLOW_ALL)
        return reason

    def _mixed(self, ready: np.ndarray, kv_usage_ppm: np.ndarray, num_holds: int
               ) -> DecisionReason:
        watermark = self.kv_low_watermark_ppm
        if watermark is not None and (ready & (kv_usage_ppm < watermark)).any():
            return DecisionReason.WATERMARK
        if num_holds >= self.max_delay_passes:
            return DecisionReason.TIMEOUT
        return DecisionReason.HOLD

    def stats(self) -> dict[str, int | float]:
        """Ticks where some ranks with pending prefill work were ready and others not."""
        return {"num_mixed_ticks": self._num_mixed_ticks}
