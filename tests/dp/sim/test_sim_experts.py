"""The simulator's experts (dp/sim/experts.py): the skew models, the imbalance the cost model
reads, EPLB's controller run on the group's counts, and ``atom sim run`` with a skew."""

from __future__ import annotations

import json

import numpy as np
import pytest

from atom.config import EngineConfig
from atom.dp.sim import ExpertPopularity, simulate
from atom.dp.sim import workload as W
from atom.dp.sim.cost_model import Coefficients, Profile
from atom.dp.sim.experts import SimExperts

EP = dict(data_parallel_size=2, enable_expert_parallel=True)
EPLB = dict(EP, enable_eplb=True, eplb_window_size=2, eplb_step_interval=4)


def test_zipf_popularity_is_capped_at_one_pick_per_token_and_seeded():
    a = ExpertPopularity.zipf(3, 16, top_k=4, exponent=2.0, seed=1)
    assert a.popularity.shape == (3, 16)
    np.testing.assert_allclose(a.popularity.sum(axis=1), 1.0)
    assert a.popularity.max() == pytest.approx(0.25)  # a token picks an expert once
    assert not np.array_equal(a.popularity[0], a.popularity[1])  # hot experts differ by layer
    np.testing.assert_array_equal(a.popularity,
                                  ExpertPopularity.zipf(3, 16, top_k=4, exponent=2.0,
                                                        seed=1).popularity)
    np.testing.assert_allclose(ExpertPopularity.zipf(1, 8, top_k=2, exponent=0.0,
                                                     seed=0).popularity, 1 / 8)


def test_a_recorded_load_is_read_from_numpy_or_json(tmp_path):
    load = np.array([[30, 10, 0, 0], [5, 5, 5, 25]])
    np.save(tmp_path / "load.npy", load)
    (tmp_path / "load.json").write_text(json.dumps(load.tolist()))
    for name in ("load.npy", "load.json"):
        popularity = ExpertPopularity.read(tmp_path / name, top_k=1).popularity
        np.testing.assert_allclose(popularity, load / 40)
    with pytest.raises(ValueError, match="no routed token"):
        ExpertPopularity.from_load(np.zeros((1, 4)), top_k=1)


def test_the_imbalance_follows_the_placement_and_eplb_rebalances_the_group():
    hot = np.array([[0.5, 0.5, 0.0, 0.0]])  # both hot experts on rank 0 at first
    off = SimExperts(EngineConfig(**EP), ExpertPopularity(hot, top_k=2), num_ranks=2)
    assert off.step(0, [10, 10]) == pytest.approx(2.0)  # rank 0 takes all: max / mean = 2
    assert off.end_step(0) is None and off.row(0) is None  # no EPLB
    on = SimExperts(EngineConfig(**EPLB), ExpertPopularity(hot, top_k=2), num_ranks=2)
    imbalances = []
    for tick in range(8):
        imbalances.append(on.step(tick, [10, 6]))
        on.end_step(tick)
    assert imbalances[:4] == [pytest.approx(2.0)] * 4 and imbalances[4:] == [1.0] * 4
    (tick, first), (_, second) = on.windows
    assert (tick, first.rebalanced, first.balancedness) == (3, True, 0.5)
    assert first.logical_load.tolist() == [[32, 32, 0, 0]]  # 2 steps x 16 tokens x top-2
    assert second.balancedness == 1.0 and not second.rebalanced
    row = on.row(1)  # rank 1's 6 tokens of the last step, per slot, while the window records
    assert row.last_balancedness == 1.0 and sum(row.tick_load) == 12


def test_recording_the_load_measures_every_window_and_never_moves_an_expert():
    hot = np.array([[0.5, 0.5, 0.0, 0.0]])  # the skew EPLB rebalances above
    record = SimExperts(EngineConfig(**{**EPLB, "enable_eplb": False}, record_expert_load=True),
                        ExpertPopularity(hot, top_k=2), num_ranks=2)
    imbalances = []
    for tick in range(8):
        imbalances.append(record.step(tick, [10, 6]))
        record.end_step(tick)
    assert imbalances == [pytest.approx(2.0)] * 8
    assert [(tick, w.balancedness, w.rebalanced) for tick, w in record.windows] == [
        (3, 0.5, False), (7, 0.5, False)]
    assert record.summary()["num_rebalances"] == 0 and record.row(0).last_balancedness == 0.5


def test_eplb_in_the_simulator_needs_a_routing_source_and_reports_its_windows():
    profile = Profile(Coefficients(step_s=0.01, token_s=0.001, mlp_token_s=0.0005),
                      model_facts={"max_position_embeddings": 1024})
    requests = W.bursty(num_requests=12, burst_size=4, burst_interval=3, clock="tick",
                        prompt_len=(16, 64), output_len=(4, 8), seed=0)
    config = EngineConfig(**EPLB, num_kv_blocks=64)
    with pytest.raises(ValueError, match="routing source"):
        simulate(requests, config, profile)
    skew = ExpertPopularity.zipf(2, 8, top_k=2, exponent=1.5, seed=0)
    result = simulate(requests, config, profile, routing=skew)
    windows = result["experts"]["windows"]
    assert len(windows) == result["num_steps"] // 4 and windows[0]["tick"] == 3
    assert result["experts"]["mean_imbalance"] >= 1.0
