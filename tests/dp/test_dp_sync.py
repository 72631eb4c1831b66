"""Per-tick vectors: pack/unpack round trips and the gathered helpers (pure, no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom.dp.sync import (
    BATCH_SHAPE_VECTOR_LEN,
    CONTROL_VECTOR_LEN,
    BatchShape,
    ControlState,
    GatheredBatchShape,
    GatheredControl,
    kv_usage_to_ppm,
)

FULL = ControlState(has_work=True, shutdown=True, num_admittable=3, has_pending_prefill=True,
                    kv_usage_ppm=999_999, num_prefill_tokens=2048, num_running_decodes=255,
                    has_partial_prefill=True, oldest_waiting_age_ticks=31, wave_id=7, tick=12345,
                    collective_count=2**40, collective_hash=-(2**63))


@pytest.mark.parametrize("state", [ControlState(has_work=False), FULL])
def test_control_round_trip(state):
    vec = state.pack()
    assert vec.dtype == torch.int64 and vec.shape == (CONTROL_VECTOR_LEN,)
    assert ControlState.unpack(vec) == state
    assert ControlState.unpack(vec.numpy()) == state


def test_control_unpack_rejects_foreign_vectors():
    vec = FULL.pack()
    with pytest.raises(ValueError, match="not a control vector"):
        ControlState.unpack(vec[:-1])
    bad = vec.clone()
    bad[0] = 12345
    with pytest.raises(ValueError, match="not a control vector"):
        ControlState.unpack(bad)
    with pytest.raises(ValueError, match="not a control vector"):
        GatheredControl.from_matrix(torch.stack([vec, bad]))


@pytest.mark.parametrize("kwargs", [dict(num_admittable=-1), dict(kv_usage_ppm=1_000_001),
                                    dict(tick=-1), dict(wave_id=-2), dict(num_prefill_tokens=-1),
                                    dict(num_running_decodes=-1),
                                    dict(oldest_waiting_age_ticks=-1)])
def test_control_state_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        ControlState(has_work=True, **kwargs)


def test_kv_usage_to_ppm():
    assert [kv_usage_to_ppm(x) for x in (0.0, 0.25, 1 / 3, 1.0)] == [0, 250_000, 333_333,
                                                                      1_000_000]
    with pytest.raises(ValueError, match="fraction"):
        kv_usage_to_ppm(1.5)


def test_gathered_control_arrays_and_helpers():
    states = [
        ControlState(has_work=False, shutdown=True, wave_id=2, tick=5, collective_count=9,
                     collective_hash=-3),
        ControlState(has_work=True, shutdown=True, num_admittable=4, has_pending_prefill=True,
                     kv_usage_ppm=500_000, num_prefill_tokens=300, num_running_decodes=2,
                     has_partial_prefill=True, oldest_waiting_age_ticks=6, wave_id=3, tick=5,
                     collective_count=9, collective_hash=-3),
    ]
    g = GatheredControl.from_states(states)
    assert g.world_size == 2
    np.testing.assert_array_equal(g.num_admittable, [0, 4])
    np.testing.assert_array_equal(g.has_pending_prefill, [False, True])
    np.testing.assert_array_equal(g.kv_usage_ppm, [0, 500_000])
    np.testing.assert_array_equal(g.num_prefill_tokens, [0, 300])
    np.testing.assert_array_equal(g.num_running_decodes, [0, 2])
    np.testing.assert_array_equal(g.has_partial_prefill, [False, True])
    np.testing.assert_array_equal(g.oldest_waiting_age_ticks, [0, 6])
    np.testing.assert_array_equal(g.wave_id, [2, 3])
    assert g.has_partial_prefill.dtype == bool
    assert g.has_work.dtype == bool and g.num_admittable.dtype == np.int64
    assert g.any_has_work() and g.all_shutdown() and g.any_shutdown()
    assert g.in_lockstep()

    idle = GatheredControl.from_states([ControlState(has_work=False)] * 3)
    assert not idle.any_has_work() and not idle.any_shutdown() and not idle.all_shutdown()


@pytest.mark.parametrize("field, value", [("tick", 6), ("collective_count", 10),
                                          ("collective_hash", 4)])
def test_gathered_control_detects_divergence(field, value):
    base = dict(has_work=True, tick=5, collective_count=9, collective_hash=-3)
    g = GatheredControl.from_states([ControlState(**base), ControlState(**{**base, field: value})])
    assert not g.in_lockstep()
    text = g.describe_ranks()
    assert "rank 0: tick 5, 9 collectives, hash 0xfffffffffffffffd" in text
    assert "rank 1:" in text


@pytest.mark.parametrize("shape", [BatchShape(0, 0, is_dummy=True),
                                   BatchShape(4096, 17, False, True, has_prefill=True,
                                              num_prefill_tokens=4080, num_decode_seqs=16)])
def test_batch_shape_round_trip(shape):
    vec = shape.pack()
    assert vec.shape == (BATCH_SHAPE_VECTOR_LEN,) and vec.dtype == torch.int64
    assert BatchShape.unpack(vec) == shape
    with pytest.raises(ValueError, match="not a batch-shape vector"):
        BatchShape.unpack(FULL.pack())
    for bad in (dict(num_tokens=-1), dict(num_prefill_tokens=-1), dict(num_decode_seqs=-1)):
        with pytest.raises(ValueError):
            BatchShape(**{"num_tokens": 0, "num_seqs": 0, **bad})


def test_gathered_batch_shape():
    g = GatheredBatchShape.from_shapes([BatchShape(7, 2, tbo_eligible=True, num_decode_seqs=2),
                                        BatchShape(1, 0, is_dummy=True, tbo_eligible=False),
                                        BatchShape(300, 9, tbo_eligible=True, has_prefill=True,
                                                   num_prefill_tokens=292, num_decode_seqs=8)])
    np.testing.assert_array_equal(g.num_tokens, [7, 1, 300])
    np.testing.assert_array_equal(g.num_seqs, [2, 0, 9])
    np.testing.assert_array_equal(g.is_dummy, [False, True, False])
    np.testing.assert_array_equal(g.num_prefill_tokens, [0, 0, 292])
    np.testing.assert_array_equal(g.num_decode_seqs, [2, 0, 8])
    assert g.has_prefill.dtype == bool and g.num_decode_seqs.dtype == np.int64
    assert g.max_num_tokens == 300 and not g.tbo_agreed

    agreed = GatheredBatchShape.from_shapes([BatchShape(5, 1, tbo_eligible=True)] * 2)
    assert agreed.tbo_agreed


def test_mixed_prefill_steps():
    prefill, decode, dummy = (BatchShape(40, 2, has_prefill=True), BatchShape(3, 3),
                              BatchShape(0, 0, is_dummy=True))
    assert GatheredBatchShape.from_shapes([prefill, decode]).mixed_prefill
    assert GatheredBatchShape.from_shapes([dummy, prefill]).mixed_prefill
    aligned = GatheredBatchShape.from_shapes([prefill, prefill])
    assert aligned.any_prefill and not aligned.mixed_prefill
    no_prefill = GatheredBatchShape.from_shapes([decode, dummy])
    assert not no_prefill.any_prefill and not no_prefill.mixed_prefill
