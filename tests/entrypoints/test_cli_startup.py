"""What a newcomer's first commands print (issue 38): start-up failures in one line (the
front end's pre-flight and what an engine core finds), token-id prompts for folders without a
tokenizer, one-line usage errors, help without docstring markup. ``atom`` run as a subprocess
on tiny random Llama folders saved by transformers."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

import pytest
from safetensors.numpy import load_file, save_file

from atom.entrypoints.cli import build_parser, main, request_sampling
from atom.launch.launcher import build_parser as build_launch_parser
from tests.utils import TINY_VOCAB_SIZE, save_tiny_llama

ATOM = str(pathlib.Path(sys.executable).parent / "atom")
TINY_ENGINE = ["--dtype", "float32", "--num-kv-blocks", "16", "--num-threads", "1"]
TIMEOUT_S = 300  # generous liveness deadline on a shared 2-core machine


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ATOM, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def _one_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(prefix) and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr.strip()


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """``atom ARGV`` in this process (what fails here fails before any engine starts)."""
    capsys.readouterr()  # what came before (transformers' progress bars) is not ours
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-tokenizer")
    save_tiny_llama(folder, tokenizer=False)
    return folder


def test_a_damaged_weights_file_fails_in_one_line_before_any_process(tmp_path, capsys):
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    code, err = _main(["generate", "--model", str(tmp_path), "--prompt", "w5"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"atom generate: error: cannot read the weights file "
                          f"{tmp_path / 'model.safetensors'} ")


def test_what_only_the_core_finds_comes_back_in_one_line(tmp_path):
    save_tiny_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.norm.weight"]  # a readable file that does not fit the model
    save_file(tensors, str(weights), metadata={"format": "pt"})
    argv = ["generate", "--model", str(tmp_path), "--prompt", "w5", *TINY_ENGINE]
    line = _one_line(_run(*argv), "atom generate: error: the engine core failed to start: ")
    assert line.endswith("missing weights: ['norm.weight']")
    # the traceback under --log-level DEBUG: tests/engine/test_engine_core.py


def test_expert_options_a_dense_config_cannot_take_fail_before_any_process(no_tokenizer, capsys):
    argv = ["generate", "--model", str(no_tokenizer), "--skip-tokenizer-init",
            "--prompt-token-ids", "1,2", "--data-parallel-size", "2", "--enable-expert-parallel"]
    code, err = _main(argv, capsys)  # in this process: nothing started, nothing loaded
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"atom generate: error: --enable-expert-parallel needs an MoE model "
                          f"and {no_tokenizer} is dense: ")


def test_no_tokenizer_names_the_folder_and_the_fix(no_tokenizer, capsys):
    code, err = _main(["generate", "--model", str(no_tokenizer), "--prompt", "w5"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"atom generate: error: no tokenizer files in {no_tokenizer}: ")
    assert "--skip-tokenizer-init" in err and "--prompt-token-ids" in err
    code, err = _main(["generate", "--model", str(no_tokenizer), "--skip-tokenizer-init",
                       "--prompt", "w5"], capsys)
    assert code == 2 and err.startswith("atom generate: error: --skip-tokenizer-init leaves "
                                        "no tokenizer for --prompt TEXT: give token ids")


def test_token_id_prompts_from_the_command_line_and_a_file(no_tokenizer, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[7, 8, 9, 10], [5, 6, 7]]))
    proc = _run("generate", "--model", str(no_tokenizer), "--skip-tokenizer-init",
                "--prompt-token-ids", "5,6,7", "--prompt-token-ids", str(prompts),
                "--max-tokens", "5", "--ignore-eos", "--temperature", "0", *TINY_ENGINE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0::2] == ["[1/3]", "[2/3]", "[3/3]"]
    outputs = [[int(t) for t in line.split(",")] for line in lines[1::2]]
    assert all(len(ids) == 5 and all(0 <= t < TINY_VOCAB_SIZE for t in ids) for ids in outputs)
    assert outputs[0] == outputs[2]  # the same prompt, greedy: the same tokens


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--max-tokens", "many"],
     "argument --max-tokens: invalid int value: 'many'"),
    (["generate", "--prompt-token-ids", "1,two"],
     "argument --prompt-token-ids: '1,two' is neither comma-separated token ids"),
    (["generate"], "one of the arguments --prompt --prompt-token-ids is required"),
    (["generate", "--chat", "--prompt-token-ids", "1,2"], "--chat wraps text"),
    (["launch", "--nproc-per-node", "two", "generate"],
     "argument --nproc-per-node/--nproc_per_node: invalid int value: 'two'"),
    (["serve", "-dp", "2"], "-dp is vLLM's option: atom spells it --data-parallel-size N"),
])
def test_usage_errors_are_one_line(argv, message, capsys):
    code, err = _main(argv, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"atom {argv[0]}: error: ") and message in err


def _parsers():
    """``atom``'s parser and every subcommand's, with ``atom launch``'s (a parser of its own)."""
    stack, found = [build_parser()], [build_launch_parser("atom launch")]
    while stack:
        parser = stack.pop()
        found.append(parser)
        for action in parser._actions:  # argparse keeps its subparsers here
            if isinstance(action, argparse._SubParsersAction):
                stack += list(dict.fromkeys(action.choices.values()))
    return found


def test_help_shows_plain_text_and_each_default_once():
    parsers = _parsers()
    assert len(parsers) >= 14  # atom, generate, chat, serve, pd-proxy, bench x3, sim x5, launch
    for parser in parsers:
        text = parser.format_help()
        assert "`" not in text and ":class:" not in text, text
        flat = " ".join(text.split())
        assert not re.search(r"\(default: [^)]*\) \(default:", flat), flat


def test_generate_chat_samples_as_atom_chat():
    """The README's ``atom generate --chat ... --seed 1``: the model's recommendation (the
    embedded GGUF has none: chat's 0.2 / 0.9), not SamplingParams' 1.0, unless the flags say."""
    parser = build_parser()
    chat = parser.parse_args(["generate", "--chat", "--prompt", "Hi", "--seed", "1"])
    assert (request_sampling(chat, chat=chat.chat).temperature,
            request_sampling(chat, chat=chat.chat).top_p) == (0.2, 0.9)
    plain = parser.parse_args(["generate", "--prompt", "Hi"])
    assert request_sampling(plain, chat=plain.chat).temperature == 1.0
    chosen = parser.parse_args(["generate", "--chat", "--prompt", "Hi", "--temperature", "0.7"])
    assert request_sampling(chosen, chat=chosen.chat).temperature == 0.7
