"""The prefill policy interface: the factory, the ``none`` policy, the decode-protection
interval (every branch, alone and composed with a policy), the decider's counters, and the
local inputs read from a real scheduler."""

from __future__ import annotations

import dataclasses

import pytest

from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.block_manager import BlockManager
from atom.config import EngineConfig
from atom.dp.prefill_coalescer import PrefillCoalescer
from atom.dp.prefill_delayer import PrefillDelayer
from atom.dp.prefill_policy import DecisionReason as R
from atom.dp.prefill_policy import (
    DecodeInterval,
    NoPrefillPolicy,
    PrefillDecider,
    PrefillInputs,
    local_prefill_inputs,
    make_prefill_decider,
)
from atom.dp.sync import BatchShape, ControlState, GatheredBatchShape, GatheredControl
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import Sequence


def rank(admittable: int = 1, *, decodes: int = 2, pending: bool | None = None) -> ControlState:
    pending = admittable > 0 if pending is None else pending
    return ControlState(has_work=True, num_admittable=admittable, num_prefill_tokens=8 * admittable,
                        has_pending_prefill=pending, num_running_decodes=decodes)


def gathered(*ranks: ControlState) -> GatheredControl:
    return GatheredControl.from_states(list(ranks))


def shapes(*prefill: bool) -> GatheredBatchShape:
    return GatheredBatchShape.from_shapes([
        BatchShape(num_tokens=9 if p else 2, num_seqs=2, has_prefill=p,
                   num_prefill_tokens=8 if p else 0, num_decode_seqs=1 if p else 2)
        for p in prefill])


READY = gathered(rank(1), rank(1))
PREFILLED, DECODED = shapes(False, True), shapes(False, False)


def config(**kwargs) -> EngineConfig:
    return EngineConfig(data_parallel_size=2, **kwargs)


# ----- the factory and the none policy -----

@pytest.mark.parametrize("options, policy", [
    ({}, PrefillDelayer), (dict(prefill_policy="delayer"), PrefillDelayer),
    (dict(prefill_policy="coalescer"), PrefillCoalescer),
    (dict(prefill_policy="none"), NoPrefillPolicy)])
def test_factory_builds_the_configured_policy(options, policy):
    decider = make_prefill_decider(config(**options))
    assert type(decider.policy) is policy and decider.interval is None
    assert decider.policy.name == config(**options).resolved_prefill_policy()
    with_interval = make_prefill_decider(config(prefill_decode_interval=3, **options))
    assert with_interval.interval.num_ticks == 3
    assert with_interval.reasons == policy.reasons + (R.HOLD_DECODE_INTERVAL,)


def test_none_policy_always_allows():
    d = make_prefill_decider(config(prefill_policy="none"), log_every_n_decisions=None)
    for g in (READY, gathered(rank(1), rank(0, pending=True)), gathered(rank(0), rank(0))):
        decision = d.decide(g, DECODED)
        assert (decision.reason, decision.allow) == (R.DISABLED, True)
    assert d.stats() == {"num_decisions": 3, "decisions_disabled": 3, "num_ready_ticks": 2,
                         "hold_rate": 0.0, "max_consecutive_holds": 0}


# ----- the decode-protection interval -----

def test_interval_holds_n_ticks_after_a_prefilling_tick():
    interval = DecodeInterval(2)
    assert not interval.holds(READY, None)  # a wave's first tick: nothing ran before
    assert not interval.holds(READY, DECODED)
    assert [interval.holds(READY, s) for s in (PREFILLED, DECODED, DECODED, DECODED)] == [
        True, True, False, False]


def test_interval_passes_when_no_rank_decodes_or_nothing_could_prefill():
    interval = DecodeInterval(3)
    no_decodes = gathered(rank(1, decodes=0), rank(0, decodes=0))
    nothing_ready = gathered(rank(0), rank(0, pending=True))
    assert not interval.holds(no_decodes, PREFILLED)
    assert not interval.holds(nothing_ready, DECODED)
    assert interval.holds(READY, DECODED)  # the countdown ran on: one protected tick left
    assert not interval.holds(READY, DECODED)


def test_interval_countdown_restarts_on_every_prefilling_tick_and_resets():
    interval = DecodeInterval(2)
    assert [interval.holds(READY, s) for s in (PREFILLED, PREFILLED, DECODED)] == [True] * 3
    interval.reset()
    assert not interval.holds(READY, DECODED)


def test_interval_composed_with_a_policy_runs_holds_then_the_policy():
    """N=2 with the ``none`` policy: P D D P D D ... (2 of every 3 ticks decode-only)."""
    d = make_prefill_decider(config(prefill_policy="none", prefill_decode_interval=2),
                             log_every_n_decisions=None)
    ran, out = DECODED, []
    for _ in range(9):
        decision = d.decide(READY, ran)
        out.append(decision.reason)
        ran = PREFILLED if decision.allow else DECODED
    hold = R.HOLD_DECODE_INTERVAL
    assert out == [R.DISABLED, hold, hold] * 3
    stats = d.stats()
    assert stats == {"num_decisions": 9, "decisions_disabled": 3,
                     "decisions_hold_decode_interval": 6, "num_ready_ticks": 9,
                     "hold_rate": 6 / 9, "max_consecutive_holds": 2}


def test_policy_is_not_consulted_while_the_interval_holds():
    """The delayer's own bound starts after the interval: the longest hold run is the interval
    plus ``max_delay_passes``, never unbounded."""
    d = make_prefill_decider(config(prefill_policy="delayer", prefill_delayer_max_delay_passes=3,
                                    prefill_decode_interval=2), log_every_n_decisions=None)
    mixed = gathered(rank(1), rank(0, pending=True))
    out = [d.decide(mixed, PREFILLED).reason] + [d.decide(mixed, DECODED).reason
                                                 for _ in range(6)]
    hold = R.HOLD_DECODE_INTERVAL
    assert out == [hold, hold, R.HOLD, R.HOLD, R.HOLD, R.TIMEOUT, R.HOLD]
    assert d.stats()["max_consecutive_holds"] == 5
    d.end_wave()  # the countdown is void after the ranks go idle
    assert d.decide(READY, None).reason is R.ALLOW_ALL


def test_decider_counts_every_decision_once():
    d = make_prefill_decider(config(prefill_policy="coalescer", prefill_decode_interval=1),
                             log_every_n_decisions=None)
    ticks = [(READY, DECODED), (READY, PREFILLED), (gathered(rank(0), rank(0)), DECODED),
             (gathered(rank(4), rank(0, pending=True)), DECODED)]
    for g, s in ticks:
        d.decide(g, s)
    stats = d.stats()
    num_per_reason = [stats[f"decisions_{r.value}"] for r in d.reasons]
    assert sum(num_per_reason) == stats["num_decisions"] == len(ticks)
    with pytest.raises(ValueError, match="log_every_n_decisions"):
        PrefillDecider(NoPrefillPolicy(), log_every_n_decisions=0)


# ----- local inputs, from the real (torch-free) scheduler -----

def test_local_inputs_come_from_the_scheduler_dry_run():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10,
                                      max_model_len=64), bm)
    params = SamplingParams(max_tokens=8)
    sched.add(Sequence("dec", list(range(100, 103)), params))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput.from_tokens({out.scheduled[0][0].seq_id: 7}))  # "dec" decodes from now on
    sched.add(Sequence("long", list(range(200, 230)), params))
    sched.schedule(allow_prefill=False)  # held one tick: "long" has waited 1
    inputs = local_prefill_inputs(sched)
    assert inputs == PrefillInputs(num_admittable=1, num_prefill_tokens=9,
                                   has_pending_prefill=True, has_partial_prefill=False,
                                   num_running_decodes=1, oldest_waiting_age_ticks=1,
                                   kv_usage_ppm=round(bm.kv_usage * 1_000_000))
    # the inputs are control-vector fields, under the same names
    state = ControlState(has_work=True, **dataclasses.asdict(inputs))
    assert ControlState.unpack(state.pack()) == state
