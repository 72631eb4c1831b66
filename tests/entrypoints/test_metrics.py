"""ServerMetrics renders the prefill policy's counters from hand-made per-rank stats (no server,
no engine): one series per rank and reason, summing to the decisions, and the delayer's series
also under the names that predate the other policies."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from atom.entrypoints.openai.metrics import ServerMetrics


def rank_stats(dp_rank: int, decisions: dict[str, int]) -> dict:
    stats = {"dp_rank": dp_rank, "num_total_blocks": 8, "num_free_blocks": 8,
             "prefill_policy_num_decisions": sum(decisions.values()),
             "prefill_policy_hold_rate": 0.25, "prefill_policy_max_consecutive_holds": 3}
    stats.update({f"prefill_policy_decisions_{r}": n for r, n in decisions.items()})
    return stats


def samples(policy: str, stats: list[dict]) -> dict[str, list]:
    text = ServerMetrics("m", prefill_policy=policy).render(stats).decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_coalescer_decisions_per_rank_policy_and_reason():
    decisions = {"fire_fill": 2, "hold_fill": 5, "hold_decode_interval": 1}
    out = samples("coalescer", [rank_stats(0, decisions), rank_stats(1, decisions)])
    series = out["atom:prefill_policy_decisions_total"]
    assert len(series) == 6
    assert {labels["policy"] for labels, _ in series} == {"coalescer"}
    for rank in ("0", "1"):
        per_reason = {labels["reason"]: value for labels, value in series
                      if labels["dp_rank"] == rank}
        assert per_reason == decisions
    assert [v for _, v in out["atom:prefill_policy_max_consecutive_holds"]] == [3.0, 3.0]
    assert "atom:prefill_delayer_decisions_total" not in out


def test_delayer_keeps_its_metric_names():
    out = samples("delayer", [rank_stats(0, {"hold": 4, "allow_all": 1})])
    assert sorted((labels["reason"], v) for labels, v in
                  out["atom:prefill_delayer_decisions_total"]) == [("allow_all", 1.0),
                                                                   ("hold", 4.0)]
    assert out["atom:prefill_delayer_hold_rate"] == [({"model_name": "m", "dp_rank": "0"}, 0.25)]
    assert len(out["atom:prefill_policy_decisions_total"]) == 2


def test_single_rank_has_no_policy_series():
    out = samples("none", [{"num_total_blocks": 8, "num_free_blocks": 8}])
    assert "atom:prefill_policy_decisions_total" not in out


def test_speculative_decoding_stats_are_exported():
    from atom.core.spec_stats import SpecStats

    spec = SpecStats(3)
    spec.num_verify_steps = 2
    spec.record(num_drafts=3, num_accepted=3, num_emitted=4)
    spec.record(num_drafts=2, num_accepted=0, num_emitted=1)
    out = samples("none", [{"num_total_blocks": 8, "num_free_blocks": 8, **spec.as_stats()}])
    accepted = {labels["num_accepted"]: v for labels, v in out["atom:spec_decode_accepted_length_total"]}
    assert accepted == {"0": 1.0, "1": 0.0, "2": 0.0, "3": 1.0}
    assert out["atom:spec_decode_num_draft_tokens_total"][0][1] == 5
    assert out["atom:spec_decode_num_accepted_tokens_total"][0][1] == 3
    assert out["atom:spec_decode_acceptance_rate"][0][1] == 0.6
    assert out["atom:spec_decode_mean_tokens_per_forward"][0][1] == 2.5
    no_spec = samples("none", [{"num_total_blocks": 8, "num_free_blocks": 8}])
    assert "atom:spec_decode_accepted_length_total" not in no_spec


def test_eplb_series_per_rank():
    from atom.engine.core_client import merge_rank_results

    eplb = {"eplb_balancedness": 0.96, "eplb_num_rebalances": 2,
            "eplb_rebalance_seconds_sum": 0.3,
            "eplb_rebalance_seconds_buckets": [0, 1, 1, 0, 0, 0, 0, 0, 0]}  # 0.05 s, 0.25 s
    stats = [{**rank_stats(r, {}), **eplb} for r in (0, 1)]
    out = samples("delayer", stats)
    assert [v for _, v in out["atom:eplb_balancedness"]] == [0.96, 0.96]
    assert [v for _, v in out["atom:eplb_rebalances_total"]] == [2.0, 2.0]
    buckets = {(labels["dp_rank"], labels["le"]): v
               for labels, v in out["atom:eplb_rebalance_seconds_bucket"]}
    assert (buckets[("0", "0.05")], buckets[("0", "0.1")], buckets[("1", "+Inf")]) == (1, 2, 2)
    assert [v for _, v in out["atom:eplb_rebalance_seconds_count"]] == [2.0, 2.0]
    merged = merge_rank_results(stats)  # the group's figures: not summed over the ranks
    assert (merged["eplb_num_rebalances"], merged["eplb_rebalance_seconds_buckets"][1]) == (2, 1)
    assert "atom:eplb_balancedness" not in samples("none", [rank_stats(0, {})])
