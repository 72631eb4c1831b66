"""PrefillCoalescer: hold prefills until the ranks' admittable prompt tokens fill a worthwhile
step (``--prefill-policy coalescer``; the interface is in :mod:`atom.dp.prefill_policy`).

Nagle's algorithm for prefill (ATOM #1611): every prefill step has a near-fixed cost on every
rank (a step lasts as long as the slowest rank, and with expert parallelism every rank joins
every MoE collective), so many small prefills — a short fresh prompt, the tail chunk of a long
one — waste most of the steps they stretch. The coalescer holds admission while decodes keep
running, and fires once the tokens the ranks could prefill *summed over the ranks* fill a
target fraction of the step budget. The sum (not the max) lets quiet ranks keep accumulating
instead of being dragged into small prefills. The delayer's alignment gate stays: it holds
while some ranks with pending work cannot admit yet.

Inputs per rank (gathered, :class:`atom.dp.sync.ControlState`): ``num_admittable`` and
``num_prefill_tokens`` (the scheduler's admission dry run: fresh waiting prompts and the next
chunks of partial prefills, after prefix-cache hits, within the token budget — not raw prompt
lengths, which never reached the target in ATOM #2196), ``num_running_decodes``,
``kv_usage_ppm``, ``has_partial_prefill``, ``has_pending_prefill`` and
``oldest_waiting_age_ticks``. A rank is *ready* when it can admit (``num_admittable >= 1``, ``>= 2``
with TBO), *pending* when it has prefill work at all.

Decision, first match wins (``holds`` = this episode's holds in a row; every reason that
allows ends the episode):

===================  ==============================================================  =======
reason               condition (over the gathered ranks)                             result
===================  ==============================================================  =======
``allow_none``       no rank is ready: nothing to hold                               allow
``fire_no_decode``   no rank has a running decode: a hold would only idle the ranks  allow
``fire_kv_high``     a ready rank's KV usage is at or above ``kv_high_watermark``    allow
``fire_partial``     some rank has a partial prefill and ``holds >=                  allow
                     partial_max_ticks`` (it holds KV blocks while it waits)
``fire_ttft``        ``holds >= ttft_max_ticks``: every request this episode held    allow
                     has waited that long for the coalescer
``fire_queue_age``   (``max_queue_ticks`` set) a ready rank's oldest waiting         allow
                     request has been queued that long, backlog included
``hold``             alignment gate: some ranks with pending work are not ready      hold
``fire_fill``        sum of ``num_prefill_tokens`` >= ``target_fill`` x budget x     allow
                     (ranks with pending work)
``fire_stall``       the sum has not grown for ``stall_ticks`` fill checks           allow
``hold_fill``        otherwise                                                       hold
===================  ==============================================================  =======

Every hold is bounded: no episode lasts more than ``ttft_max_ticks`` ticks, nor more than
``partial_max_ticks`` while a partial prefill waits. The TTFT bound counts the episode's holds
(ATOM #1611's ``TTFT_MAX_TICKS``), not queue age: a request's total wait includes ticks it
could not have run anyway (no KV blocks, no sequence slot), and a bound on that fires on every
tick of a backlog, so the coalescer would never coalesce under load. The queue-age guard is
there for a latency SLA and off by default (like ATOM's ``max_queue_ms``). The only state is
the episode's stall counter and last sum (its holds are the decider's hold run), all functions
of the gathered sequence, identical on every rank. Defaults are ATOM #1611's (target fill 0.7, 30 / 8 / 3
ticks, KV high 0.9).
"""

from __future__ import annotations

import numpy as np

from atom.config import EngineConfig
from atom.dp.prefill_decision import DecisionReason, Readiness, min_num_admittable
from atom.dp.sync import GatheredControl, kv_usage_to_ppm


class PrefillCoalescer:
    """The coalescer rule (a :class:`~atom.dp.prefill_policy.PrefillPolicy`): owns the
    episode's stall counter and the last summed prefill tokens (the episode's holds are the
    hold run :class:`~atom.dp.prefill_policy.PrefillDecider` counts and hands in).

    Args:
        config: ``max_num_batched_tokens`` (the budget), ``enable_tbo`` (readiness) and the
            ``prefill_coalescer_*`` settings are read; validated there.
    """

    name = "coalescer"
    reasons = (DecisionReason.ALLOW_NONE, DecisionReason.FIRE_NO_DECODE,
               DecisionReason.FIRE_KV_HIGH, DecisionReason.FIRE_PARTIAL,
               DecisionReason.FIRE_TTFT, DecisionReason.FIRE_QUEUE_AGE, DecisionReason.HOLD,
               DecisionReason.FIRE_FILL, DecisionReason.FIRE_STALL, DecisionReason.HOLD_FILL)

    def __init__(self, config: EngineConfig):
        self.token_budget = config.max_num_batched_tokens
        self.target_fill = config.prefill_coalescer_target_fill
        self.ttft_max_ticks = config.prefill_coalescer_ttft_max_ticks
        self.partial_max_ticks = config.prefill_coalescer_partial_max_ticks
        self.stall_ticks = config.prefill_coalescer_stall_ticks
        self.max_queue_ticks = config.prefill_coalescer_max_queue_ticks
        self.kv_high_watermark_ppm = kv_usage_to_ppm(config.prefill_coalescer_kv_high_watermark)
        self.min_num_admittable = min_num_admittable(enable_tbo=config.enable_tbo)
        self._num_stalls = 0  # fill checks in a row without growth of the sum
        self._last_sum: int | None = None  # summed prefill tokens at the last fill check

    def decide(self, gathered: GatheredControl, num_holds: int) -> DecisionReason:
        """This tick's reason (table in the module docstring; ``num_holds``: the episode's
        holds so far)."""
        reason = self._reason(gathered, num_holds)
        if not reason.holds:  # every allow ends the episode
            self._num_stalls = 0
            self._last_sum = None
        return reason

    def _reason(self, g: GatheredControl, num_holds: int) -> DecisionReason:
        readiness = Readiness.of(g, min_num_admittable=self.min_num_admittable)
        if not readiness.any_ready():
            return DecisionReason.ALLOW_NONE
        must_fire = self._must_fire(g, readiness.ready, num_holds)
        if must_fire is not None:
            return must_fire
        if not readiness.aligned():
            return DecisionReason.HOLD
        pending = readiness.pending
        total = int(g.num_prefill_tokens[pending].sum())
        if total >= self.target_fill * self.token_budget * int(pending.sum()):
            return DecisionReason.FIRE_FILL
        grew = self._last_sum is None or total > self._last_sum
        self._num_stalls = 0 if grew else self._num_stalls + 1
        self._last_sum = total
        if self._num_stalls >= self.stall_ticks:
            return DecisionReason.FIRE_STALL
        return DecisionReason.HOLD_FILL

    def _must_fire(self, g: GatheredControl, ready: np.ndarray, num_holds: int
                   ) -> DecisionReason | None:
        """The bounds that release even an unaligned or underfilled tick."""
        if not g.num_running_decodes.any():
            return DecisionReason.FIRE_NO_DECODE
        if (ready & (g.kv_usage_ppm >= self.kv_high_watermark_ppm)).any():
            return DecisionReason.FIRE_KV_HIGH
        if g.has_partial_prefill.any() and num_holds >= self.partial_max_ticks:
            return DecisionReason.FIRE_PARTIAL
        if num_holds >= self.ttft_max_ticks:
            return DecisionReason.FIRE_TTFT
        age = self.max_queue_ticks
        if age is not None and (ready & (g.oldest_waiting_age_ticks >= age)).any():
            return DecisionReason.FIRE_QUEUE_AGE
        return None

    def stats(self) -> dict[str, int | float]:
        return {}
