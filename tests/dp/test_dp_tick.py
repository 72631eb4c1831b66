"""The DP tick's shared pieces (atom.dp.tick), from hand-made gathered values and a real
scheduler: the tick's action, the batch shape of a scheduled step, the step counters and the
TBO agreement, the control state, and tick-clocked arrivals (no processes)."""

from __future__ import annotations

import pytest

from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.block_manager import BlockManager
from atom.dp.sync import BatchShape, ControlState, GatheredBatchShape, GatheredControl
from atom.dp.tick import (
    StepCounters,
    TickAction,
    TickArrivals,
    batch_shape,
    control_state,
    tick_action,
)
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import Sequence


def gathered(*ranks: dict) -> GatheredControl:
    return GatheredControl.from_states([ControlState(**r) for r in ranks])


@pytest.mark.parametrize("ranks, action", [
    ([dict(has_work=False), dict(has_work=False)], TickAction.END_WAVE),
    ([dict(has_work=True), dict(has_work=False)], TickAction.STEP),
    ([dict(has_work=False, shutdown=True), dict(has_work=False)], TickAction.STEP),
    ([dict(has_work=True, shutdown=True), dict(has_work=False, shutdown=True)], TickAction.STOP),
])
def test_tick_action(ranks, action):
    assert tick_action(gathered(*ranks)) is action


def scheduler(num_blocks: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=256),
                     BlockManager(num_blocks, 4, enable_prefix_caching=False))


def seq(n: int, request_id: str) -> Sequence:
    return Sequence(request_id, list(range(1, n + 1)), SamplingParams(max_tokens=3))


def test_batch_shape_and_sampled_seqs_of_a_mixed_step():
    s = scheduler()
    decode, long = seq(6, "d"), seq(60, "p")
    s.add(decode)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput.from_tokens({decode.seq_id: 7}))  # decode is now past its prompt
    s.add(long)
    out = s.schedule()  # decode (1 token) + the first 39-token chunk of the long prompt
    assert batch_shape(out, tbo_eligible=True) == BatchShape(
        num_tokens=40, num_seqs=2, is_dummy=False, tbo_eligible=True, has_prefill=True,
        num_prefill_tokens=39, num_decode_seqs=1)
    assert out.sampled_seqs() == [decode]  # the chunk does not reach the prompt's end
    s.update_from_output(out, ModelRunnerOutput.from_tokens({decode.seq_id: 8}))
    held = s.schedule(allow_prefill=False)  # the chunk is held, the decode still runs
    assert batch_shape(held, tbo_eligible=False) == BatchShape(
        num_tokens=1, num_seqs=1, num_decode_seqs=1)


def test_empty_step_is_a_dummy_batch():
    out = scheduler().schedule()
    assert batch_shape(out, tbo_eligible=True) == BatchShape(0, 0, is_dummy=True,
                                                             tbo_eligible=True)
    assert out.sampled_seqs() == []


def test_control_state_carries_the_schedulers_prefill_inputs():
    s = scheduler(num_blocks=5)  # 20 tokens
    first = seq(16, "first")
    s.add(first)
    s.update_from_output(s.schedule(), ModelRunnerOutput.from_tokens({first.seq_id: 7}))
    s.add(seq(8, "second"))  # needs 2 blocks; 1 is free
    state = control_state(s, has_work=True, shutdown=False, wave_id=3, tick=9)
    assert (state.num_admittable, state.has_pending_prefill, state.wave_id, state.tick) == (
        0, True, 3, 9)
    s2 = scheduler()
    s2.add(seq(20, "ok"))
    assert control_state(s2, has_work=True, shutdown=False, wave_id=0, tick=0).num_admittable == 1


def shapes(*ranks: dict) -> GatheredBatchShape:
    return GatheredBatchShape.from_shapes([BatchShape(**r) for r in ranks])


def test_step_counters_count_the_group_and_the_rank():
    counters = [StepCounters(), StepCounters()]
    steps = [
        (shapes(dict(num_tokens=9, num_seqs=1, has_prefill=True, tbo_eligible=True),
                dict(num_tokens=0, num_seqs=0, is_dummy=True, tbo_eligible=True)), True),
        (shapes(dict(num_tokens=2, num_seqs=2, tbo_eligible=False),
                dict(num_tokens=5, num_seqs=1, has_prefill=True, tbo_eligible=True)), False),
        (shapes(dict(num_tokens=8, num_seqs=1, has_prefill=True),
                dict(num_tokens=8, num_seqs=1, has_prefill=True)), False),
    ]
    for step, tbo in steps:
        assert [c.count_step(step, is_dummy=bool(step.is_dummy[r]))
                for r, c in enumerate(counters)] == [tbo, tbo]
    group = dict(num_steps=3, num_prefill_steps=3, num_mixed_prefill_steps=2, num_tbo_steps=1,
                 num_waves_completed=0)
    assert counters[0] == StepCounters(**group, num_dummy_steps=0, num_real_steps=3)
    assert counters[1] == StepCounters(**group, num_dummy_steps=1, num_real_steps=2)


def test_tick_arrivals_release_in_tick_then_arrival_order():
    arrivals: TickArrivals[str] = TickArrivals()
    for tick, item in [(2, "a"), (0, "b"), (2, "c"), (5, "d")]:
        arrivals.hold(tick, item)
    assert len(arrivals) == 4
    assert arrivals.due(0) == [(0, "b")]
    assert arrivals.due(1) == []
    assert arrivals.due(3) == [(2, "a"), (2, "c")]  # late by one tick: the caller can tell
    assert arrivals.discard(lambda item: item == "d") == 1
    assert len(arrivals) == 0 and arrivals.due(100) == []
    with pytest.raises(ValueError):
        arrivals.hold(-1, "x")
