"""The PrefillCoalescer on ``scripts/dp_experiment.py``'s workload (2 real ranks, a KV-pressured
rank 0 and 6 bursts of short prompts), against the same workload with no policy: the
mixed-step fraction is at most half of the policy-off run's, no hold run is longer than its
branch's bound, the reasons sum to the decisions on both ranks, and every request completes.
Counts come from the gathered batch shapes and the per-tick trace. The workload runs
tick-clocked (``--clock tick``) on a tiny random Llama: with arrivals in ticks and the KV pool
in blocks, the batch shapes are those of the embedded model's run (10 mixed steps of 95 without
a policy, 2 of 98 with the coalescer, both models, 2026-12-04), at a tenth of its time. The full
sweep (every policy, interval 0 and 2) is the benchmark in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace
from tests.utils import save_tiny_llama


SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "dp_experiment.py"
NUM_BURSTS, BURST_SIZE, NUM_PRESSURE = 6, 4, 3  # the script's defaults
VOCAB_SIZE = 20000  # the workload's token ids are 100-19999


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = tmp_path_factory.mktemp("coalescer")
    save_tiny_llama(out / "model", vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(out / "model"), "--clock", "tick",
         "--prefill-policy", "none", "coalescer",
         "--prefill-decode-interval", "0", "--num-bursts", str(NUM_BURSTS),
         "--burst-size", str(BURST_SIZE), "--pressure-prompts", str(NUM_PRESSURE),
         "--trace-dir", str(out / "trace"), "--output-json", str(out / "dp.json")],
        capture_output=True, text=True, timeout=1800)  # liveness only
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    return {r["prefill_policy"]: r for r in json.loads((out / "dp.json").read_text())["results"]}


def test_coalescer_halves_the_mixed_steps(experiment):
    off, coalescer = experiment["none"], experiment["coalescer"]
    assert off["num_mixed_prefill_steps"] > 0
    assert coalescer["mixed_step_fraction"] <= 0.5 * off["mixed_step_fraction"], (
        off["mixed_step_fraction"], coalescer["mixed_step_fraction"])


def test_every_request_completes_and_the_reasons_sum_to_the_decisions(experiment):
    for result in experiment.values():
        assert result["num_requests"] == NUM_PRESSURE + NUM_BURSTS * BURST_SIZE
        stats = result["prefill_policy_stats"]
        per_reason = [v for k, v in stats.items() if k.startswith("decisions_")]
        assert sum(per_reason) == stats["num_decisions"] == result["num_steps"]
    assert experiment["coalescer"]["prefill_policy_stats"]["decisions_hold"] > 0


def test_coalescer_holds_are_bounded_per_branch_and_agree_on_both_ranks(experiment):
    bounds = EngineConfig(data_parallel_size=2)  # the script runs the coalescer's defaults
    ttft, partial = (bounds.prefill_coalescer_ttft_max_ticks,
                     bounds.prefill_coalescer_partial_max_ticks)
    rank0, rank1 = (t.rows for t in read_trace(experiment["coalescer"]["trace"]))
    assert len(rank0) == len(rank1) == experiment["coalescer"]["num_steps"]
    for a, b in zip(rank0, rank1):
        assert (a["tick"], a["reason"], a["num_consecutive_holds"], a["collective_hash"]) == (
            b["tick"], b["reason"], b["num_consecutive_holds"], b["collective_hash"])
        holds = a["num_consecutive_holds"]
        assert holds <= ttft, a
        if a["has_partial_prefill"] or b["has_partial_prefill"]:
            assert holds <= partial, a
    assert experiment["coalescer"]["max_consecutive_holds"] <= ttft
