"""The ``atom`` console script, run as a subprocess on the real embedded model."""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys

import pytest


ATOM = str(pathlib.Path(sys.executable).parent / "atom")
SMALL_ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "512"]
TIMEOUT_S = 300  # generous liveness deadline on a shared 2-core machine


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ATOM, *args], input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_generate_prints_text():
    proc = _run("generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                "--temperature", "0", *SMALL_ENGINE)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_bad_option_is_a_usage_error():
    proc = _run("generate", "--prompt", "x", "--dtype", "float16")
    assert proc.returncode == 2 and "dtype" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("model", ["/tmp/atom-no-such-dir/model.gguf", "HuggingFaceTB/SmolLM2"])
def test_missing_model_is_one_line(model):
    proc = _run("generate", "--prompt", "x", "--model", model)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith("atom generate: error: model ") and "not found" in proc.stderr


def test_generate_labels_several_prompts_in_order():
    proc = _run("generate", "--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
                "--max-tokens", "6", "--temperature", "0", *SMALL_ENGINE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[1/2]" and "[2/2]" in lines and "Paris" in proc.stdout


def _stream_then_interrupt(argv: list[str], stdin: bytes | None = None):
    """Start ``atom ARGV`` with SIGINT inherited as ignored (as under xdist or a background
    job), wait until it has printed something, send SIGINT; returns (process, first bytes)."""
    proc = subprocess.Popen([ATOM, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_ignore_sigint)
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
    assert ready, "no output started"
    first = os.read(proc.stdout.fileno(), 64)
    assert first
    proc.send_signal(signal.SIGINT)
    return proc, first


def test_generate_streams_and_ctrl_c_keeps_the_partial_text():
    proc, first = _stream_then_interrupt(
        ["generate", "--prompt", "Write a long story about a dragon.", "--max-tokens", "3000",
         "--ignore-eos", "--temperature", "0", "--num-kv-blocks", "200", "--max-model-len", "3200"])
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    text = first + out  # what was printed before Ctrl-C stays, and the line is ended
    assert len(text) > 1 and text.endswith(b"\n") and b"Traceback" not in err


def test_chat_two_turns_then_eof():
    proc = _run("chat", "--max-tokens", "8", "--temperature", "0", *SMALL_ENGINE,
                stdin="What is the capital of France?\nAnd of Italy?\n")
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.strip("\n").split("\n")
    assert len(replies) >= 2 and "Paris" in replies[0]
    assert "Traceback" not in proc.stderr


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_chat_ctrl_c_stops_the_reply_and_the_session_goes_on():
    # ignore_eos and a long max_tokens: without Ctrl-C the reply would run far past the
    # liveness deadline. After it, a second turn is answered; EOF then ends the session.
    proc, _ = _stream_then_interrupt(
        ["chat", "--max-tokens", "3000", "--ignore-eos", "--temperature", "0",
         "--num-kv-blocks", "200", "--max-model-len", "3200"],
        stdin=b"Write a long story about a dragon.\n")
    try:
        out = b""
        while not out.endswith(b"[stopped]\n"):  # the reply is over: back at the prompt
            ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
            assert ready, f"the reply did not stop: {out[-200:]!r}"
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, "the session ended on Ctrl-C"
            out += chunk
        # the session goes on: a second turn is answered (and stopped the same way)
        proc.stdin.write(b"Tell me more.\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
        assert ready, "no second reply"
        out += os.read(proc.stdout.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)  # EOF ends the session
    finally:
        proc.kill()
    out += rest
    assert proc.returncode == 0, err.decode()
    assert out.count(b"[stopped]") == 2 and out.endswith(b"\n") and b"Traceback" not in err


def test_bench_offline_random_workload(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("bench", "offline", "--random-input-len", "12", "--num-prompts", "3",
                "--max-tokens", "4", "--output-json", str(out), *SMALL_ENGINE)
    assert proc.returncode == 0, proc.stderr
    assert "output tokens/s" in proc.stdout and "TTFT p50/p90/p99 (ms)" in proc.stdout
    report = json.loads(out.read_text())
    (atom,) = report["results"]
    assert atom["num_requests"] == 3 and atom["num_output_tokens"] == 12
    assert atom["num_prompt_tokens"] == 36
    assert set(atom["ttft_ms"]) == {"p50", "p90", "p99"} and atom["output_tokens_per_s"] > 0


def test_bench_offline_workload_errors_are_one_line_before_the_engine_starts(tmp_path):
    missing = tmp_path / "nope.json"
    proc = _run("bench", "offline", "--dataset", str(missing), *SMALL_ENGINE)
    assert proc.returncode == 2 and f"--dataset {missing}: no such file" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run("bench", "offline", "--dataset", str(missing), "--random-input-len", "8",
                *SMALL_ENGINE)
    assert proc.returncode == 2 and "not both" in proc.stderr


def test_w1_ships_with_atom():
    from atom.benchmarks.offline import W1_DATASET

    items = json.loads(W1_DATASET.read_text())
    assert len(items) == 64 and all(112 <= len(x["ids"]) <= 144 for x in items)
