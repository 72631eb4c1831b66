"""DP=2 engine on real processes (embedded model, fp32): greedy outputs equal the single-rank
engine, uneven workloads keep the ranks in lockstep (identical collective hashes), and an idle
group runs no ticks and burns no CPU until a request wakes it.

One DP LLM and one single-rank LLM for the whole module (each start loads the model).
"""

from __future__ import annotations

import os
import time

import pytest

from atom import LLM, SamplingParams
from tests.utils import check_greedy_close, ours_greedy


OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
LONG = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle. "
        "The keeper lives alone on a rocky island far from the coast, and every night he climbs "
        "the tower to light the lamp. One stormy morning he walks along the shore and")
PROMPTS = ["Hello, my name is", "The capital of France is", LONG, "1 2 3 4 5",
           "What is the tallest mountain in the world? The tallest mountain is",
           "def fibonacci(n):"]
DEADLINE_S = 60.0  # liveness: generous on 2 shared cores


@pytest.fixture(scope="module")
def ref_llm():
    llm = LLM(**OPTIONS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM(data_parallel_size=2, **OPTIONS)
    yield llm
    llm.shutdown()


def _wait_idle(llm: LLM) -> list[dict]:
    """Per-rank stats once every rank is idle in the same wave (the last wave has ended)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        stats = llm.get_rank_stats()
        if all(s["idle"] for s in stats) and len({s["wave_id"] for s in stats}) == 1:
            return stats
        assert time.monotonic() < deadline, f"the ranks did not go idle: {stats}"
        time.sleep(0.05)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_dp2_mixed_batch_equals_single_rank(ref_llm, dp_llm):
    ref = ref_llm.generate(PROMPTS, GREEDY)
    ours = dp_llm.generate(PROMPTS, GREEDY)
    check_greedy_close(ours_greedy(ours), ours_greedy(ref), name="dp2 mixed batch")
    stats = _wait_idle(dp_llm)
    assert all(s["num_real_steps"] > 0 for s in stats), "least_requests should use both ranks"


def test_dp2_one_long_request_vs_short_ones(ref_llm, dp_llm):
    long_params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    prompts = [LONG] + PROMPTS[:2] + PROMPTS[3:5]
    params = [long_params] + [short_params] * 4
    before = _wait_idle(dp_llm)
    ours = dp_llm.generate(prompts, params, data_parallel_rank=[0, 1, 1, 1, 1])
    ref = ref_llm.generate(prompts, params)
    check_greedy_close(ours_greedy(ours), ours_greedy(ref), name="dp2 long vs short")
    after = _wait_idle(dp_llm)
    # rank 1 finished early and kept stepping dummy batches until rank 0 was done
    assert after[1]["num_dummy_steps"] - before[1]["num_dummy_steps"] >= 10
    assert after[0]["num_dummy_steps"] == before[0]["num_dummy_steps"]


def test_dp2_single_request_other_rank_never_gets_work(ref_llm, dp_llm):
    before = _wait_idle(dp_llm)
    ours = dp_llm.generate([PROMPTS[1]], GREEDY, data_parallel_rank=1)
    ref = ref_llm.generate([PROMPTS[1]], GREEDY)
    check_greedy_close(ours_greedy(ours), ours_greedy(ref), name="dp2 one request")
    assert ours[0].outputs[0].finish_reason in ("length", "stop")
    after = _wait_idle(dp_llm)
    assert after[0]["num_real_steps"] == before[0]["num_real_steps"]
    assert after[0]["num_dummy_steps"] > before[0]["num_dummy_steps"]


def test_collective_hashes_identical_after_uneven_work(dp_llm):
    stats = _wait_idle(dp_llm)
    assert stats[0]["collective_count"] > 0
    assert len({(s["collective_count"], s["collective_hash"], s["tick"]) for s in stats}) == 1, stats


def test_idle_group_runs_no_ticks_and_wakes_on_a_request(dp_llm):
    stats = _wait_idle(dp_llm)
    pids = [p.pid for p in dp_llm.engine.client.ranks.procs]
    cpu_before = [_cpu_s(pid) for pid in pids]
    time.sleep(2.0)  # a measurement window, not synchronization
    cpu_used = [_cpu_s(pid) - c for pid, c in zip(pids, cpu_before)]
    idle_stats = dp_llm.get_rank_stats()
    assert [s["tick"] for s in idle_stats] == [s["tick"] for s in stats], "an idle group ticked"
    assert all(s["idle"] for s in idle_stats)
    assert max(cpu_used) < 0.3, f"idle ranks used CPU: {cpu_used} s in 2 s"
    out = dp_llm.generate(["Wake up and"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) >= 1
    woken = _wait_idle(dp_llm)
    assert all(w["tick"] > s["tick"] for w, s in zip(woken, stats)), "both ranks must have stepped"
    assert all(w["wave_id"] == s["wave_id"] + 1 for w, s in zip(woken, stats)), ([(s["wave_id"], s["tick"]) for s in stats], [(w["wave_id"], w["tick"]) for w in woken])


def test_request_sent_after_the_group_went_idle_unseen_wakes_every_rank(dp_llm):
    """The race waves close: the front end dispatches believing the group still steps in the
    wave that just ended (no StartWave sent); the rank that gets the request asks for a wake-up."""
    stats = _wait_idle(dp_llm)
    client = dp_llm.engine.client
    client.group_idle, client.wave_id = False, client.wave_id - 1  # wave_complete not seen yet
    wakeups = client.num_wave_wakeups
    out = dp_llm.generate(["Late request"], SamplingParams(temperature=0.0, max_tokens=3),
                          data_parallel_rank=1)
    assert out[0].outputs[0].finish_reason == "length"
    assert client.num_wave_wakeups == wakeups + 1
    woken = _wait_idle(dp_llm)
    assert all(w["tick"] > s["tick"] for w, s in zip(woken, stats))
    assert client.wave_id == woken[0]["wave_id"]


# ----- sampling streams (issue 38): each rank its own, a seeded request's the same anywhere -----

STORY = "Once upon a time"
NUM_COPIES = 8


def test_identical_unseeded_requests_differ_on_two_ranks_as_on_one(ref_llm, dp_llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    one = [o.outputs[0].text for o in ref_llm.generate([STORY] * NUM_COPIES, params)]
    half = NUM_COPIES // 2
    two = [o.outputs[0].text for o in dp_llm.generate(
        [STORY] * NUM_COPIES, params, data_parallel_rank=[0] * half + [1] * half)]
    assert len(set(one)) == NUM_COPIES, one
    # with one stream per config, rank 1's k-th request drew rank 0's k-th noise: equal pairs
    assert len(set(two)) == NUM_COPIES, two


def test_a_seeded_request_gives_the_same_text_on_either_rank_and_on_one(ref_llm, dp_llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    texts = {dp_llm.generate([STORY], params, data_parallel_rank=rank)[0].outputs[0].text
             for rank in (0, 1)}
    texts.add(ref_llm.generate([STORY], params)[0].outputs[0].text)
    assert len(texts) == 1, texts
