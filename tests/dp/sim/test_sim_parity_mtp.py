"""Step parity with a model-based draft: a real 2-rank MTP run (``--speculative-method mtp``,
k = 3, expert parallelism, TBO, the delayer) on the tiny DeepSeek-V3 with a predictable MTP
layer (tests/moe_utils.py), and its simulation, where the :class:`~atom.dp.sim.rank.SimWorker`
proposes the drafts the real run recorded in its DP trace (``drafts`` events,
:func:`atom.dp.sim.workload.drafts_from_trace`) and emits the real run's tokens, so every
verify accepts as many drafts as the real one did. Every trace column but the clocks and the
collective log (the spec columns too: verifies and accepted drafts per rank and tick) is equal
row by row on every rank, and so are the step counters (speculative
steps included) — the same comparison as tests/dp/sim/test_sim_parity.py, on a smaller
workload of the tiny model's vocabulary."""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.dp.sim import simulate
from atom.dp.sim import workload as W
from atom.dp.sim.replay import run_real
from tests.dp.sim.test_sim_parity import PROFILE, assert_traces_equal
from tests.moe_utils import DEEPSEEK_V3, build_tiny_deepseek_mtp

WORKLOAD = W.dp_experiment(clock="tick", burst_interval=4, pressure_prompts=2,
                           pressure_prompt_len=60, pressure_max_tokens=24, num_bursts=3,
                           burst_size=3, short_prompt_len=(8, 24), short_max_tokens=(8, 20),
                           vocab_size=DEEPSEEK_V3["vocab_size"])
COUNTERS = ("num_steps", "num_prefill_steps", "num_mixed_prefill_steps", "num_tbo_steps",
            "num_spec_steps", "num_dummy_steps", "hold_rate", "prefill_policy_stats",
            "num_requests", "num_output_tokens")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_deepseek_mtp(tmp_path_factory.mktemp("deepseek-v3-mtp")))


def test_simulated_mtp_steps_equal_the_real_run(folder, tmp_path):
    config = EngineConfig(model=folder, data_parallel_size=2, dtype="float32", num_threads=1,
                          num_kv_blocks=48, max_num_seqs=8, max_model_len=256,
                          max_num_batched_tokens=64, enable_prefix_caching=False,
                          skip_tokenizer_init=True, enable_expert_parallel=True, enable_tbo=True,
                          prefill_policy="delayer", speculative_method="mtp",
                          num_speculative_tokens=3, dp_trace=str(tmp_path / "real"))
    real = run_real(WORKLOAD, config, name="mtp")
    drafts = W.drafts_from_trace(tmp_path / "real")
    workload = W.with_drafts(W.with_outputs(WORKLOAD, real["output_token_ids_by_request"]),
                             drafts)
    sim = simulate(workload, config, PROFILE, name="mtp", trace_dir=tmp_path / "sim")
    real_trace = assert_traces_equal(tmp_path / "real", tmp_path / "sim",
                                     num_steps=real["num_steps"])
    assert {k: real[k] for k in COUNTERS} == {k: sim[k] for k in COUNTERS}
    # what the run exercises: drafts on both ranks (k > 1 per verify), some accepted and some
    # rejected; the trace's spec columns (equal above, tick by tick) count them
    assert real["num_spec_steps"] > 0
    proposed = [d for per_request in drafts.values() for d in per_request]
    assert sum(len(d) for d in proposed) > len(proposed)
    for trace in real_trace:
        verifies = sum(row["spec_num_verifies"] for row in trace.rows)
        accepted = sum(row["spec_num_accepted_tokens"] for row in trace.rows)
        drafted = sum(len(e["drafts"][i]) for e in trace.events if e["event"] == "drafts"
                      for i in e["drafts"])
        assert verifies == sum(len(e["drafts"]) for e in trace.events if e["event"] == "drafts")
        assert 0 < accepted < drafted, (trace.dp_rank, accepted, drafted)


def test_a_model_draft_without_recorded_drafts_is_an_error():
    config = EngineConfig(data_parallel_size=2, num_kv_blocks=32, skip_tokenizer_init=True,
                          speculative_method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="recorded drafts"):
        simulate(WORKLOAD, config, PROFILE)
