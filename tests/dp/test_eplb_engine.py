"""EPLB end to end on two real expert-parallel DP ranks (gloo), fp32, a tiny random Mixtral
(top-2 of 8 experts, built by transformers; two-batch overlap on, so the counting follows the
micro-batches too), against the same runs with EPLB off, and the simulator replaying the run.

**The workloads come from the router** (:mod:`atom.benchmarks.eplb`). A prompt that repeats
one token routes every position the same way (identical keys and values: every position's
attention output is the same), so transformers' ``output_router_logits`` on ``[t] * 8`` gives
each token's top-2 experts in every layer. Workload A takes the tokens whose top-2 lie in experts 0-3 in both layers: everything
lands on rank 0's contiguous shard, and re-placing the experts can balance it. Workload B
takes the tokens that route to expert 5 in both layers: one expert takes half of every
layer's (token, expert) pairs, which no re-placement can split: it needs replicas; its tokens
are picked one by one so that their other choices spread as evenly as they can over the other
seven experts (then whichever rank holds expert 5 also holds three others' shares). Prompts
are 32 copies of a token, 2 output tokens (the decode tokens route elsewhere: a little noise),
two requests a tick, one pinned to each rank, replayed tick-clocked, so every run takes the
same steps; the window and the interval are 6 ticks.

Checked: balancedness of the first window (the contiguous placement) ≤ 0.75 and of the window
after the rebalance ≥ 0.95 on A with no redundant slot; ≥ 0.85 after it on B with 2 redundant
slots (where the plan predicts less for re-placement alone); greedy tokens identical to the
runs with EPLB off; every rank's collective hash equal at every tick; every KV block free at
the end; ``get_expert_load`` / ``get_expert_placement`` equal to the trace's last window; and
the simulator, fed the real run's per-tick counts (the trace's ``eplb_load`` column), closes
the same windows at the same ticks with the same balancedness and plans, and writes the same
EPLB columns on every row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from atom.benchmarks.eplb import (eplb_windows, hot_expert_tokens, repeated_token_workload,
                                  router_topk, tokens_within)
from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace
from atom.dp.eplb.plan import balancedness, rank_loads, rebalance
from atom.dp.sim import RecordedExpertLoad, simulate
from atom.dp.sim.cost_model import Coefficients, Profile
from atom.dp.sim.replay import build_dp_engine, drive, idle_rank_stats
from tests.moe_utils import build_tiny_mixtral

HOT_EXPERT = 5  # workload B's (its tokens' other choices spread widest: see the test's print)
INTERVAL = 6  # ticks: window = interval
NUM_REQUESTS = 24
BASE = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_tbo=True,
                    dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=256,
                    enable_prefix_caching=False, skip_tokenizer_init=True, prefill_policy="none")
EPLB = dict(enable_eplb=True, eplb_window_size=INTERVAL, eplb_step_interval=INTERVAL,
            eplb_min_balancedness=0.95)
PROFILE = Profile(Coefficients(step_s=0.05), model_facts={"max_position_embeddings": 512,
                                                        "num_experts": 8})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    top2 = router_topk(build_tiny_mixtral(folder))
    rank0 = tokens_within(top2, {0, 1, 2, 3})
    assert len(rank0) >= 12, rank0
    return {"folder": str(folder),
            "A": repeated_token_workload("a", rank0, num_requests=NUM_REQUESTS),
            "B": repeated_token_workload("b", hot_expert_tokens(top2, HOT_EXPERT, NUM_REQUESTS),
                                         num_requests=NUM_REQUESTS)}


def run(setup, workloads: list[str], trace=None, **options) -> dict:
    """The workloads one after the other on a fresh 2-rank engine; tokens per request, the
    ranks' final stats, EPLB's load and placement (with EPLB on)."""
    config = dataclasses.replace(BASE, model=setup["folder"], dp_trace=trace, **options)
    engine = build_dp_engine(config)
    try:
        tokens = {}
        for name in workloads:
            finished, _, _ = drive(engine, setup[name], tick_clocked=True)
            tokens.update({i: o.outputs[0].token_ids for i, o in finished.items()})
        out = {"tokens": tokens, "stats": idle_rank_stats(engine)}
        if config.enable_eplb:
            out["load"], out["placement"] = engine.get_expert_load(), engine.get_expert_placement()
    finally:
        engine.shutdown()
    return out


@pytest.fixture(scope="module")
def off(setup):
    return run(setup, ["A", "B"])


def windows(folder) -> list[dict]:
    """The trace's ``eplb_window`` events without the real run's timings."""
    return [{k: v for k, v in e.items() if k not in ("plan_ms", "move_ms")}
            for e in eplb_windows(folder)]


def check_run(real: dict, off: dict, folder) -> None:
    """Tokens, lockstep at every tick, KV blocks, the API against the trace."""
    assert real["tokens"] == {i: off["tokens"][i] for i in real["tokens"]}
    assert all(len(t) == 2 for t in real["tokens"].values())
    ranks = read_trace(folder)
    assert len(ranks[0].rows) == len(ranks[1].rows) > 2 * INTERVAL
    for row0, row1 in zip(ranks[0].rows, ranks[1].rows):
        assert row0["tick"] == row1["tick"]
        assert (row0["collective_count"], row0["collective_hash"]) == (
            row1["collective_count"], row1["collective_hash"])
    for stats in real["stats"]:
        assert stats["num_free_blocks"] == stats["num_total_blocks"]  # nothing leaked
    last = windows(folder)[-1]
    np.testing.assert_array_equal(real["load"], last["logical_load"])
    assert real["placement"].tolist() == next(
        w["phy2log"] for w in reversed(windows(folder)) if w["rebalanced"])


def test_replacement_balances_experts_that_start_on_one_rank(setup, off, tmp_path):
    real = run(setup, ["A"], trace=str(tmp_path / "real"), **EPLB)
    check_run(real, off, tmp_path / "real")
    first, second = windows(tmp_path / "real")[:2]
    print(f"workload A, no redundant slot: balancedness {first['balancedness']:.3f} -> "
          f"{second['balancedness']:.3f} (plan predicted {first['predicted_balancedness']:.3f})")
    assert first["tick"] == INTERVAL - 1 and first["rebalanced"]
    assert first["balancedness"] <= 0.75
    assert second["balancedness"] >= 0.95
    assert sorted(real["placement"][0].tolist()) == list(range(8))  # a permutation: no replica
    stats = real["stats"][0]
    assert stats["eplb_num_rebalances"] >= 1 and stats["eplb_last_move_ms"] > 0
    assert stats["eplb_balancedness"] == windows(tmp_path / "real")[-1]["balancedness"]

    # the simulator, fed the run's recorded counts, takes the same EPLB decisions
    sim_folder = tmp_path / "sim"
    simulate(setup["A"], dataclasses.replace(BASE, model=setup["folder"], **EPLB), PROFILE,
             trace_dir=sim_folder, routing=RecordedExpertLoad.from_trace(
                 tmp_path / "real", num_layers=2, num_experts=8))
    assert windows(sim_folder) == windows(tmp_path / "real")
    for real_rank, sim_rank in zip(read_trace(tmp_path / "real"), read_trace(sim_folder)):
        assert [(r["tick"], r["eplb_balancedness"], r["eplb_load"]) for r in real_rank.rows] == [
            (r["tick"], r["eplb_balancedness"], r["eplb_load"]) for r in sim_rank.rows]


def test_redundant_slots_split_a_hot_expert_that_replacement_cannot(setup, off, tmp_path):
    real = run(setup, ["B"], trace=str(tmp_path / "real"), eplb_num_redundant_experts=2, **EPLB)
    check_run(real, off, tmp_path / "real")
    first, second = windows(tmp_path / "real")[:2]
    load = np.asarray(first["logical_load"])
    replacement_only = balancedness(rank_loads(load, rebalance(load, num_physical=8,
                                                               num_ranks=2), 2))
    print(f"workload B, 2 redundant slots: balancedness {first['balancedness']:.3f} -> "
          f"{second['balancedness']:.3f}; the plan without replicas would predict "
          f"{replacement_only:.3f} on the same window")
    assert first["rebalanced"] and first["balancedness"] <= 0.75
    assert replacement_only < 0.85 <= second["balancedness"]
    assert np.bincount(real["placement"][0])[HOT_EXPERT] > 1  # the hot expert is replicated
