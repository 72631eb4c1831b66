"""``scripts/dp_experiment.py`` end to end on a small workload with the MoE model (experts
sharded over 2 real ranks): both configurations (the coalescer with TBO off and on) complete,
their counters are consistent, and each leaves its trace, Perfetto JSON and PNG (the numbers
themselves are the script's output, not asserted; the dense workload's policy comparison is
tests/dp/test_dp_engine_coalescer.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys



SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "dp_experiment.py"


def test_dp_experiment_small_run(tmp_path):
    out = tmp_path / "dp.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--pressure-prompts", "2", "--pressure-prompt-len", "120",
         "--pressure-max-tokens", "8", "--num-bursts", "2", "--burst-size", "2",
         "--burst-interval-s", "0.2", "--short-max-tokens", "2", "4", "--num-kv-blocks", "16",
         "--prefill-policy", "coalescer", "--prefill-decode-interval", "0",
         "--moe-split-experts", "4", "--trace-dir", str(tmp_path / "trace"),
         "--output-json", str(out)],
        capture_output=True, text=True, timeout=900)  # liveness only
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mixed-step fraction" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == ["coalescer, interval 0, TBO off",
                                            "coalescer, interval 0, TBO on"]
    for r in results:
        assert r["num_requests"] == 6
        assert 0 <= r["num_mixed_prefill_steps"] <= r["num_prefill_steps"] <= r["num_steps"]
        assert 0.0 <= r["mixed_step_fraction"] <= 1.0 and 0.0 <= r["dummy_step_fraction"] <= 1.0
        stats = r["prefill_policy_stats"]
        per_reason = [v for k, v in stats.items() if k.startswith("decisions_")]
        assert sum(per_reason) == stats["num_decisions"] == r["num_steps"]
        assert r["max_consecutive_holds"] <= 30  # the coalescer's ttft_max_ticks default
        trace = pathlib.Path(r["trace"])
        assert {p.name for p in trace.iterdir()} == {"dp0.jsonl", "dp1.jsonl", "perfetto.json",
                                                    "timeline.png"}
        assert r["prefill_policy"] == "coalescer"
    assert [r["num_tbo_steps"] > 0 for r in results] == [False, True]
