"""PrefillDelayer: every branch of the decision table, from hand-made gathered control vectors
(run through the PrefillDecider, which counts the decisions)."""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.dp.prefill_delayer import PrefillDelayer
from atom.dp.prefill_policy import DecisionReason, PrefillDecider
from atom.dp.sync import ControlState, GatheredControl

WATERMARK = 0.5  # the low watermark of the tests that turn the valve on


def rank(num_admittable: int = 0, *, pending: bool | None = None,
         below_watermark: bool = False) -> ControlState:
    """One rank's control state; pending prefill work defaults to num_admittable > 0; its KV
    usage is just under (or at) ``WATERMARK``."""
    pending = num_admittable > 0 if pending is None else pending
    kv_usage_ppm = 499_999 if below_watermark else 500_000
    return ControlState(has_work=True, num_admittable=num_admittable, has_pending_prefill=pending,
                        kv_usage_ppm=kv_usage_ppm)


def gathered(*ranks: ControlState) -> GatheredControl:
    return GatheredControl.from_states(list(ranks))


MIXED = gathered(rank(2), rank(0, pending=True))  # rank 1 has work it cannot admit yet


def delayer(*, max_delay_passes: int = 30, kv_low_watermark: float | None = None,
            tbo_enabled: bool = False, dp_rank: int = 0,
            log_every_n_decisions: int | None = None) -> PrefillDecider:
    config = EngineConfig(data_parallel_size=2, prefill_policy="delayer",
                          prefill_delayer_max_delay_passes=max_delay_passes,
                          prefill_delayer_kv_low_watermark=kv_low_watermark,
                          enable_tbo=tbo_enabled, enable_expert_parallel=tbo_enabled)
    return PrefillDecider(PrefillDelayer(config), dp_rank=dp_rank,
                          log_every_n_decisions=log_every_n_decisions)


HOLD, TIMEOUT = DecisionReason.HOLD, DecisionReason.TIMEOUT


def test_none_no_rank_ready_allows():
    d = delayer()
    for g in (gathered(rank(0), rank(0)), gathered(rank(0, pending=True), rank(0))):
        decision = d.decide(g)
        assert (decision.reason, decision.allow) == (DecisionReason.ALLOW_NONE, True)


def test_all_pending_ranks_ready_allows():
    decision = delayer().decide(gathered(rank(1), rank(3)))
    assert (decision.reason, decision.allow) == (DecisionReason.ALLOW_ALL, True)


def test_rank_without_pending_work_does_not_hold_others():
    d = delayer()
    decision = d.decide(gathered(rank(1), rank(0, pending=False), rank(0, pending=False)))
    assert decision.reason is DecisionReason.ALLOW_ALL


def test_mixed_holds_every_rank():
    decision = delayer().decide(MIXED)
    assert (decision.reason, decision.allow, decision.num_consecutive_holds) == (HOLD, False, 1)


def test_hold_bounded_by_max_delay_passes_then_timeout_and_reset():
    d = delayer(max_delay_passes=3)
    reasons = [d.decide(MIXED).reason for _ in range(9)]
    # three holds, a timeout allow, and the counter starts over after it
    assert reasons == [HOLD, HOLD, HOLD, TIMEOUT, HOLD, HOLD, HOLD, TIMEOUT, HOLD]
    assert d.stats()["max_consecutive_holds"] == 3


def test_any_allow_resets_the_hold_counter():
    d = delayer(max_delay_passes=3)
    d.decide(MIXED)
    d.decide(MIXED)
    assert d.decide(gathered(rank(1), rank(1))).reason is DecisionReason.ALLOW_ALL
    assert [d.decide(MIXED).reason for _ in range(4)] == [HOLD] * 3 + [TIMEOUT]


def test_watermark_valve_releases_a_mixed_hold():
    d = delayer(kv_low_watermark=WATERMARK)
    decision = d.decide(gathered(rank(2, below_watermark=True), rank(0, pending=True)))
    assert (decision.reason, decision.allow) == (DecisionReason.WATERMARK, True)
    # only a *ready* rank below the watermark opens the valve
    decision = d.decide(gathered(rank(2), rank(0, pending=True, below_watermark=True)))
    assert decision.reason is HOLD
    # the valve is off by default: the same usage holds
    assert delayer().decide(gathered(rank(2, below_watermark=True), rank(0, pending=True))
                            ).reason is HOLD


def test_tbo_readiness_needs_two_admittable():
    d = delayer(tbo_enabled=True)
    assert d.policy.min_num_admittable == 2
    assert d.decide(gathered(rank(2), rank(1))).reason is HOLD  # rank 1 cannot split
    assert d.decide(gathered(rank(1), rank(1))).reason is DecisionReason.ALLOW_NONE
    assert d.decide(gathered(rank(2), rank(4))).reason is DecisionReason.ALLOW_ALL
    assert delayer().decide(gathered(rank(2), rank(1))).reason is DecisionReason.ALLOW_ALL


def test_counters_and_hold_rate():
    d = delayer(max_delay_passes=2, kv_low_watermark=WATERMARK)
    sequence = [
        gathered(rank(0), rank(0)),  # allow_none (not a ready tick)
        gathered(rank(1), rank(1)),  # allow_all
        MIXED, MIXED, MIXED,  # hold, hold, timeout
        gathered(rank(1, below_watermark=True), rank(0, pending=True)),  # watermark
        MIXED,  # hold
    ]
    for g in sequence:
        d.decide(g)
    assert d.stats() == {
        "num_decisions": 7, "decisions_allow_none": 1, "decisions_allow_all": 1,
        "decisions_hold": 3, "decisions_timeout": 1, "decisions_watermark": 1,
        "num_ready_ticks": 6, "hold_rate": 3 / 6, "max_consecutive_holds": 2,
        "num_mixed_ticks": 5,
    }
    assert d.hold_rate == 0.5
    assert delayer().hold_rate == 0.0


def test_decisions_identical_on_every_rank():
    """Two delayers (two ranks) fed the same gathered sequence end in the same state."""
    seq = [MIXED] * 5 + [gathered(rank(1), rank(2))] + [MIXED] * 40
    a, b = delayer(dp_rank=0), delayer(dp_rank=1)
    assert [a.decide(g) for g in seq] == [b.decide(g) for g in seq]
    assert a.stats() == b.stats()


def test_logs_counters_every_n_decisions(caplog):
    d = delayer(log_every_n_decisions=2, dp_rank=3)
    with caplog.at_level("INFO", logger="atom.dp.prefill_policy"):
        for _ in range(5):
            d.decide(MIXED)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(lines) == 2
    assert lines[-1].startswith("[dp3] prefill delayer: num_decisions=4,")
    assert "decisions_hold=4" in lines[-1] and "hold_rate=1.000" in lines[-1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_delay_passes=0), "max_delay_passes"),
    (dict(max_delay_passes=2.5), "max_delay_passes"),
    (dict(kv_low_watermark=0.0), "kv_low_watermark"),
    (dict(kv_low_watermark=1.0), "kv_low_watermark"),
    (dict(log_every_n_decisions=0), "log_every_n_decisions"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        delayer(**kwargs)
