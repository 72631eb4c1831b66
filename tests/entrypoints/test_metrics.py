"""ServerMetrics renders hand-made per-rank stats and finished requests (no server, no engine):
the group's values (steps, the prefill policy's decisions per reason, EPLB's windows) once and
without ``dp_rank``, the delayer's series also under the names that predate the other
policies, and each request's latencies and tokens under the rank that ran it."""

from __future__ import annotations

import pytest
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


def test_coalescer_decisions_are_the_groups_per_policy_and_reason():
    decisions = {"fire_fill": 2, "hold_fill": 5, "hold_decode_interval": 1}
    later = {**decisions, "hold_fill": 6}  # rank 1 answered a tick later
    out = samples("coalescer", [rank_stats(0, decisions), rank_stats(1, later)])
    series = out["atom:prefill_policy_decisions_total"]
    assert len(series) == 3 and all("dp_rank" not in labels for labels, _ in series)
    assert {labels["policy"] for labels, _ in series} == {"coalescer"}
    assert {labels["reason"]: value for labels, value in series} == later
    assert out["atom:prefill_policy_max_consecutive_holds"] == [
        ({"model_name": "m", "policy": "coalescer"}, 3.0)]
    assert "atom:prefill_delayer_decisions_total" not in out


def test_delayer_keeps_its_metric_names():
    out = samples("delayer", [rank_stats(0, {"hold": 4, "allow_all": 1})])
    assert sorted((labels["reason"], v) for labels, v in
                  out["atom:prefill_delayer_decisions_total"]) == [("allow_all", 1.0),
                                                                   ("hold", 4.0)]
    assert out["atom:prefill_delayer_hold_rate"] == [({"model_name": "m"}, 0.25)]
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
    per_pos = {labels["position"]: v
               for labels, v in out["atom:spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 1.0, "1": 1.0, "2": 1.0}
    spec.record(num_drafts=3, num_accepted=1, num_emitted=2)
    assert spec.accepted_per_position == [2, 1, 1]
    assert spec.mean_acceptance_length == 1 + 4 / 3
    out = samples("none", [{"num_total_blocks": 8, "num_free_blocks": 8, **spec.as_stats()}])
    assert out["atom:spec_decode_mean_acceptance_length"][0][1] == 1 + 4 / 3
    assert out["atom:spec_decode_num_drafts_total"][0][1] == 3
    no_spec = samples("none", [{"num_total_blocks": 8, "num_free_blocks": 8}])
    assert "atom:spec_decode_accepted_length_total" not in no_spec


def test_eplb_series_of_the_group_and_per_rank():
    from atom.engine.core_client import merge_rank_results

    eplb = {"eplb_balancedness": 0.96, "eplb_num_rebalances": 2,
            "eplb_rebalance_seconds_sum": 0.3,
            "eplb_rebalance_seconds_buckets": [0, 1, 1, 0, 0, 0, 0, 0, 0]}  # 0.05 s, 0.25 s
    stats = [{**rank_stats(r, {}), **eplb} for r in (0, 1)]
    out = samples("delayer", stats)
    assert out["atom:eplb_balancedness"] == [({"model_name": "m"}, 0.96)]  # the group's
    assert out["atom:eplb_rebalances_total"] == [({"model_name": "m"}, 2.0)]
    buckets = {(labels["dp_rank"], labels["le"]): v
               for labels, v in out["atom:eplb_rebalance_seconds_bucket"]}
    assert (buckets[("0", "0.05")], buckets[("0", "0.1")], buckets[("1", "+Inf")]) == (1, 2, 2)
    assert [v for _, v in out["atom:eplb_rebalance_seconds_count"]] == [2.0, 2.0]
    merged = merge_rank_results(stats)  # the group's figures: not summed over the ranks
    assert (merged["eplb_num_rebalances"], merged["eplb_rebalance_seconds_buckets"][1]) == (2, 1)
    assert "atom:eplb_balancedness" not in samples("none", [rank_stats(0, {})])


def _finished(dp_rank: int | None, ttft_s: float | None, *, num_prompt: int = 5):
    from atom.outputs import CompletionOutput, RequestMetrics, RequestOutput

    return RequestOutput(
        "r", None, list(range(num_prompt)),
        [CompletionOutput(0, "", [1, 2, 3], finish_reason="length")], True,
        metrics=RequestMetrics(arrival_time_s=0.0,
                               first_token_time_s=None if ttft_s is None else ttft_s,
                               finished_time_s=1.0, num_output_tokens=3, dp_rank=dp_rank))


def test_request_series_per_rank_and_group_steps_once():
    metrics = ServerMetrics("m")
    for rank, ttft_s in ((0, 0.2), (1, 0.4), (1, 0.6), (None, None)):  # None: refused, no rank
        metrics.record_finished(_finished(rank, ttft_s))
    stats = [{"dp_rank": r, "num_total_blocks": 8, "num_free_blocks": 8, "num_steps": 40 - r,
              "num_prefill_steps": 7, "num_dummy_steps": 3 * r, "tick": 44} for r in (0, 1)]
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render(stats).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))

    def per_rank(name: str) -> dict[str, float]:
        return {labels["dp_rank"]: v for labels, v in out[name]}

    assert per_rank("atom:time_to_first_token_seconds_count") == {"0": 1.0, "1": 2.0}
    assert per_rank("atom:time_to_first_token_seconds_sum") == pytest.approx({"0": 0.2, "1": 1.0})
    assert per_rank("atom:e2e_request_latency_seconds_count") == {"0": 1.0, "1": 2.0}
    assert per_rank("atom:time_per_output_token_seconds_count") == {"0": 1.0, "1": 2.0}
    assert per_rank("atom:prompt_tokens_total") == {"0": 5.0, "1": 10.0}
    assert per_rank("atom:generation_tokens_total") == {"0": 3.0, "1": 6.0}
    assert sum(v for _, v in out["atom:request_success_total"]) == 4  # the refused one too
    # the group's counters once, no dp_rank; the rank's own (dummy batches) per rank
    assert out["atom:dp_steps_total"] == [({"model_name": "m"}, 40.0)]
    assert out["atom:dp_prefill_steps_total"] == [({"model_name": "m"}, 7.0)]
    assert out["atom:dp_ticks_total"] == [({"model_name": "m"}, 44.0)]
    assert per_rank("atom:dp_dummy_steps_total") == {"0": 0.0, "1": 3.0}
