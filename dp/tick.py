"""The DP tick's decisions as pure pieces, shared by the real loop and the simulator.

What a tick does with its gathered values (docs/ARCHITECTURE.md, "The DP tick") is written
here once: :meth:`atom.dp.dp_core_proc.DPEngineCoreProc._tick` runs it between its two
exchanges, and the simulator (:mod:`atom.dp.sim`) runs the same functions for N virtual
ranks on values gathered in memory, so a simulated tick takes the engine's decisions:

- :func:`control_state`: the :class:`~atom.dp.sync.ControlState` a rank sends (its scheduler's
  prefill inputs, work, wave and tick);
- :func:`tick_action`: stop together, end the wave, or step (from the gathered control
  vectors);
- :func:`batch_shape`: the :class:`~atom.dp.sync.BatchShape` a rank sends after scheduling;
- :class:`StepCounters`: what a rank counts per step (forward, prefill, mixed, TBO, dummy and
  real steps, waves) and whether the step splits into two micro-batches;
- :class:`TickArrivals`: tick-clocked arrivals (a replay's requests held until their tick).

The prefill decision itself is :meth:`atom.dp.prefill_policy.PrefillDecider.decide`. Nothing
here reads a clock or issues a collective; it imports no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from atom.dp.prefill_policy import PrefillSource, local_prefill_inputs
from atom.dp.sync import BatchShape, ControlState, GatheredBatchShape, GatheredControl, PrefillInputs

if TYPE_CHECKING:
    from atom.core.scheduler_output import SchedulerOutput

T = TypeVar("T")


def control_state(scheduler: PrefillSource, *, has_work: bool, shutdown: bool, wave_id: int,
                  tick: int) -> ControlState:
    """What a rank sends in the control sync: its scheduler's prefill inputs (the admission
    dry run, queue ages, KV usage), whether it has work (unfinished requests, unreported
    finishes or held arrivals: the caller knows), shutdown, and its wave and tick."""
    inputs = local_prefill_inputs(scheduler)
    return ControlState(has_work=has_work, shutdown=shutdown, wave_id=wave_id, tick=tick,
                        **{f: getattr(inputs, f) for f in _PREFILL_FIELDS})


# dataclasses.asdict deep-copies: ~3x the cost of the rest of the function at 32 ranks a tick
_PREFILL_FIELDS = tuple(f.name for f in dataclasses.fields(PrefillInputs))


class TickAction(enum.Enum):
    """What every rank does after the control sync (identical on every rank)."""

    STOP = "stop"  # every rank was asked to shut down: they exit together
    END_WAVE = "end_wave"  # no rank has work: the wave ends, every rank goes idle
    STEP = "step"  # some rank has work: every rank steps (idle ones with dummy batches)


def tick_action(gathered: GatheredControl) -> TickAction:
    """The tick's action from the gathered control vectors. A rank that is shutting down
    while others are not keeps stepping (it has no new work) until every rank is."""
    if gathered.all_shutdown():
        return TickAction.STOP
    if not gathered.any_has_work() and not gathered.any_shutdown():
        return TickAction.END_WAVE
    return TickAction.STEP


def batch_shape(sched: SchedulerOutput, *, tbo_eligible: bool,
                num_draft_tokens: int | None = None) -> BatchShape:
    """The batch shape a rank exchanges for its scheduled batch ``sched`` (an empty batch
    is a dummy batch).

    Args:
        sched: this tick's ``Scheduler.schedule()`` result.
        tbo_eligible: whether this rank could split the batch (``EngineCore.tbo_eligible``).
        num_draft_tokens: tokens of this rank's largest draft forward
            (``EngineCore.num_draft_tokens``: the MTP draft's first forward catches up on
            several positions per sequence); None = one per drafting sequence.
    """
    num_tokens = num_prefill_seqs = num_prefill_tokens = 0
    for seq, n in sched.scheduled:  # one pass (SchedulerOutput's properties take one each)
        num_tokens += n
        if seq.is_prefill:
            num_prefill_seqs += 1
            num_prefill_tokens += n
    num_seqs = len(sched.scheduled)
    num_spec_tokens = num_draft_seqs = num_draft_steps = 0
    if sched.spec_budget:
        num_spec_tokens = sched.num_spec_tokens
        # reservations a model-based proposer fills after the exchange (EngineCore.run_drafts)
        pending = [sched.spec_budget[seq.seq_id] for seq, _ in sched.scheduled
                   if seq.seq_id in sched.spec_budget and not seq.spec_token_ids]
        num_draft_seqs, num_draft_steps = len(pending), max(pending, default=0)
        if num_draft_tokens is not None and pending:
            num_draft_seqs = max(num_draft_seqs, num_draft_tokens)
    return BatchShape(num_tokens=num_tokens + num_spec_tokens, num_seqs=num_seqs,
                      is_dummy=num_seqs == 0, tbo_eligible=tbo_eligible,
                      has_prefill=num_prefill_seqs > 0, num_prefill_tokens=num_prefill_tokens,
                      num_decode_seqs=num_seqs - num_prefill_seqs, num_spec_tokens=num_spec_tokens,
                      num_draft_seqs=num_draft_seqs, num_draft_steps=num_draft_steps)


@dataclass
class StepCounters:
    """One rank's step counters. The group's (``num_steps`` … ``num_tbo_steps``) come from
    the gathered batch shapes, so they are identical on every rank; ``num_dummy_steps`` and
    ``num_real_steps`` are this rank's own. Owned and mutated by the rank's loop only."""

    num_steps: int = 0  # forward steps of the group
    num_prefill_steps: int = 0  # ... where some rank prefills
    num_mixed_prefill_steps: int = 0  # ... where some rank prefills and another does not
    num_tbo_steps: int = 0  # ... run as two micro-batches (every rank could split)
    num_spec_steps: int = 0  # ... where some rank verified speculative drafts
    num_dummy_steps: int = 0  # this rank's dummy batches
    num_real_steps: int = 0  # this rank's real batches
    num_waves_completed: int = 0

    def count_step(self, shapes: GatheredBatchShape, *, is_dummy: bool) -> bool:
        """Count one forward step; returns whether it runs as two micro-batches (TBO, agreed
        only when every rank is eligible)."""
        tbo = shapes.tbo_agreed
        self.num_steps += 1
        self.num_prefill_steps += shapes.any_prefill
        self.num_mixed_prefill_steps += shapes.mixed_prefill
        self.num_tbo_steps += tbo
        self.num_spec_steps += shapes.any_spec
        self.num_dummy_steps += is_dummy
        self.num_real_steps += not is_dummy
        return tbo


class TickArrivals(Generic[T]):
    """Requests of a tick-clocked replay, held until their arrival tick.

    Ticks count from the first tick of the wave (tick 0 is the wave's first tick): every rank
    enters a wave at the same tick, so "the first tick ≥ the arrival tick" is the same tick
    on every rank. A rank holding requests has work, so the group keeps stepping (dummy
    batches) until the last of them is due, and a whole replay is one wave. Owns only the
    held items (first in, first out among equal ticks).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, T]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, arrival_tick: int, item: T) -> None:
        """Hold ``item`` until tick ``arrival_tick`` of the wave. Raises ValueError if < 0."""
        if arrival_tick < 0:
            raise ValueError(f"arrival_tick={arrival_tick} must be >= 0")
        heapq.heappush(self._heap, (arrival_tick, next(self._order), item))

    def due(self, tick_in_wave: int) -> list[tuple[int, T]]:
        """Remove and return ``(arrival_tick, item)`` for every item due at ``tick_in_wave``
        (arrival tick ≤ it), in arrival order. An arrival tick below ``tick_in_wave`` means
        the item came late (after its tick had run)."""
        out = []
        while self._heap and self._heap[0][0] <= tick_in_wave:
            arrival_tick, _, item = heapq.heappop(self._heap)
            out.append((arrival_tick, item))
        return out

    def discard(self, drop: Callable[[T], bool]) -> int:
        """Drop the held items for which ``drop(item)`` is true (aborted); returns how many."""
        before = len(self._heap)
        self._heap = [entry for entry in self._heap if not drop(entry[2])]
        heapq.heapify(self._heap)
        return before - len(self._heap)
