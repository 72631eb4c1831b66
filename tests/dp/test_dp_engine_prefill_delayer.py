"""PrefillDelayer (the default prefill policy with DP > 1) on 2 real DP processes: rank 0's KV pool is nearly full (long prompts pinned to
it), rank 1 gets a stream of short prompts. ``mixed`` ticks occur (rank 1 could prefill, rank 0
has prefill work it cannot admit), prefills are held for at most ``max_delay_passes`` ticks in a
row, and every request completes (no deadlock)."""

from __future__ import annotations

import time

import pytest

from atom import LLM, SamplingParams


MAX_DELAY_PASSES = 3


@pytest.fixture(scope="module")
def dp_llm():
    # 16 blocks x 16 tokens per rank: two 110-token prompts (+16 new tokens) fill rank 0's pool
    llm = LLM(data_parallel_size=2, dtype="float32", num_kv_blocks=16, max_model_len=256,
              num_threads=1, max_num_seqs=2, enable_prefix_caching=False,
              prefill_delayer_max_delay_passes=MAX_DELAY_PASSES)
    yield llm
    llm.shutdown()


def test_mixed_ticks_are_held_boundedly_and_everything_completes(dp_llm):
    long_prompts = [[100 + 13 * i + j for j in range(110)] for i in range(3)]
    short_prompts = [[500 + 7 * i + j for j in range(6)] for i in range(6)]
    long_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    short_params = [SamplingParams(temperature=0.0, max_tokens=2 + i % 3, ignore_eos=True)
                    for i in range(len(short_prompts))]
    outs = dp_llm.generate(long_prompts + short_prompts, [long_params] * 3 + short_params,
                           data_parallel_rank=[0] * 3 + [1] * len(short_prompts))
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == (
        [16] * 3 + [p.max_tokens for p in short_params])
    deadline = time.monotonic() + 60.0  # liveness only
    while True:  # compare counters once both ranks have ended the wave
        stats = dp_llm.get_rank_stats()
        if all(s["idle"] for s in stats) and stats[0]["tick"] == stats[1]["tick"]:
            break
        assert time.monotonic() < deadline, f"the ranks did not go idle: {stats}"
        time.sleep(0.05)
    print({k: v for k, v in stats[0].items() if k.startswith("prefill_policy_")})
    for s in stats:
        assert s["prefill_policy_num_mixed_ticks"] > 0, s
        assert s["prefill_policy_decisions_hold"] > 0, s
        assert 0 < s["prefill_policy_max_consecutive_holds"] <= MAX_DELAY_PASSES, s
        num_per_reason = [v for k, v in s.items() if k.startswith("prefill_policy_decisions_")]
        assert sum(num_per_reason) == s["prefill_policy_num_decisions"] > 0
        assert s["num_free_blocks"] == s["num_total_blocks"]
    # the decision is a pure function of gathered values: identical counters on both ranks
    keys = [k for k in stats[0] if k.startswith("prefill_policy_")]
    assert [stats[0][k] for k in keys] == [stats[1][k] for k in keys]
