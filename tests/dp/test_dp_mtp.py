"""MTP speculative decoding on 2 real DP ranks with expert parallelism and two-batch overlap
(gloo, fp32), on the tiny DeepSeek-V3 with an MTP layer (tests/moe_utils.py ``add_mtp_layer``).

The MTP layer's MoE runs the EP collectives in every draft forward, so every rank must run as
many draft forwards per step as the others, sized alike: greedy output (k = 1 and 3) equals
one rank's spec-off output with every request on rank 0 (rank 1 idle: dummy drafts), spread
over both ranks (chunked prompts), with sequences cut at ``max_model_len`` (they draft fewer
tokens as they near it, down to none at ``max_model_len - 1``), and with a long prompt on rank 1
while rank 0 decodes (the DP trace shows ticks where rank 1 held prefill chunks only while rank
0 verified drafts: rank 1 ran the drafter's forwards on zero tokens); no hang (the group
timeout bounds every collective), and the collective hashes, counts and speculative steps of
both ranks agree after each run.
"""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.dp.dp_trace import read_trace
from tests.moe_utils import (OPTIONS, PARAMS, build_tiny_deepseek_mtp, greedy_in_process,
                             idle_rank_stats, tiny_prompts)
from tests.utils import check_greedy_close, ours_greedy

MAX_MODEL_LEN = 96
#: long enough that every sequence runs into max_model_len (prompts of 4 .. 60 tokens)
LONG = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN, logprobs=5, ignore_eos=True)
#: a short prompt for rank 0 (decoding with drafts from its second step) and a long one for rank 1
#: (three prefill chunks of the 32-token budget: two steps of chunks only on rank 1)
UNEVEN = [[3 + (11 * i) % 500 for i in range(5)], [3 + (7 * i) % 500 for i in range(80)]]
ENGINE = dict(OPTIONS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32,
              skip_tokenizer_init=True, dp_group_timeout_s=60.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_deepseek_mtp(tmp_path_factory.mktemp("deepseek-v3-mtp"))


@pytest.fixture(scope="module")
def references(folder):
    """Spec-off greedy on one rank: (short runs, runs to max_model_len, the uneven pair)."""
    options = {k: v for k, v in ENGINE.items() if k not in ("skip_tokenizer_init",
                                                             "dp_group_timeout_s")}
    return (*(greedy_in_process(folder, tiny_prompts(), params, **options)[0]
              for params in (PARAMS, LONG)), greedy_in_process(folder, UNEVEN, **options)[0])


def _check_lockstep(llm: LLM) -> list[dict]:
    stats = idle_rank_stats(llm)
    assert len(stats) == 2  # no rank failed
    assert stats[0]["collective_hash"] == stats[1]["collective_hash"]
    assert stats[0]["collective_count"] == stats[1]["collective_count"]
    assert stats[0]["num_spec_steps"] == stats[1]["num_spec_steps"]
    return stats


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_on_two_ep_ranks_with_tbo(folder, references, tmp_path, k):
    short, long, uneven = references
    requests = [{"prompt_token_ids": p} for p in tiny_prompts()]
    with LLM(str(folder), **ENGINE, data_parallel_size=2, enable_expert_parallel=True,
             enable_tbo=True, speculative_method="mtp", num_speculative_tokens=k,
             dp_trace=str(tmp_path)) as llm:
        pinned = ours_greedy(llm.generate(requests, PARAMS, data_parallel_rank=0))
        check_greedy_close(pinned, short, name=f"mtp k={k}, EP + TBO, rank 1 idle")
        stats = _check_lockstep(llm)
        assert stats[1]["num_dummy_steps"] == stats[1]["num_steps"] > 0
        assert stats[1]["spec_num_verifies"] == 0 < stats[0]["spec_num_accepted_tokens"]
        spread = ours_greedy(llm.generate(requests, PARAMS))
        check_greedy_close(spread, short, name=f"mtp k={k}, EP + TBO, both ranks")
        stats = _check_lockstep(llm)
        assert stats[1]["spec_num_verifies"] > 0
        merged = llm.get_stats()  # the group's acceptance, from the summed counters
        assert merged["spec_mean_acceptance_length"] == (
            1 + merged["spec_num_accepted_tokens"] / merged["spec_num_verifies"])
        assert merged["spec_num_accepted_tokens_pos_0"] == sum(
            s["spec_num_accepted_tokens_pos_0"] for s in stats)
        assert stats[0]["num_tbo_steps"] > 0  # prefill-only steps still split
        to_max = ours_greedy(llm.generate(requests, LONG))
        check_greedy_close(to_max, long, name=f"mtp k={k}, EP + TBO, to max_model_len")
        assert all(len(p) + len(r.token_ids) == MAX_MODEL_LEN
                   for p, r in zip(tiny_prompts(), to_max))
        for s in _check_lockstep(llm):
            assert s["num_free_blocks"] == s["num_total_blocks"]
        pair = ours_greedy(llm.generate([{"prompt_token_ids": p} for p in UNEVEN], PARAMS,
                                        data_parallel_rank=[0, 1]))
        check_greedy_close(pair, uneven, name=f"mtp k={k}, EP + TBO, a long prompt on rank 1")
        _check_lockstep(llm)
    # some tick had rank 1 on prefill chunks only while rank 0 verified drafts: rank 1 ran the
    # drafter's forwards (and their collectives) on zero tokens
    rows = [t.rows for t in read_trace(tmp_path)]
    assert any(r1["step_num_decode_seqs"] == 0 and r1["step_num_prefill_tokens"] > 0
               and r0["step_num_spec_tokens"] > 0 for r0, r1 in zip(*rows))
