"""The simulator on small workloads (no processes): every request finishes with its output
length, the pools end empty and consistent, counters agree with each other and with the
policy's bounds, waves, tick-clocked arrivals, the router (sessions and cache-aware hits over
the simulated KV events), TBO agreement, expert parallelism's checks, the trace it writes,
determinism, and that it imports no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace, step_kind, to_perfetto
from atom.dp.sim import simulate
from atom.dp.sim import workload as W
from atom.dp.sim.cost_model import CostModel, Coefficients, Profile
from atom.dp.sim.simulator import Simulator, run_timed

PROFILE = Profile(Coefficients(step_s=0.02, token_s=1e-4, mlp_token_s=5e-5, sampled_s=1e-3,
                               dummy_s=0.005, tick_s=1e-3, ep_fixed_s=2e-3, ep_row_s=1e-6),
                  model_facts={"kv_cache_bytes_per_token": 46080,
                               "max_position_embeddings": 8192})
BASE = EngineConfig(data_parallel_size=2, num_kv_blocks=32, max_num_seqs=8, max_model_len=1024,
                    enable_prefix_caching=False)


def run(requests, config=BASE, **kwargs) -> Simulator:
    sim = Simulator(config, CostModel(PROFILE, expert_parallel=config.enable_expert_parallel),
                    num_kv_blocks=config.num_kv_blocks, max_model_len=config.max_model_len,
                    **kwargs)
    run_timed(sim, requests)
    return sim


@pytest.mark.parametrize("policy", ["none", "delayer", "coalescer"])
def test_every_request_finishes_and_the_books_balance(policy):
    config = dataclasses.replace(BASE, prefill_policy=policy, prefill_decode_interval=2)
    requests = W.dp_experiment(clock="tick", burst_interval=8)
    sim = run(requests, config)
    lengths = {r.request_id: r.output_len for r in requests}
    assert {r.request.request_id: len(r.token_times_s) for r in sim.records} == lengths
    assert all(r.finish_reason == "length" for r in sim.records)
    for rank in sim.ranks:
        rank.block_manager.check_invariants()
        assert rank.block_manager.num_free_blocks == rank.block_manager.num_blocks
        assert not rank.scheduler.has_unfinished()
    assert sim.router.loads == [0, 0]
    stats = sim.decider.stats()
    first = sim.counters[0]
    assert sum(stats[f"decisions_{r.value}"] for r in sim.decider.reasons) == \
        stats["num_decisions"] == first.num_steps
    assert all(dataclasses.replace(c, num_dummy_steps=0, num_real_steps=0)
               == dataclasses.replace(first, num_dummy_steps=0, num_real_steps=0)
               for c in sim.counters)  # the group's counters are identical on every rank
    assert all(c.num_dummy_steps + c.num_real_steps == c.num_steps for c in sim.counters)
    assert first.num_waves_completed == 1  # a tick-clocked replay is one wave
    assert stats["max_consecutive_holds"] <= 2 + 30  # the interval's bound plus the policy's
    assert sum(r.num_late_arrivals for r in sim.ranks) == 0
    assert sim.ranks[0].scheduler.num_preemptions > 0  # rank 0 is KV-pressured


def test_time_clock_waves_and_latencies():
    requests = [W.TraceRequest("a", W.synthetic_prompt("a", 40), 5, arrival_s=0.0),
                W.TraceRequest("b", W.synthetic_prompt("b", 40), 5, arrival_s=100.0)]
    sim = run(requests)
    assert sim.counters[0].num_waves_completed == 2  # idle between the two
    a, b = sorted(sim.records, key=lambda r: r.request.request_id)
    assert b.arrival_s == 100.0 and b.token_times_s[0] > 100.0
    assert a.token_times_s == sorted(a.token_times_s) and a.token_times_s[-1] < 100.0
    assert a.first_token_tick == 0  # prefilled in the wave's first tick
    assert sim.now_s == pytest.approx(b.token_times_s[-1])


def test_time_clock_sends_follow_the_real_front_end():
    # the front end sends while it waits for outputs only when a rank's output frame comes; a
    # rank drains its socket as it starts its tick, just after sending its own frame
    def request(name, prompt_len, rank, arrival_s):
        return W.TraceRequest(name, W.synthetic_prompt(name, prompt_len), 4, dp_rank=rank,
                              arrival_s=arrival_s)

    sim = run([request("a", 16, 1, 0.0), request("long", 400, 0, 0.0),
               request("c", 16, 0, 0.01), request("d", 16, 1, 0.01)])
    records = {r.request.request_id: r for r in sim.records}
    assert records["a"].arrival_tick == records["long"].arrival_tick == 0  # both at the wake
    # tick 0: rank 1 prefills "a" (its frame at 0.0236 s), rank 0 prefills "long" until 0.062 s.
    # Arriving at 0.01 s, "c" and "d" are sent on rank 1's frame: rank 0, still stepping, takes
    # "c" at tick 1; rank 1 drained its socket right after its frame: "d" waits for tick 2
    assert records["c"].arrival_tick == 1 and records["d"].arrival_tick == 2
    assert records["c"].arrival_s == 0.01  # TTFT counts from the arrival
    assert all(len(r.token_times_s) == 4 for r in sim.records)


def test_tick_arrivals_keep_the_group_stepping_until_due():
    requests = [W.TraceRequest("late", W.synthetic_prompt("late", 20), 2, arrival_tick=10)]
    sim = run(requests)
    assert sim.records[0].arrival_tick == 10 and sim.records[0].first_token_tick == 10
    assert sim.counters[0].num_dummy_steps == 10  # ticks 0-9: every rank idle but holding
    assert sim.counters[0].num_waves_completed == 1


def test_sessions_stay_on_their_rank_and_hit_the_prefix_cache():
    config = dataclasses.replace(BASE, dp_load_balance="cache_aware", enable_prefix_caching=True,
                                 num_kv_blocks=256, max_num_seqs=16)
    requests = W.sessions(num_sessions=4, num_turns=3, turn_interval=20.0, system_prompt_len=64,
                          output_len=(4, 8))
    sim = run(requests, config)
    ranks = {}
    for r in sim.records:
        ranks.setdefault(r.request.session_id, set()).add(r.dp_rank)
    assert all(len(v) == 1 for v in ranks.values()), ranks
    later = [r for r in sim.records if not r.request.request_id.endswith("-t0")]
    assert all(r.num_cached_tokens >= r.request.prompt_len // 2 for r in later)
    decisions = sim.router.rank_stats()
    assert sum(d["dp_router_decisions_cache_hit"] for d in decisions) >= len(later) // 2


def test_tbo_agreement_and_expert_parallel_checks():
    config = dataclasses.replace(BASE, enable_tbo=True, moe_split_experts=4,
                                 enable_expert_parallel=True)
    sim = run(W.dp_experiment(clock="tick", burst_interval=8), config)
    c = sim.counters[0]
    # split only when every rank can: prefills on both, or dummy batches (split trivially)
    assert 0 < c.num_tbo_steps < c.num_steps
    assert {cost.num_micro_batches for _, cost in sim.step_log} == {1, 2}
    assert sum(cost.num_micro_batches == 2 for _, cost in sim.step_log) == c.num_tbo_steps
    with pytest.raises(ValueError, match="at least that many experts"):
        simulate([], dataclasses.replace(config, data_parallel_size=8), PROFILE)


def test_trace_is_the_dp_trace_format(tmp_path):
    sim = run(W.dp_experiment(clock="tick", burst_interval=8, num_bursts=2), trace_dir=tmp_path)
    traces = read_trace(tmp_path)
    assert [t.dp_rank for t in traces] == [0, 1]
    assert [len(t.rows) for t in traces] == [sim.counters[0].num_steps] * 2
    rows0 = traces[0].rows
    assert [r["tick"] for r in rows0] == list(range(len(rows0)))
    assert {step_kind(r) for r in traces[1].rows} <= {"dummy", "prefill", "decode"}
    assert all(a["start_us"] + a["sync_us"] + a["step_us"] == b["start_us"]
               for a, b in zip(rows0, rows0[1:]))  # simulated time runs without gaps
    assert to_perfetto(traces)["traceEvents"]


def test_runs_are_deterministic_and_the_result_has_the_experiments_keys():
    requests = W.scaled("kv_skewed", dp_size=4, num_requests=60)
    config = dataclasses.replace(BASE, data_parallel_size=4, num_kv_blocks=None,
                                 max_model_len=4096, prefill_policy="delayer")
    one, two = (simulate(requests, config, PROFILE) for _ in range(2))
    sim = one["sim"]  # the cost model's parts add up to the busy time; no EP, no EP time
    busy_s = sim["compute_s"] + sim["tick_s"]
    assert sim["ep_s"] == 0 and 0 < busy_s <= sim["simulated_s"] * (1 + 1e-9)
    for r in (one, two):
        r.pop("sim")
    assert one == two
    for key in ("mixed_step_fraction", "dummy_step_fraction", "hold_rate", "ttft_ms", "tpot_ms",
                "itl_ms", "output_tokens_per_s", "per_rank", "timeline"):
        assert key in one
    assert one["num_requests"] == 60 and len(one["timeline"]["load"][0]) == 4


def test_the_simulation_imports_no_torch():
    code = ("import sys; from atom.config import EngineConfig; from atom.dp.sim import simulate,"
            " workload; from atom.dp.sim.cost_model import Profile, Coefficients;"
            "p = Profile(Coefficients(step_s=0.01), model_facts={'max_position_embeddings': 8192});"
            "r = simulate(workload.dp_experiment(num_bursts=2), EngineConfig(data_parallel_size=2,"
            " num_kv_blocks=32, moe_split_experts=4, enable_expert_parallel=True, enable_tbo=True),"
            " p); assert r['num_requests'] == 11, r; assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_hybrid_model_simulates_on_two_kv_cache_groups():
    """A profile whose facts name KV cache groups (gpt-oss's, from calibration) gives every rank
    a hybrid pool: sliding blocks released behind the window, every block back at the end."""
    requests = W.dp_experiment(clock="tick", burst_interval=8)
    sim = run(requests, kv_cache_group_windows=(None, 16))
    assert {r.request.request_id: len(r.token_times_s) for r in sim.records} == {
        r.request_id: r.output_len for r in requests}
    for rank in sim.ranks:
        assert rank.block_manager.group_windows == (None, 16)
        assert rank.block_manager.num_free_blocks == rank.block_manager.num_blocks
