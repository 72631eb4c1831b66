"""Exact step parity: the simulator's per-tick, per-rank decisions and batch shapes equal a
real 2-rank run's, on ``scripts/dp_experiment.py``'s workload (its defaults: 3 long prompts
pinned to the KV-pressured rank 0, 6 bursts of 4 routed short ones) replayed tick-clocked
(bursts 8 ticks apart), dense and MoE with expert parallelism and TBO, the delayer off and
on; MoE with EPLB (the simulator replaying the real run's recorded expert load: its windows,
plans and balancedness must come out the same); dense with n-gram speculation (the simulator's
worker emitting the real run's tokens, so the same drafts are proposed and accepted). Every
column of the per-tick trace but the clocks and the collective log is compared, row by row on
every rank, and so are the step counters and the policy's decisions per reason. The simulated
ranks run the real ``EngineCore`` over a cost-model worker (:mod:`atom.dp.sim.rank`).

Real processes, real engine; the models are tiny random ones (a Llama, and a top-2-of-8
Mixtral with its experts over the 2 ranks): the scheduling path does not depend on the
weights, and a tiny model keeps each run to seconds. The same comparison on the embedded
model is ``scripts/dp_experiment.py --clock tick`` against ``atom sim run``
(docs/DP_EXPERIMENTS.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from atom.config import EngineConfig
from atom.dp.dp_trace import TRACE_COLUMNS, read_trace
from atom.dp.sim import simulate
from atom.dp.sim import workload as W
from atom.dp.sim.cost_model import Coefficients, Profile
from atom.dp.sim.experts import RecordedExpertLoad
from atom.dp.sim.replay import run_real

WORKLOAD = W.dp_experiment(clock="tick", burst_interval=8)
VOCAB = W.VOCAB_RANGE[1] + 64  # the workload's token ids
BASE = EngineConfig(data_parallel_size=2, dtype="float32", num_threads=1, num_kv_blocks=32,
                    max_num_seqs=8, max_model_len=1024, enable_prefix_caching=False,
                    skip_tokenizer_init=True)
CONFIGS = {"dense, none": dict(prefill_policy="none"),
           "dense, delayer": dict(prefill_policy="delayer"),
           "moe ep tbo, none": dict(prefill_policy="none", enable_expert_parallel=True,
                                    enable_tbo=True),
           "moe ep tbo, delayer": dict(prefill_policy="delayer", enable_expert_parallel=True,
                                       enable_tbo=True),
           "moe ep eplb, delayer": dict(prefill_policy="delayer", enable_expert_parallel=True,
                                        enable_eplb=True, eplb_num_redundant_experts=2,
                                        eplb_window_size=20, eplb_step_interval=20,
                                        eplb_min_balancedness=1.0),
           "dense ngram, delayer": dict(prefill_policy="delayer", speculative_method="ngram",
                                        num_speculative_tokens=3)}
# the step's timing and the collective log are the real run's own; everything else must match
COMPARED = [c for c in TRACE_COLUMNS if c not in ("start_us", "sync_us", "step_us",
                                                  "eplb_expert_us", "collective_count",
                                                  "collective_hash")]
COUNTERS = ("num_steps", "num_prefill_steps", "num_mixed_prefill_steps", "num_tbo_steps",
            "num_dummy_steps", "hold_rate", "max_consecutive_holds", "prefill_policy_stats",
            "num_requests", "num_output_tokens")
PROFILE = Profile(Coefficients(step_s=0.05), model_facts={"max_position_embeddings": 2048,
                                                        "num_experts": 8})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny random Hugging Face folders: a Llama and a top-2-of-8 Mixtral."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    folders = {}
    for name, model in (("dense", LlamaForCausalLM(LlamaConfig(**shape))),
                        ("moe", MixtralForCausalLM(MixtralConfig(
                            **shape, num_local_experts=8, num_experts_per_tok=2)))):
        torch.manual_seed(0)
        folders[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(folders[name])
    return folders


def assert_traces_equal(real_folder, sim_folder, *, num_steps: int) -> list:
    """Every rank's rows of the real and the simulated trace equal in :data:`COMPARED`, one
    row per step of the real run; returns the real trace."""
    real_trace, sim_trace = read_trace(real_folder), read_trace(sim_folder)
    assert len(real_trace) == len(sim_trace)
    for r, s in zip(real_trace, sim_trace):
        assert len(r.rows) == len(s.rows) == num_steps
        for real_row, sim_row in zip(r.rows, s.rows):
            assert {c: real_row[c] for c in COMPARED} == {c: sim_row[c] for c in COMPARED}, (
                f"rank {r.dp_rank}, tick {real_row['tick']}")
    return real_trace


@pytest.mark.parametrize("name", CONFIGS)
def test_simulated_steps_equal_the_real_runs(name, models, tmp_path):
    config = dataclasses.replace(BASE, model=models["moe" if "moe" in name else "dense"],
                                 **CONFIGS[name])
    real = run_real(WORKLOAD, dataclasses.replace(config, dp_trace=str(tmp_path / "real")),
                    name=name)
    routing = (RecordedExpertLoad.from_trace(tmp_path / "real", num_layers=2, num_experts=8)
               if config.enable_eplb else None)
    workload = W.with_outputs(WORKLOAD, real["output_token_ids_by_request"])
    sim = simulate(workload, config, PROFILE, name=name, trace_dir=tmp_path / "sim",
                   routing=routing)
    assert [r["num_late_arrivals"] for r in real["per_rank"]] == [0, 0]
    real_trace = assert_traces_equal(tmp_path / "real", tmp_path / "sim",
                                     num_steps=real["num_steps"])
    assert {k: real[k] for k in COUNTERS} == {k: sim[k] for k in COUNTERS}
    assert real["num_output_tokens"] == sum(r.output_len for r in WORKLOAD)
    # the workload exercises what it claims: KV pressure, mixed steps or holds, TBO splits
    assert real["per_rank"][0]["num_preemptions"] > 0
    assert real["num_mixed_prefill_steps"] > 0 or real["prefill_policy_stats"][
        "decisions_hold"] > 0
    assert (real["num_tbo_steps"] > 0) == ("tbo" in name)
    rows = [row for trace in real_trace for row in trace.rows]
    assert any(row["step_num_spec_tokens"] for row in rows) == ("ngram" in name)
    if config.enable_eplb:  # windows closed and the placement moved, the same in both
        windows = [[{k: v for k, v in e.items() if not k.endswith("_ms")}  # real clocks
                    for e in t.events if e["event"] == "eplb_window"]
                   for t in (real_trace[0], read_trace(tmp_path / "sim")[0])]
        assert windows[0] == windows[1] and any(w["rebalanced"] for w in windows[0])
