"""``scripts/dp_experiment.py`` end to end on a small tick-clocked workload with a tiny random
Mixtral of 512 tokens (a real MoE folder, no tokenizer; ``--enable-expert-parallel``: its
experts sharded over 2 real ranks; the prompts drawn inside its vocabulary): both
configurations (the coalescer with TBO off and on) complete,
their counters are consistent, and each leaves its trace, Perfetto JSON and PNG (the numbers
themselves are the script's output, not asserted; the dense workload's policy comparison is
tests/dp/test_dp_engine_coalescer.py). Repeats, the who-paid table and the warnings from hand-made
run results; what cannot run (expert parallelism on a dense model) is a one-line error."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

from tests.moe_utils import build_tiny_mixtral
from tests.utils import save_tiny_llama

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "dp_experiment.py"


def test_dp_experiment_small_run(tmp_path):
    out = tmp_path / "dp.json"
    build_tiny_mixtral(tmp_path / "model")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tmp_path / "model"), "--clock", "tick",
         "--pressure-prompts", "2", "--pressure-prompt-len", "120",
         "--pressure-max-tokens", "8", "--num-bursts", "2", "--burst-size", "2",
         "--short-max-tokens", "2", "4", "--num-kv-blocks", "16",
         "--prefill-policy", "coalescer", "--prefill-decode-interval", "0",
         "--enable-expert-parallel", "--trace-dir", str(tmp_path / "trace"),
         "--output-json", str(out)],
        capture_output=True, text=True, timeout=900)  # liveness only
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mixed-step fraction" in proc.stdout and "Who paid" in proc.stdout
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["warnings"] == [line.removeprefix("warning: ") for line in
                                  proc.stdout.splitlines() if line.startswith("warning: ")]
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
        assert r["prefill_policy"] == "coalescer" and r["repeats"] == 1
        assert set(r["by_class"]) == {"pressure", "burst"} and len(r["peak_kv_usage"]) == 2
    assert [r["num_tbo_steps"] > 0 for r in results] == [False, True]


def test_expert_parallelism_on_a_dense_model_is_a_one_line_error(tmp_path):
    save_tiny_llama(tmp_path / "model", tokenizer=False)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tmp_path / "model"), "--clock", "tick",
         "--enable-expert-parallel", "--prefill-policy", "none", "--prefill-decode-interval",
         "0", "--trace-dir", str(tmp_path / "trace"), "--output-json", str(tmp_path / "o.json")],
        capture_output=True, text=True, timeout=300)  # liveness only
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dp_experiment.py: error: ") and "needs an MoE model" in last, \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_split_experts_and_a_real_moe_both_shard_the_experts():
    module = _script_module()
    for extra, split in (([], None), (["--moe-split-experts", "4"], 4),
                         (["--enable-expert-parallel"], None)):
        configs = module.configurations(module.parse_args(
            ["--prefill-policy", "none", "--prefill-decode-interval", "0", *extra]))
        if not extra:
            assert [options.get("enable_expert_parallel") for _, options in configs] == [None]
            continue
        assert [(name, options["enable_expert_parallel"], options["moe_split_experts"],
                 options["enable_tbo"]) for name, options in configs] == [
            ("none, interval 0, TBO off", True, split, False),
            ("none, interval 0, TBO on", True, split, True)]


def _script_module():
    """scripts/dp_experiment.py as a module (it imports scripts/dp_trace.py beside it)."""
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("dp_experiment", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, policy: str, tok_s: float, *, holds: int = 0, peak: float = 1.0) -> dict:
    """One run's result with the fields the aggregation, table and warnings read."""
    latency = {"mean": 100.0, "p50": 100.0, "p90": 150.0, "p99": 150.0}
    return {"name": name, "prefill_policy": policy, "prefill_decode_interval": 0,
            "output_tokens_per_s": tok_s, "ttft_ms": latency, "mixed_step_fraction": 0.1,
            "num_tbo_steps": 0,
            "prefill_policy_stats": {"decisions_hold": holds, "decisions_allow_all": 5},
            "per_rank": [{"dp_rank": 0, "num_preemptions": 0}, {"dp_rank": 1, "num_preemptions": 0}],
            "peak_kv_usage": [peak, 0.2],
            "by_class": {"pressure": {"ttft_ms": latency}, "burst": {"ttft_ms": latency}}}


def test_repeats_give_medians_and_spread_and_warnings_say_what_a_run_did_not_exercise():
    m = _script_module()
    none = m.aggregate([_run("none", "none", t) for t in (10.0, 12.0, 30.0)])
    assert none["output_tokens_per_s"] == 12.0 and none["repeats"] == 3 and len(none["runs"]) == 3
    assert none["spread"]["output_tokens_per_s"] == [10.0, 30.0]
    idle_delayer = m.aggregate([_run("delayer", "delayer", t) for t in (11.0, 13.0, 14.0)])
    warnings = m.warnings_for([none, idle_delayer])
    assert any("the delayer never held a prefill" in w for w in warnings), warnings
    assert any("overlaps" in w for w in warnings), warnings  # 11-14 inside 10-30
    assert not any("KV-pressured" in w for w in warnings) and m.NOISE_NOTE not in warnings
    single = m.warnings_for([m.aggregate([_run("none", "none", 10.0, peak=0.5)]),
                             m.aggregate([_run("delayer", "delayer", 20.0, holds=3, peak=0.5)])])
    assert not any("never held" in w for w in single), single
    assert sum("no rank was KV-pressured" in w for w in single) == 2 and m.NOISE_NOTE in single
    table = m.details_table([none, idle_delayer])
    assert "10.0-30.0" in table and "allow_all 5" in table and "100%" in table
