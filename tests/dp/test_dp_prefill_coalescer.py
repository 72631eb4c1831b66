"""PrefillCoalescer: every branch of its decision table, from hand-made gathered control vectors
(run through the PrefillDecider, which counts the decisions)."""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.dp.prefill_coalescer import PrefillCoalescer
from atom.dp.prefill_policy import DecisionReason as R
from atom.dp.prefill_policy import PrefillDecider
from atom.dp.sync import ControlState, GatheredControl

BUDGET = 100  # max_num_batched_tokens: the fill target is 0.5 x 100 per pending rank


def rank(tokens: int = 0, *, admittable: int | None = None, decodes: int = 2,
         pending: bool | None = None, partial: bool = False, age: int = 0,
         kv: float = 0.5) -> ControlState:
    """One rank's control state; ``tokens`` admittable prefill tokens (one prefill unless
    ``admittable`` says otherwise), running decodes, waiting age in ticks, KV usage."""
    admittable = int(tokens > 0) if admittable is None else admittable
    pending = admittable > 0 if pending is None else pending
    return ControlState(has_work=True, num_admittable=admittable, num_prefill_tokens=tokens,
                        has_pending_prefill=pending, num_running_decodes=decodes,
                        has_partial_prefill=partial, oldest_waiting_age_ticks=age,
                        kv_usage_ppm=round(kv * 1_000_000))


def gathered(*ranks: ControlState) -> GatheredControl:
    return GatheredControl.from_states(list(ranks))


def coalescer(**settings) -> PrefillDecider:
    options = dict(target_fill=0.5, ttft_max_ticks=6, partial_max_ticks=3, stall_ticks=2,
                   kv_high_watermark=0.9)
    options.update(settings)
    tbo = options.pop("enable_tbo", False)
    config = EngineConfig(data_parallel_size=2, prefill_policy="coalescer",
                          max_num_batched_tokens=BUDGET, enable_tbo=tbo,
                          enable_expert_parallel=tbo,
                          **{f"prefill_coalescer_{k}": v for k, v in options.items()})
    return PrefillDecider(PrefillCoalescer(config), log_every_n_decisions=None)


UNDERFILLED = gathered(rank(20), rank(20))  # 40 < 0.5 x 100 x 2
UNALIGNED = gathered(rank(30), rank(0, pending=True))  # rank 1 has work it cannot admit


def reasons(d: PrefillDecider, ticks) -> list[R]:
    return [d.decide(g).reason for g in ticks]


def test_no_rank_ready_allows_and_ends_the_episode():
    d = coalescer()
    assert reasons(d, [UNDERFILLED, gathered(rank(0, pending=True), rank(0))]) == [
        R.HOLD_FILL, R.ALLOW_NONE]
    assert d.decide(UNDERFILLED).num_consecutive_holds == 1  # a new episode


def test_fires_when_the_sum_over_ranks_fills_the_target():
    d = coalescer()
    assert d.decide(gathered(rank(60), rank(40))).reason is R.FIRE_FILL  # 100 >= 100
    assert d.decide(gathered(rank(99), rank(0))).reason is R.FIRE_FILL  # 99 >= 0.5 x 100 x 1
    # a quiet rank with pending work it can admit keeps the target at two ranks' worth
    assert d.decide(gathered(rank(90), rank(9))).reason is R.HOLD_FILL


def test_holds_for_fill_then_fires_when_the_sum_stops_growing():
    d = coalescer(stall_ticks=2)
    growing = [gathered(rank(10 + i), rank(10)) for i in range(4)]
    assert reasons(d, growing) == [R.HOLD_FILL] * 4  # the sum grows every tick: no stall
    assert reasons(d, [growing[-1]] * 3) == [R.HOLD_FILL, R.FIRE_STALL, R.HOLD_FILL]
    assert d.decide(gathered(rank(20), rank(10))).reason is R.HOLD_FILL  # grew: count restarts


def test_alignment_gate_holds_while_a_pending_rank_cannot_admit():
    d = coalescer(ttft_max_ticks=4)
    assert reasons(d, [UNALIGNED] * 6) == [R.HOLD] * 4 + [R.FIRE_TTFT, R.HOLD]
    assert d.stats()["max_consecutive_holds"] == 4
    # a rank without any prefill work holds no one
    assert coalescer().decide(gathered(rank(60), rank(0))).reason is R.FIRE_FILL


def test_no_running_decode_anywhere_fires_even_unaligned_or_underfilled():
    d = coalescer()
    for g in (gathered(rank(30, decodes=0), rank(0, pending=True, decodes=0)),
              gathered(rank(5, decodes=0), rank(5, decodes=0))):
        assert d.decide(g).reason is R.FIRE_NO_DECODE


def test_kv_high_watermark_on_a_ready_rank_fires():
    d = coalescer(kv_high_watermark=0.8)
    assert d.decide(gathered(rank(20, kv=0.8), rank(20))).reason is R.FIRE_KV_HIGH
    # a full pool on a rank that cannot admit does not count (it is what the gate waits for)
    assert d.decide(gathered(rank(30), rank(0, pending=True, kv=0.95))).reason is R.HOLD


def test_queue_age_guard_fires_on_a_ready_rank_oldest_waiting_request():
    d = coalescer(max_queue_ticks=6)
    assert d.decide(gathered(rank(20, age=6), rank(20))).reason is R.FIRE_QUEUE_AGE
    assert d.decide(gathered(rank(20, age=5), rank(20))).reason is R.HOLD_FILL
    # an old request on a rank that cannot admit does not fire the others' prefills
    assert d.decide(gathered(rank(30), rank(0, pending=True, age=50))).reason is R.HOLD
    # off by default: a backlog's age does not release a hold
    assert coalescer().decide(gathered(rank(20, age=500), rank(20))).reason is R.HOLD_FILL


def test_partial_prefill_bound_is_tighter():
    d = coalescer(partial_max_ticks=3, ttft_max_ticks=6)
    partial = gathered(rank(30, partial=True), rank(0, pending=True))
    assert reasons(d, [partial] * 5) == [R.HOLD] * 3 + [R.FIRE_PARTIAL, R.HOLD]
    # the bound counts the episode's holds, whatever branch held
    d = coalescer(partial_max_ticks=3)
    assert reasons(d, [UNDERFILLED, UNALIGNED, gathered(rank(20, partial=True), rank(20))] +
                   [gathered(rank(21, partial=True), rank(20))]) == [
        R.HOLD_FILL, R.HOLD, R.HOLD_FILL, R.FIRE_PARTIAL]


def test_every_hold_is_bounded_by_ttft_max_ticks():
    d = coalescer(ttft_max_ticks=5, stall_ticks=100)
    growing = [gathered(rank(1 + i), rank(1)) for i in range(12)]  # grows forever, never fills
    out = reasons(d, growing)
    assert out == [R.HOLD_FILL] * 5 + [R.FIRE_TTFT] + [R.HOLD_FILL] * 5 + [R.FIRE_TTFT]
    assert d.stats()["max_consecutive_holds"] == 5


def test_tbo_readiness_needs_two_admittable():
    d = coalescer(enable_tbo=True)
    assert d.decide(gathered(rank(60, admittable=2), rank(40, admittable=1))).reason is R.HOLD
    assert d.decide(gathered(rank(60, admittable=2), rank(40, admittable=2))).reason is R.FIRE_FILL


def test_reasons_sum_to_decisions_and_match_on_every_rank():
    ticks = ([UNDERFILLED] * 3 + [UNALIGNED] * 7 + [gathered(rank(60), rank(60))] +
             [gathered(rank(5, decodes=0), rank(0, decodes=0))] + [gathered(rank(0), rank(0))] * 2)
    a, b = coalescer(), coalescer()
    assert [a.decide(g) for g in ticks] == [b.decide(g) for g in ticks]
    stats = a.stats()
    assert stats == b.stats()
    counts = {r.value: stats[f"decisions_{r.value}"] for r in a.reasons}
    assert sum(counts.values()) == stats["num_decisions"] == len(ticks)
    assert counts == {"allow_none": 2, "fire_no_decode": 1, "fire_kv_high": 0,
                      "fire_partial": 0, "fire_ttft": 1, "fire_queue_age": 0, "hold": 6,
                      "fire_fill": 1, "fire_stall": 1, "hold_fill": 2}


@pytest.mark.parametrize("setting, value", [("target_fill", 0.0), ("target_fill", 1.5),
                                            ("ttft_max_ticks", 0), ("partial_max_ticks", 0),
                                            ("stall_ticks", 0), ("kv_high_watermark", 0.0),
                                            ("max_queue_ticks", 0)])
def test_config_rejects_bad_values(setting, value):
    with pytest.raises(ValueError, match=setting):
        coalescer(**{setting: value})
