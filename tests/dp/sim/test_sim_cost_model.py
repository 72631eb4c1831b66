"""The cost model's form from hand-made micro-batches (the slowest-rank rule, dummy batches,
the ranks' contention while they compute together, expert parallelism's MLP on the largest
batch scaled by the experts' imbalance, and its collectives, TBO), the features read
from scheduled sequences, profiles (JSON round trip, the committed ones) and the fit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from atom.dp.sim.calibrate import feature_row, fit_grid, nnls
from atom.dp.sim.cost_model import (
    Coefficients,
    CostModel,
    MicroBatch,
    Profile,
    list_profiles,
    load_profile,
    micro_batch,
    overlap_shares,
)
from atom.sampling_params import SamplingParams
from atom.core.sequence import Sequence

C = Coefficients(step_s=10.0, token_s=1.0, mlp_token_s=0.5, sampled_s=2.0, seq_s=0.25,
                 prefill_pair_s=0.001, decode_context_s=0.01, dummy_s=3.0, ep_fixed_s=4.0,
                 ep_row_s=0.1, tick_s=0.5)
DECODE = MicroBatch(num_tokens=4, num_seqs=4, num_sampled=4, decode_context=400)
PREFILL = MicroBatch(num_tokens=100, num_seqs=1, num_sampled=1, prefill_pairs=5050.0)
DUMMY = MicroBatch()


def test_dense_step_is_the_slowest_rank_plus_the_tick():
    model = CostModel(Profile(C))
    decode = 10 + 4 * 1.0 + 4 * 2.0 + 4 * 0.25 + 400 * 0.01  # 27
    prefill = 10 + 100 * 1.0 + 2.0 + 0.25 + 5050 * 0.001  # 117.3
    assert model.micro_batch_s(DECODE, max_num_tokens=100) == pytest.approx(decode)
    assert model.micro_batch_s(DUMMY, max_num_tokens=100) == 3.0
    cost = model.step([[DECODE], [PREFILL], [DUMMY]])
    assert (cost.compute_s, cost.ep_s, cost.tick_s) == (pytest.approx(prefill), 0.0, 0.5)
    mean = CostModel(Profile(C), slowest_rank=False).step([[DECODE], [PREFILL], [DUMMY]])
    assert mean.compute_s == pytest.approx((decode + prefill + 3.0) / 3)
    free = CostModel(Profile(C), dummy_cost=False)
    assert free.step([[DUMMY], [DUMMY]]).total_s == 0.5
    # each rank's outputs leave when its own forward ends; the slowest's at the step's end
    assert cost.rank_done_s == pytest.approx((0.5 + decode, cost.total_s, 0.5 + 3.0))
    # a real rank's work per sequence outside the forward: 4 decodes overtake one prefill
    per_seq = CostModel(Profile(dataclasses.replace(C, seq_overhead_s=40.0)))
    busy = per_seq.step([[DECODE], [PREFILL]])
    assert busy.compute_s == pytest.approx(decode + 4 * 40.0) and busy.num_seqs == 4


def test_contention_slows_a_rank_while_the_others_compute_beside_it():
    model = CostModel(Profile(dataclasses.replace(C, contention=0.2)))
    decode, prefill = 27.0, 117.3  # as above; the dummy rank does not compute
    cost = model.step([[DECODE], [PREFILL], [DUMMY]])
    # the decode rank computes beside the first 27 of the prefill's 117.3: over W - 1 = 2
    assert cost.others_busy == pytest.approx(decode / prefill / 2)
    assert cost.compute_s == pytest.approx(prefill + 0.2 * decode / 2)
    both = model.step([[PREFILL], [PREFILL], [DUMMY]])  # aligned: the whole step contends
    assert both.others_busy == 0.5 and both.compute_s == pytest.approx(prefill * 1.1)
    alone = model.step([[DECODE], [DUMMY], [DUMMY]])
    assert alone.compute_s == pytest.approx(decode) and alone.others_busy == 0.0
    assert overlap_shares([10.0, 4.0, 4.0, 0.0], [True, True, True, False]) == pytest.approx(
        [8 / 30, 8 / 12, 8 / 12, 0.0])
    # with expert parallelism every rank runs the experts on the M rows: a dummy rank's 3 + 2
    # contend with the decode rank's 27
    ep = CostModel(Profile(dataclasses.replace(C, contention=0.2)), expert_parallel=True)
    assert ep.step([[DECODE], [DUMMY]]).others_busy == pytest.approx(5 / 27)
    assert ep.step([[DUMMY], [DUMMY]]).others_busy == 0.0  # M = 0: no experts run


def test_expert_parallel_mlp_runs_on_the_largest_batch():
    model = CostModel(Profile(C), expert_parallel=True)
    # the decode rank's MLP runs on M = 100 rows: 0.5 per token moves from 4 rows to 100
    decode = 10 + 4 * 0.5 + 100 * 0.5 + 4 * 2.0 + 4 * 0.25 + 400 * 0.01
    assert model.micro_batch_s(DECODE, max_num_tokens=100) == pytest.approx(decode)
    assert model.micro_batch_s(DUMMY, max_num_tokens=100) == pytest.approx(3.0 + 50.0)
    cost = model.step([[DECODE], [PREFILL]])
    assert cost.ep_s == pytest.approx(4.0 + 0.1 * 100 * 1) and cost.max_num_tokens == 100
    two = model.step([[DECODE, DECODE], [PREFILL, DUMMY]])  # TBO: 2 micro-batches, each M
    assert two.num_micro_batches == 2 and two.ep_s == pytest.approx(2 * (4.0 + 0.1 * 100))
    assert model.step([[DUMMY], [DUMMY]]).ep_s == 0.0  # M = 0: no collectives at all
    assert cost.rank_done_s == (cost.total_s, cost.total_s)  # the layers' collectives wait
    # routed tokens twice the mean on the busiest rank: twice the MLP rows everywhere
    skewed = model.micro_batch_s(DUMMY, max_num_tokens=100, expert_imbalance=2.0)
    assert skewed == pytest.approx(3.0 + 100.0)
    # the MLP's fixed part (its weights, 6 of step_s's 10): each of the W = 2 ranks reads its
    # half of the experts, a dummy rank of a step with tokens too; none when M = 0
    split = CostModel(Profile(dataclasses.replace(C, mlp_step_s=6.0)), expert_parallel=True)
    assert split.micro_batch_s(DECODE, max_num_tokens=100, world_size=2) == pytest.approx(
        decode - 6.0 + 3.0)
    assert split.micro_batch_s(DUMMY, max_num_tokens=100, world_size=2) == pytest.approx(
        3.0 + 3.0 + 50.0)
    assert split.micro_batch_s(DUMMY, max_num_tokens=0, world_size=2) == 3.0
    assert split.step([[DECODE], [PREFILL]]).compute_s == pytest.approx(
        model.step([[DECODE], [PREFILL]]).compute_s - 3.0)
    assert CostModel(Profile(dataclasses.replace(C, mlp_step_s=6.0))).micro_batch_s(
        DECODE, max_num_tokens=100, world_size=2) == pytest.approx(27.0)  # no EP: all of it


def seq(num_prompt: int, *, computed: int, outputs: int = 0) -> Sequence:
    s = Sequence("r", list(range(num_prompt)), SamplingParams(max_tokens=8))
    s.token_ids += [7] * outputs
    s.num_computed_tokens = computed
    return s


def test_micro_batch_features_from_scheduled_sequences():
    decode = seq(10, computed=10, outputs=1)  # context 11
    chunk = seq(100, computed=20)  # 30 new tokens after 20: not the prompt's end
    last = seq(40, computed=32)  # the last 8 prompt tokens: sampled
    mb = micro_batch([(decode, 0, 1), (chunk, 0, 30), (last, 0, 8)])
    assert mb == MicroBatch(num_tokens=39, num_seqs=3, num_sampled=2,
                            prefill_pairs=30 * (20 + 15.5) + 8 * (32 + 4.5), decode_context=11)
    half = micro_batch([(chunk, 15, 15)])  # TBO's second half of a split request
    assert half.prefill_pairs == 15 * (35 + 8) and half.num_sampled == 0


def test_profile_round_trip_and_committed_profiles(tmp_path):
    profile = Profile(C, kind="estimate", machine={"cpu": "x"}, model="m", date="d",
                      model_facts={"max_position_embeddings": 8192}, fit={"grid": {}})
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    with pytest.raises(ValueError, match="no profile"):
        load_profile("no-such-profile")
    with pytest.raises(ValueError, match=">= 0"):
        Coefficients(step_s=-1.0)
    for name in list_profiles():
        loaded = load_profile(name)
        assert loaded.kind == "measured" and loaded.fit["grid"]["num_points"] > 0
        assert loaded.model_facts["kv_cache_bytes_per_token"] > 0


def test_nnls_and_the_grid_fit_recover_known_coefficients():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (40, 3))
    assert np.allclose(nnls(a, a @ np.array([2.0, 0.0, 1.0])), [2.0, 0.0, 1.0])
    assert (nnls(a, a @ np.array([2.0, -1.0, 1.0])) >= 0).all()  # a negative one is dropped
    truth = CostModel(Profile(C))
    batches = [[DUMMY], [DUMMY, DUMMY], [DECODE, PREFILL]] + [
        [MicroBatch(num_tokens=int(t), num_seqs=int(n), num_sampled=int(s), prefill_pairs=p,
                    decode_context=int(d))]
        for t, n, s, p, d in zip(rng.integers(1, 500, 20), rng.integers(1, 30, 20),
                                 rng.integers(0, 30, 20), rng.uniform(0, 1e5, 20),
                                 rng.integers(0, 5000, 20))]
    measurements = [{"point": {}, "seconds": sum(truth.micro_batch_s(mb, max_num_tokens=0)
                                                 for mb in mbs),
                     "mlp_seconds": 4.0 + 0.5 * sum(mb.num_tokens for mb in mbs),
                     "micro_batches": [vars(mb) for mb in mbs]} for mbs in batches]
    coefficients, fit = fit_grid(measurements)
    assert fit["max_abs_rel_error"] < 1e-6 and coefficients["mlp_token_s"] == pytest.approx(0.5)
    assert coefficients["mlp_step_s"] == pytest.approx(4.0)
    assert len(feature_row([DUMMY])) == 7
    for name in ("step_s", "token_s", "sampled_s", "seq_s", "prefill_pair_s",
                 "decode_context_s", "dummy_s"):
        assert coefficients[name] == pytest.approx(getattr(C, name), rel=1e-6)


def test_the_group_fit_recovers_known_terms_and_a_profile_refits_from_what_it_records():
    """Replays simulated with known level, contention and tick terms (their ticks equal the
    real run's: step parity) are fitted back exactly; a profile keeps its grid's and its
    replays' measurements, so :func:`refit` gives the same coefficients again."""
    from atom.config import EngineConfig
    from atom.dp.sim.calibrate import (_group_configs, _simulate_with_log, calibration_workload,
                                       fit_all, refit)

    config = EngineConfig(data_parallel_size=2, num_kv_blocks=32, max_num_seqs=8,
                          max_model_len=1024, enable_prefix_caching=False)
    facts = {"max_position_embeddings": 2048}
    grid = dataclasses.replace(C, step_s=0.02, token_s=1e-3, sampled_s=1e-3, dummy_s=0.005,
                               ep_fixed_s=0.0, ep_row_s=0.0, tick_s=0.0)
    truth = dataclasses.replace(grid, compute_scale=0.8, contention=0.3, tick_s=0.01,
                                seq_overhead_s=0.002)
    rng = np.random.default_rng(1)
    batches = [[DUMMY]] + [[MicroBatch(num_tokens=int(t), num_seqs=int(n), num_sampled=int(n),
                                       prefill_pairs=float(p), decode_context=int(d))]
                           for t, n, p, d in zip(rng.integers(1, 300, 20),
                                                 rng.integers(1, 8, 20),
                                                 rng.uniform(0, 4e4, 20),
                                                 rng.integers(0, 3000, 20))]
    measurements = [{"point": {}, "micro_batches": [vars(mb) for mb in mbs],
                     "seconds": CostModel(Profile(grid)).micro_batch_s(mbs[0], max_num_tokens=0),
                     "mlp_seconds": 0.5 * mbs[0].num_tokens} for mbs in batches]
    group_config = _group_configs(config)["group"]
    log = _simulate_with_log(calibration_workload(), group_config,
                             Profile(truth, model_facts=facts)).step_log
    runs = {"group": [{tick: cost.total_s for tick, cost in log}] * 3}
    coefficients, fit = fit_all(config, measurements, facts, runs)
    for name in ("compute_scale", "contention", "seq_overhead_s", "tick_s"):
        assert coefficients[name] == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fit["group"]["max_abs_rel_error"] < 1e-9 and len(fit["group"]["tick_seconds"]) > 20
    profile = Profile(Coefficients(**coefficients), model_facts=facts, fit=fit)
    assert refit(profile, config).coefficients == profile.coefficients
    with pytest.raises(ValueError, match="calibrate again"):
        refit(dataclasses.replace(profile, fit={"grid": {"points": [{"point": {}}]}}), config)
    other = {**fit, "group": {**fit["group"], "workload": "another"}}
    with pytest.raises(ValueError, match="another calibration workload"):
        refit(dataclasses.replace(profile, fit=other), config)


def test_machine_speed_is_the_probe_points_seconds_over_the_calibrations(monkeypatch):
    """:func:`machine_speed`: the median over the probe points of their seconds now ÷ the
    profile's grid seconds, the points matched whether written as tuples or as the JSON's
    lists (the timing itself, :func:`measure_grid`, is replaced: its numbers are the
    machine's)."""
    from atom.config import EngineConfig
    from atom.dp.sim import calibrate

    recorded = [{"point": {"decode": [1, 64]}, "measured_s": 0.05},
                {"point": {"decode": [8, 64]}, "measured_s": 0.10},
                {"point": {"prefill": [[64, 0]]}, "measured_s": 0.20}]
    now = {'{"decode": [1, 64]}': 0.06, '{"decode": [8, 64]}': 0.10,
           '{"prefill": [[64, 0]]}': 0.30}  # 1.2, 1.0 and 1.5 times the calibration's
    monkeypatch.setattr(calibrate, "measure_grid", lambda config, grid: (
        [{"point": p, "seconds": now[calibrate._point_key(p)]} for p in grid], {}))
    profile = Profile(C, fit={"grid": {"points": recorded}})
    assert calibrate.machine_speed(EngineConfig(), profile) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="no measurement of"):
        calibrate.machine_speed(EngineConfig(), profile, points=[{"decode": (2, 64)}])


def test_the_grid_core_s_kv_pool_is_written_before_it_is_timed():
    """The calibration grid's sequences read context no step wrote: every element of the
    pool gets a (seeded, non-zero) value first, so no read lands on a lazy zero page."""
    from types import SimpleNamespace

    import torch

    from atom.dp.sim.calibrate import _fill_kv_pool

    pools = [SimpleNamespace(runner=SimpleNamespace(kv_caches=[
        torch.zeros(2, 4, 16, 3, 8), torch.zeros(2, 4, 16, 3, 8, dtype=torch.bfloat16)]))
        for _ in range(2)]
    for core in pools:
        _fill_kv_pool(core)
    for cache, again in zip(*(core.runner.kv_caches for core in pools)):
        assert cache.count_nonzero() == cache.numel() and torch.equal(cache, again)
