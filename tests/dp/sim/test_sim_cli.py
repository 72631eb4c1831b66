"""``atom sim``: run (generated and file workloads, the trace, the JSON), workload, sweep with
its plot, one-line errors; and the calibration grid's measurement on the real model runner
(two batches) with the profile it feeds."""

from __future__ import annotations

import json
import re

import pytest

from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace
from atom.dp.sim.calibrate import fit_grid, machine_info, measure_grid
from atom.dp.sim.cost_model import Coefficients, Profile, load_profile
from atom.entrypoints.cli import main

SMALL = ["--data-parallel-size", "2", "--num-kv-blocks", "32", "--max-num-seqs", "8",
         "--max-model-len", "1024", "--no-enable-prefix-caching"]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "profile.json"
    Profile(Coefficients(step_s=0.05, token_s=1e-3, dummy_s=0.01),
            model_facts={"kv_cache_bytes_per_token": 46080,
                         "max_position_embeddings": 8192}).save(path)
    return str(path)


def test_run_writes_table_json_and_trace(tmp_path, profile, capsys):
    out = tmp_path / "r.json"
    code = main(["sim", "run", *SMALL, "--prefill-policy", "delayer", "--workload",
                 "dp_experiment", "--clock", "tick", "--workload-arg", "burst_interval=8",
                 "--profile", profile, "--trace-dir", str(tmp_path / "t"), "--output-json",
                 str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "mixed-step fraction" in printed and "µs per tick" in printed
    result = json.loads(out.read_text())
    assert result["num_requests"] == 27 and result["prefill_policy"] == "delayer"
    assert len(read_trace(tmp_path / "t")[0].rows) == result["num_steps"]


def test_workload_file_round_trip_through_the_cli(tmp_path, profile, capsys):
    trace = tmp_path / "w.jsonl"
    assert main(["sim", "workload", "--workload", "kv_skewed", "--data-parallel-size", "2",
                 "--workload-arg", "num_requests=12", "--output", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 12
    out = tmp_path / "r.json"
    assert main(["sim", "run", *SMALL, "--workload", str(trace), "--profile", profile,
                 "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["num_requests"] == 12


def test_sweep_writes_json_and_png(tmp_path, profile):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["sim", "sweep", "--workloads", "bursty", "--dp-sizes", "2", "4",
                 "--policies", "none", "delayer", "--num-kv-blocks", "64", "--profile",
                 profile, "--output-json", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text())
    assert [(r["dp_size"], r["prefill_policy"]) for r in results] == [
        (2, "none"), (2, "delayer"), (4, "none"), (4, "delayer")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["sim", "run", "--workload", "nope.jsonl"], "nope.jsonl"),
    (["sim", "run", "--workload", "bursty", "--profile", "no-such-profile"], "no profile"),
    (["sim", "run", "--data-parallel-size", "8", "--moe-split-experts", "4",
      "--enable-expert-parallel"], "at least that many experts"),
    (["sim", "run", "--data-parallel-size", "2", "--routing-zipf", "1.2"],
     "set enable_expert_parallel (--enable-expert-parallel) too"),
    *[(["sim", "run", "--data-parallel-size", "2", "--enable-expert-parallel", *extra],
       "change --routing-zipf, --routing-experts, --routing-layers or --routing-top-k")
      for extra in (["--routing-zipf", "1", "--routing-top-k", "0"],
                    ["--routing-zipf", "1", "--routing-experts", "4", "--routing-top-k", "8"],
                    ["--routing-zipf", "1", "--routing-layers", "0"],
                    ["--routing-zipf", "nan"])],
])
def test_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_eplb_that_closed_no_window_says_so(profile, capsys):
    assert main(["sim", "run", *SMALL, "--workload", "bursty", "--clock", "tick",
                 "--workload-arg", "num_requests=8", "--profile", profile,
                 "--enable-expert-parallel", "--moe-split-experts", "4",
                 "--routing-zipf", "1.2", "--routing-experts", "4", "--routing-top-k", "2",
                 "--enable-eplb"]) == 0
    assert re.search(r"EPLB never acted: the run's \d+ steps ended before the first window "
                     r"closed, at step 3000", capsys.readouterr().out)


def test_calibration_grid_on_the_real_model_runner():
    grid = [{"decode": (2, 32)}, {"prefill": [(24, 0)]}, {"prefill": [(16, 0)], "tbo": True}, {}]
    measurements, facts = measure_grid(EngineConfig(dtype="float32", num_threads=1),
                                       repeats=1, grid=grid)
    assert facts == {"kv_cache_bytes_per_token": 46080, "max_position_embeddings": 8192,
                     "num_experts": None, "architecture": "LlamaForCausalLM",
                     "vocab_size": 49152}
    assert [m["point"] for m in measurements] == grid
    assert all(m["seconds"] > 0 and 0 <= m["mlp_seconds"] < m["seconds"] for m in measurements)
    assert [len(m["micro_batches"]) for m in measurements] == [1, 1, 2, 1]
    assert measurements[0]["micro_batches"][0] == {
        "num_tokens": 2, "num_seqs": 2, "num_sampled": 2, "prefill_pairs": 0.0,
        "decode_context": 64}
    coefficients, fit = fit_grid(measurements)
    assert fit["num_points"] == 4 and all(v >= 0 for v in coefficients.values())
    assert machine_info(1)["num_threads"] == 1


def test_calibrate_a_real_moe_folder_with_expert_parallelism(tmp_path, capsys):
    """`atom sim calibrate --model FOLDER --enable-expert-parallel` on a tiny Qwen3-MoE of 512
    tokens (no tokenizer files): the grid and both group replays (without, then with expert
    parallelism on 2 real ranks) draw their token ids inside the vocabulary; the facts are
    the model's (its KV bytes per token from its per-layer specs, its experts, its
    vocabulary)."""
    from tests.moe_utils import build_tiny_qwen3

    build_tiny_qwen3(tmp_path / "model")
    out = tmp_path / "profile.json"
    assert main(["sim", "calibrate", "--model", str(tmp_path / "model"), "--num-threads", "1",
                 "--enable-expert-parallel", "--repeats", "1", "--group-replays", "1",
                 "--output", str(out)]) == 0
    profile = load_profile(out)
    assert profile.model_facts == {"kv_cache_bytes_per_token": _TINY_KV_BYTES_PER_TOKEN,
                                   "max_position_embeddings": 512, "num_experts": 8,
                                   "architecture": "Qwen3MoeForCausalLM", "vocab_size": 512}
    assert {"grid", "group", "group_ep"} <= set(profile.fit)
    assert "group_ep fit:" in capsys.readouterr().out


# 3 layers x (K, V) x 2 KV heads x head_dim 24 x 4 bytes
_TINY_KV_BYTES_PER_TOKEN = 3 * 2 * 2 * 24 * 4


def _check_calibration_of_a_tiny_moe(folder, architecture: str, *,
                                     kv_bytes_per_token: int = _TINY_KV_BYTES_PER_TOKEN,
                                     **more_facts) -> None:
    """A decode point and a TBO prefill point measured on the tiny MoE in ``folder`` (3 layers,
    8 experts, 2048 positions); its facts are the model's (``kv_bytes_per_token``: by default
    2 KV heads of 24 in each layer)."""
    grid = [{"decode": (2, 32)}, {"prefill": [(16, 0)], "tbo": True}]
    measurements, facts = measure_grid(EngineConfig(model=str(folder), dtype="float32",
                                                    num_threads=1), repeats=1, grid=grid)
    assert facts == {"kv_cache_bytes_per_token": kv_bytes_per_token,
                     "max_position_embeddings": 2048, "num_experts": 8,
                     "architecture": architecture, "vocab_size": 20000, **more_facts}
    assert [len(m["micro_batches"]) for m in measurements] == [1, 2]


def test_calibration_grid_on_a_gpt_oss_folder(tmp_path):
    """`atom sim calibrate --model FOLDER` on gpt-oss: two KV cache groups (the full layer, the
    two windowed ones) sharing cache tensors, so a block id's bytes per token are the larger
    group's two layers and the facts name the groups' windows for the simulator's pools; its
    experts are counted; a TBO point runs."""
    from tests.moe_utils import build_tiny_gpt_oss

    build_tiny_gpt_oss(tmp_path, vocab_size=20000, max_position_embeddings=2048)
    _check_calibration_of_a_tiny_moe(tmp_path, "GptOssForCausalLM",
                                     kv_bytes_per_token=2 * 2 * 2 * 24 * 4,
                                     kv_cache_group_windows=[None, 8])


def test_calibration_grid_on_a_deepseek_v3_folder(tmp_path):
    """`atom sim calibrate --model FOLDER` on DeepSeek-V3: the KV bytes per token are MLA's
    latent (kv_lora_rank 32 + rope 8 values per layer, no K and V per head), so the simulator
    sizes its pools in latent bytes; a TBO point runs through the shared experts."""
    from tests.moe_utils import build_tiny_deepseek

    build_tiny_deepseek(tmp_path, vocab_size=20000, max_position_embeddings=2048)
    _check_calibration_of_a_tiny_moe(tmp_path, "DeepseekV3ForCausalLM",
                                     kv_bytes_per_token=3 * (32 + 8) * 4)


def test_run_says_what_it_ran_and_notes_an_overloaded_run(profile, capsys):
    argv = ["sim", "run", *SMALL, "--profile", profile, "--workload", "bursty"]
    assert main([*argv, "--workload-arg", "num_requests=24", "--workload-arg", "burst_size=8",
                 "--workload-arg", "burst_interval=0.5"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("workload bursty (num_requests=24, burst_size=8, "
                               "burst_interval=0.5): 24 requests arriving over ")
    assert "deployment: DP 2, prefill policy delayer, EP off, TBO off, 32 KV blocks a rank; " \
           "profile" in " ".join(printed.split())
    # one figure for the overload: the header's two rates and their ratio in the note
    joined = " ".join(printed.split())
    rate, served = map(float, re.search(r"\(([\d.]+)/s\), served at ([\d.]+)/s", joined).groups())
    pace = re.search(r"overloaded: requests arrived ([\d.]+)x as fast as this deployment "
                     r"served them \(([\d.]+)/s against ([\d.]+)/s\)", joined)
    assert pace is not None, printed
    assert (float(pace[2]), float(pace[3])) == (rate, served)
    assert float(pace[1]) == pytest.approx(rate / served, rel=0.05)  # of the rounded rates
    ttft = next(line for line in lines if line.startswith("| TTFT mean / p90"))
    assert re.fullmatch(r"\| TTFT mean / p90 +\| +\d+\.\d s / \d+\.\d s \|", ttft), ttft
    assert "tok/s vs" not in printed  # one run: no ratio to itself
    assert main([*argv, "--workload-arg", "num_requests=24", "--workload-arg", "burst_size=4",
                 "--workload-arg", "burst_interval=20"]) == 0  # 4 a burst, 20 s apart: in time
    printed = capsys.readouterr().out
    assert "overloaded" not in printed and " ms / " in printed
    assert all(len(line) <= 100 for line in printed.splitlines() if not line.startswith("|"))


def test_sweep_prints_one_table_per_workload_within_120_columns(tmp_path, profile, capsys):
    assert main(["sim", "sweep", "--workloads", "sessions", "bursty", "--dp-sizes", "2", "10",
                 "--policies", "none", "coalescer", "--num-kv-blocks", "32",
                 "--profile", profile, "--output-json", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= 120
    tables = [block for block in printed.split("\n\n") if "| DP |" in block]
    assert [t.splitlines()[0].split(" (")[0] for t in tables] == ["workload sessions",
                                                                  "workload bursty"]
    for table in tables:
        rows = [line for line in table.splitlines() if re.match(r"\| +\d+ \|", line)]
        assert len(rows) == 4
        # each ratio compares policies of one workload at one DP size: the first is 1.00x
        assert [row.split("|")[4].strip() for row in rows][::2] == ["1.00x", "1.00x"]
    assert "tok/s vs" not in printed  # no ratio row across workloads


def test_an_unknown_workload_lists_the_generators(capsys):
    assert main(["sim", "run", "--workload", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err == ("atom sim: error: unknown workload 'nosuch': use one of ['bursty', "
                   "'dp_experiment', 'kv_skewed', 'sessions'] or a workload file\n")


def test_latencies_print_in_seconds_from_10_s():
    from atom.dp.sim.metrics import format_ms

    assert [format_ms(v) for v in (0.4, 781.2, 9999.0, 10_000.0, 134_086.0)] == [
        "0 ms", "781 ms", "9999 ms", "10.0 s", "134.1 s"]


def test_sim_accuracy_configurations_are_shell_words():
    """``scripts/sim_accuracy.py --configs`` takes its choices as typed, one word each."""
    import importlib.util
    import pathlib
    import shlex

    path = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "sim_accuracy.py"
    spec = importlib.util.spec_from_file_location("sim_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert all(shlex.split(name) == [name] for name in module.CONFIGS), list(module.CONFIGS)
    args = module.parse_args(["--configs", "ep-delayer", "dense-none"])
    assert args.configs == ["ep-delayer", "dense-none"]
