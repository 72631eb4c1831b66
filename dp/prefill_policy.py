"""Cross-rank prefill policies: one interface, the decode-protection interval, the counters.

With expert parallelism every rank runs the same MoE collectives in every step, so a step lasts
as long as its slowest rank: a rank that prefills while the others decode stretches everyone's
step for one rank's benefit. A *prefill policy* decides, once per tick and identically on every
rank, whether prefills (admissions and partial-prefill chunks) may run this tick. The DP loop
hands that decision to the scheduler as a plain value (``schedule(allow_prefill=...)``).

Per tick, on every rank (docs/ARCHITECTURE.md, "The DP tick"):

1. :func:`local_prefill_inputs` reads the rank's scheduler (its side-effect-free admission dry
   run, queue ages, KV usage); the values travel in the one control gather
   (:class:`atom.dp.sync.ControlState`), whichever policy runs;
2. :meth:`PrefillDecider.decide` turns the gathered values, the previous tick's gathered batch
   shapes and its own tick counters into one :class:`Decision`.

Nothing else goes in: never a clock, never a value only one rank has. Every decision is
therefore identical on every rank, which the lockstep hash (the collectives the decision
causes) checks every tick. A simulator runs the same objects for N virtual ranks in one
process, fed with ``GatheredControl.from_states`` and ``GatheredBatchShape.from_shapes``.

One policy per deployment (``--prefill-policy``, :func:`make_prefill_policy`):

- ``none`` (:class:`NoPrefillPolicy`): always allow;
- ``delayer`` (:class:`atom.dp.prefill_delayer.PrefillDelayer`, default with DP > 1): hold while
  only some ranks with pending prefill work can admit one (SGLang #14201, ATOM #930);
- ``coalescer`` (:class:`atom.dp.prefill_coalescer.PrefillCoalescer`): also hold until the
  admittable prompt tokens summed over the ranks fill a worthwhile step (ATOM #1611).

The reasons, the :class:`~atom.dp.prefill_decision.Decision` and the readiness rule they share
live in :mod:`atom.dp.prefill_decision`. Any of them composes with the decode-protection interval (``--prefill-decode-interval N``,
:class:`DecodeInterval`; vLLM #44558, SGLang #35017, ATOM #2238), applied first. Every hold of
every branch is bounded in ticks (SGLang #29898 and #32880 were deadlocks from an unbounded
branch); :class:`PrefillDecider` counts every decision under exactly one reason, so the reasons
sum to the number of decisions.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from atom.config import EngineConfig
from atom.dp.prefill_decision import HOLDS, Decision, DecisionReason
from atom.dp.rank_contract import rank_logger
from atom.dp.sync import GatheredBatchShape, GatheredControl, PrefillInputs, kv_usage_to_ppm

logger = logging.getLogger(__name__)

__all__ = ["Decision", "DecisionReason", "DecodeInterval", "NoPrefillPolicy", "PrefillDecider",
           "PrefillInputs", "PrefillPolicy", "PrefillSource", "local_prefill_inputs",
           "make_prefill_decider", "make_prefill_policy"]


class _KVPool(Protocol):
    @property
    def kv_usage(self) -> float: ...


class PrefillSource(Protocol):
    """What :func:`local_prefill_inputs` reads from a rank's scheduler
    (``atom.core.scheduler.Scheduler``)."""

    block_manager: _KVPool

    def preview_admission(self): ...  # -> atom.core.scheduler_output.AdmissionPreview

    def has_pending_prefill(self) -> bool: ...

    def has_partial_prefill(self) -> bool: ...

    def num_running_decodes(self) -> int: ...

    def oldest_waiting_age_steps(self) -> int: ...


def local_prefill_inputs(scheduler: PrefillSource) -> PrefillInputs:
    """This rank's inputs, from the scheduler's side-effect-free dry run of its own admission
    (readiness equal to admission: SGLang #31835, ATOM #930) and its queues. The scheduler
    steps once per stepping tick, so its step-counted waiting age is an age in ticks."""
    preview = scheduler.preview_admission()
    return PrefillInputs(
        num_admittable=preview.num_prefills, num_prefill_tokens=preview.num_prefill_tokens,
        has_pending_prefill=scheduler.has_pending_prefill(),
        has_partial_prefill=scheduler.has_partial_prefill(),
        num_running_decodes=scheduler.num_running_decodes(),
        oldest_waiting_age_ticks=scheduler.oldest_waiting_age_steps(),
        kv_usage_ppm=kv_usage_to_ppm(scheduler.block_manager.kv_usage))


class PrefillPolicy(Protocol):
    """One cross-rank prefill rule: a pure function of the gathered control vectors, its hold
    run (counted by :class:`PrefillDecider`) and its own tick counters (which evolve
    identically on every rank).

    Attributes:
        name: the ``--prefill-policy`` value.
        reasons: every reason :meth:`decide` can return.
    """

    name: str
    reasons: tuple[DecisionReason, ...]

    def decide(self, gathered: GatheredControl, num_holds: int) -> DecisionReason:
        """This tick's reason (its ``holds`` says hold or allow); updates the rule's state.
        ``num_holds``: the rule's own holds in a row before this tick (since its last allow;
        the ticks the decode interval held neither count nor end the run)."""
        ...

    def stats(self) -> dict[str, int | float]:
        """Counters of the rule's own (beyond the decisions, which the decider counts)."""
        ...


class NoPrefillPolicy:
    """``--prefill-policy none``: prefills are never held (reason ``disabled``)."""

    name = "none"
    reasons = (DecisionReason.DISABLED,)

    def decide(self, gathered: GatheredControl, num_holds: int) -> DecisionReason:
        return DecisionReason.DISABLED

    def stats(self) -> dict[str, int | float]:
        return {}


class DecodeInterval:
    """Decode protection: after a tick in which any rank prefilled, no rank starts or continues
    a prefill for the next ``num_ticks`` ticks, unless no rank has a running decode (then
    holding protects nobody) or no rank has a prefill it could run (nothing to hold).

    Driven by the previous tick's gathered batch shapes (did any rank prefill) and this tick's
    gathered control vectors (running decodes, admittable prefills): identical on every rank.
    A prefill can only run once the countdown is over (or when nothing is protected), so each
    run of interval holds lasts at most ``num_ticks`` ticks. Lineage: vLLM #44558 (P50 ITL
    274.9 → 32.1 ms), SGLang #35017, ATOM #2238 (the countdown is armed from what ran, not from
    what was allowed: an allowed tick may still schedule no prefill).

    Args:
        num_ticks: ticks to protect after each prefilling tick (>= 1).
    """

    def __init__(self, num_ticks: int):
        if num_ticks < 1:
            raise ValueError(f"num_ticks={num_ticks} must be >= 1 (0 = no interval: do not "
                             f"build one)")
        self.num_ticks = num_ticks
        self._num_remaining = 0

    def holds(self, gathered: GatheredControl, previous_shapes: GatheredBatchShape | None) -> bool:
        """Whether this tick is protected (call once per tick, before the policy)."""
        if previous_shapes is not None and previous_shapes.any_prefill:
            self._num_remaining = self.num_ticks
        if self._num_remaining == 0:
            return False
        self._num_remaining -= 1
        return bool(gathered.num_running_decodes.any() and gathered.num_admittable.any())

    def reset(self) -> None:
        """Forget the countdown (the ranks went idle: nothing is decoding)."""
        self._num_remaining = 0


class PrefillDecider:
    """The deployment's prefill decision: its policy, the interval, and the decision counters.

    Owns the counters (decisions per reason) and the hold runs, the one place holds in a row
    are counted: every hold (the decision's ``num_consecutive_holds``) and the policy's own
    (handed to the policy, whose bounds read it); through the policy and the interval, all
    other decision state. Every piece of it is a function of the sequence of gathered values
    it was fed, so it is identical on every rank. When the interval holds, the policy is not
    asked and its own run neither grows nor ends (its bounds start after the interval, as in
    SGLang and ATOM #2238), so no hold run is longer than the interval plus the policy's own
    bound.

    Args:
        policy: the deployment's :class:`PrefillPolicy`.
        decode_interval: ticks of decode protection after a prefilling tick; 0 = off.
        dp_rank: for the log prefix.
        log_every_n_decisions: log the counters every N decisions at INFO; None never.
    Raises:
        ValueError: ``log_every_n_decisions`` below 1, or a negative interval.
    """

    def __init__(self, policy: PrefillPolicy, *, decode_interval: int = 0, dp_rank: int = 0,
                 log_every_n_decisions: int | None = 1000):
        if log_every_n_decisions is not None and log_every_n_decisions < 1:
            raise ValueError(f"log_every_n_decisions={log_every_n_decisions!r}: use an integer "
                             f">= 1, or None to never log")
        if decode_interval < 0:
            raise ValueError(f"decode_interval={decode_interval} must be >= 0 (0 = off)")
        self.policy = policy
        self.interval = DecodeInterval(decode_interval) if decode_interval else None
        self.reasons = policy.reasons + (
            (DecisionReason.HOLD_DECODE_INTERVAL,) if self.interval else ())
        self.log_every_n_decisions = log_every_n_decisions
        self._log = rank_logger(logger, dp_rank)
        self._counts: Counter[DecisionReason] = Counter()
        self._num_decisions = 0
        self._num_ready_ticks = 0  # decisions where some rank could admit a prefill
        self._num_consecutive_holds = 0  # every hold in a row
        self._num_policy_holds = 0  # the policy's own holds in a row (interval holds skipped)
        self._max_consecutive_holds = 0

    def decide(self, gathered: GatheredControl,
               previous_shapes: GatheredBatchShape | None = None) -> Decision:
        """This tick's decision from the gathered control vectors and the previous stepping
        tick's gathered batch shapes (None on a wave's first tick); updates the counters."""
        if self.interval is not None and self.interval.holds(gathered, previous_shapes):
            reason = DecisionReason.HOLD_DECODE_INTERVAL
        else:
            reason = self.policy.decide(gathered, self._num_policy_holds)
            self._num_policy_holds = self._num_policy_holds + 1 if reason.holds else 0
        assert reason in self.reasons, (reason, self.policy.name)
        self._num_consecutive_holds = self._num_consecutive_holds + 1 if reason.holds else 0
        self._max_consecutive_holds = max(self._max_consecutive_holds,
                                          self._num_consecutive_holds)
        decision = Decision(reason, self._num_consecutive_holds)
        self._num_ready_ticks += bool(gathered.num_admittable.any())
        self._count(decision)
        return decision

    def end_wave(self) -> None:
        """The ranks went idle together: the interval's countdown is void (nothing decodes)."""
        if self.interval is not None:
            self.interval.reset()

    def _count(self, decision: Decision) -> None:
        self._num_decisions += 1
        self._counts[decision.reason] += 1
        self._log.debug("prefill %s: %s (%d holds in a row)", self.policy.name,
                        decision.reason.value, decision.num_consecutive_holds)
        every = self.log_every_n_decisions
        if every is not None and self._num_decisions % every == 0:
            self._log.info("prefill %s: %s", self.policy.name, ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in self.stats().items()))

    @property
    def hold_rate(self) -> float:
        """Holds ÷ ticks where some rank could admit a prefill (0.0 before any such tick)."""
        num_holds = sum(self._counts[r] for r in HOLDS)
        return num_holds / self._num_ready_ticks if self._num_ready_ticks else 0.0

    def stats(self) -> dict[str, int | float]:
        """Decisions in all and per reason (``decisions_<reason>`` for every reason of the
        policy and interval, summing to ``num_decisions``), the ticks where some rank could
        admit a prefill, the hold rate, the longest run of consecutive holds, and the policy's
        own counters."""
        out: dict[str, int | float] = {"num_decisions": self._num_decisions}
        out.update({f"decisions_{r.value}": self._counts[r] for r in self.reasons})
        out.update(num_ready_ticks=self._num_ready_ticks, hold_rate=self.hold_rate,
                   max_consecutive_holds=self._max_consecutive_holds)
        out.update(self.policy.stats())
        return out


def make_prefill_policy(config: EngineConfig) -> PrefillPolicy:
    """The policy ``config`` names (``resolved_prefill_policy()``), built from its settings
    (validated by ``EngineConfig``)."""
    name = config.resolved_prefill_policy()
    if name == "delayer":
        from atom.dp.prefill_delayer import PrefillDelayer

        return PrefillDelayer(config)
    if name == "coalescer":
        from atom.dp.prefill_coalescer import PrefillCoalescer

        return PrefillCoalescer(config)
    assert name == "none", name
    return NoPrefillPolicy()


def make_prefill_decider(config: EngineConfig, *, dp_rank: int = 0,
                         log_every_n_decisions: int | None = 1000) -> PrefillDecider:
    """The deployment's :class:`PrefillDecider`: its policy and decode interval from
    ``config``."""
    return PrefillDecider(make_prefill_policy(config),
                          decode_interval=config.prefill_decode_interval, dp_rank=dp_rank,
                          log_every_n_decisions=log_every_n_decisions)
