"""The DP/EP summary line (issue 38) from rank stats shaped like ``get_rank_stats()``'s: the
expert layout, per-rank counters, every kind of hold. Real runs print it in
tests/dp/test_dp_engine_cli.py and tests/entrypoints/test_server_startup.py."""

from __future__ import annotations

from atom.config import EngineConfig
from atom.dp.run_summary import dp_summary_line


def _stats(rank: int, **extra) -> dict:
    return {"dp_rank": rank, "num_steps": 10, "num_dummy_steps": rank, "num_tbo_steps": 2,
            "dp_router_decisions_least_load": 3 - rank, "dp_router_decisions_cache_hit": 1,
            "prefill_policy_decisions_allow_all": 6, "prefill_policy_hold_rate": 0.4,
            "prefill_policy_max_consecutive_holds": 3, **extra}


def test_one_rank_has_nothing_to_say_unless_rank_failures_shrank_the_group():
    assert dp_summary_line([_stats(0)], config=EngineConfig(), num_experts=None) is None
    shrunk = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_tbo=True,
                          prefill_policy="coalescer").with_data_parallel_size(1)
    line = dp_summary_line([_stats(0)], config=shrunk, num_experts=4, started_dp_size=2)
    assert line == ("atom: DP 1 (2 at start: rank failures shrank the group; counters since), "
                    "EP 4 experts (4 a rank), TBO off; per rank: requests 4, steps 10, dummy 0, "
                    "TBO 2; prefill policy none: 0 holds (hold rate 0.40, longest 3 ticks)")


def test_expert_layout_counters_and_every_kind_of_hold():
    config = EngineConfig(data_parallel_size=3, enable_expert_parallel=True, enable_tbo=True,
                          prefill_policy="coalescer", prefill_decode_interval=2)
    holds = {"prefill_policy_decisions_hold_fill": 3,
             "prefill_policy_decisions_hold_decode_interval": 1}
    line = dp_summary_line([_stats(r, **holds) for r in range(3)], config=config, num_experts=8)
    assert line == ("atom: DP 3, EP 8 experts (2 / 3 / 3), TBO on; per rank: requests 4 / 3 / 2, "
                    "steps 10 / 10 / 10, dummy 0 / 1 / 2, TBO 2 / 2 / 2; prefill policy "
                    "coalescer: 4 holds (hold rate 0.40, longest 3 ticks)")


def test_dense_and_unsharded_models():
    stats = [_stats(0, prefill_policy_decisions_hold=5), _stats(1, prefill_policy_decisions_hold=5)]
    dense = dp_summary_line(stats, config=EngineConfig(data_parallel_size=2), num_experts=None)
    assert dense.startswith("atom: DP 2, EP off (dense model), TBO off; per rank: requests 4 / 3")
    assert dense.endswith("prefill policy delayer: 5 holds (hold rate 0.40, longest 3 ticks)")
    moe = dp_summary_line(stats, config=EngineConfig(data_parallel_size=2), num_experts=4)
    assert moe.startswith("atom: DP 2, EP off (4 experts on every rank), TBO off;")
    ep = EngineConfig(data_parallel_size=2, enable_expert_parallel=True)
    assert "EP 4 experts (2 a rank)" in dp_summary_line(stats, config=ep, num_experts=4)


def test_eplb_slots_rebalances_and_balancedness():
    config = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                          eplb_num_redundant_experts=2)
    before = [_stats(r, eplb_num_rebalances=0) for r in range(2)]
    assert ("EP 4 experts + 2 redundant slots (3 a rank), EPLB 0 rebalance(s), last "
            "balancedness none (no window closed), TBO off;") in \
        dp_summary_line(before, config=config, num_experts=4)
    after = [_stats(r, eplb_num_rebalances=2, eplb_balancedness=0.9712) for r in range(2)]
    no_redundant = EngineConfig(data_parallel_size=2, enable_expert_parallel=True,
                                enable_eplb=True)
    assert "EP 4 experts (2 a rank), EPLB 2 rebalance(s), last balancedness 0.97, TBO off;" in \
        dp_summary_line(after, config=no_redundant, num_experts=4)


def test_recorded_expert_load_without_eplb():
    config = EngineConfig(data_parallel_size=2, enable_expert_parallel=True,
                          record_expert_load=True)
    before = [_stats(r) for r in range(2)]
    assert "EP 4 experts (2 a rank, expert load balancedness none (no window closed)), TBO off;" \
        in dp_summary_line(before, config=config, num_experts=4)
    after = [_stats(r, eplb_balancedness=0.6249) for r in range(2)]
    assert "EP 4 experts (2 a rank, expert load balancedness 0.62), TBO off;" in \
        dp_summary_line(after, config=config, num_experts=4)


def test_ranks_that_left_before_the_summary_are_not_waited_for(capsys):
    """A launched deployment's ranks may stop on the launcher's SIGTERM before the front end
    asks for their stats: the summary gives up after its short deadline, saying so, instead of
    waiting out the hang timeout past the launcher's SIGKILL."""
    from types import SimpleNamespace

    from atom.dp.run_summary import SUMMARY_TIMEOUT_S, print_dp_summary

    asked = []

    def get_rank_stats(*, timeout_s=None):
        asked.append(timeout_s)
        raise TimeoutError("get_stats: not every engine core answered")

    engine = SimpleNamespace(config=EngineConfig(data_parallel_size=2),
                             get_rank_stats=get_rank_stats)
    print_dp_summary(engine)
    assert asked == [SUMMARY_TIMEOUT_S]
    assert "no DP summary: the ranks did not answer" in capsys.readouterr().err
