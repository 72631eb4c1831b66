"""The ``atom`` command line.

- ``atom generate --prompt TEXT [--prompt TEXT ...]``: one prompt streams its completion as it
  is generated (Ctrl-C stops it, keeping what was printed); several run as one batch and print
  in order, each under a ``[i/N]`` label (``--chat`` wraps each prompt as a user message
  through the chat template, sampled as ``atom chat`` samples). ``--prompt-token-ids 1,2,3`` (or a JSON file of ids) gives
  prompts as token ids instead; with ``--skip-tokenizer-init`` (a model folder without
  tokenizer files) the outputs print as token ids too.
- ``atom chat``: interactive; each line you type is a user turn, the reply streams as it is
  generated; Ctrl-C stops the reply (the session goes on), Ctrl-C at the prompt or EOF (Ctrl-D)
  ends the session (exit code 0). Sampling defaults to what the model's files recommend
  (``generation_config.json``, or a GGUF's ``general.sampling.*`` keys), else
  :data:`CHAT_SAMPLING_DEFAULTS`.

Errors in the options or the inputs (a model that does not exist, a bad value) are one line on
stderr and exit code 2; ``--log-level DEBUG`` shows the traceback too.
- ``atom serve``: the OpenAI-compatible server (:mod:`atom.entrypoints.openai.api_server`);
  with ``--kv-role producer|consumer`` one half of a P/D pair (:mod:`atom.core.kv_connector`).
- ``atom pd-proxy --prefill URL[,URL...] --decode URL[,URL...]``: one OpenAI endpoint over P/D
  instances (:mod:`atom.entrypoints.pd_proxy`).
- ``atom bench offline ...``: the offline throughput benchmark (:mod:`atom.benchmarks.offline`);
  ``atom bench serve ...``: the serving benchmark (:mod:`atom.benchmarks.serving`);
  ``atom bench multinode ...``: the multi-node benchmark driver (:mod:`atom.benchmarks.multinode`).
- ``atom sim run | sweep | calibrate | workload``: the DP/EP simulator (:mod:`atom.dp.sim.cli`).
- ``atom models``: the supported architectures (:data:`atom.models.MODEL_REGISTRY`) and how to
  serve a Hugging Face folder of one. An engine command given a model of another architecture
  stops in one line before it starts any process (:mod:`atom.engine.preflight`).

Every subcommand takes all engine options (``--model``, ``--dtype``, ``--max-model-len``,
``--num-kv-blocks``, ...), generated from :class:`atom.config.EngineConfig`. ``--seed`` seeds the
engine and, for ``generate`` and ``chat``, the requests, so a run is reproducible.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re
import signal
import sys
from dataclasses import fields

from atom.config import ArgumentParser, EngineConfig, HelpFormatter, add_engine_args
from atom.sampling_params import SamplingParams

_DEFAULT_MAX_TOKENS = 256
#: Chat's sampling when the model's files recommend none: the values SmolLM2's model card
#: suggests for its instruct models (at temperature 1.0 a 135M model mostly rambles).
CHAT_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


def _add_sampling_args(parser: argparse.ArgumentParser, *, chat: bool = False) -> None:
    """The sampling flags; ``--temperature`` / ``--top-p`` left unset come from the model's
    recommendation (else :data:`CHAT_SAMPLING_DEFAULTS`) in chat (``atom chat``, ``atom
    generate --chat``), else from SamplingParams' defaults."""
    defaults = SamplingParams()
    parser.add_argument("--max-tokens", type=int, default=_DEFAULT_MAX_TOKENS,
                        help="output tokens per reply at most")
    recommended = {k: f"the model's recommendation, else {v}"
                   for k, v in CHAT_SAMPLING_DEFAULTS.items()}
    if chat:
        temperature, top_p = recommended["temperature"], recommended["top_p"]
    else:
        temperature = f"{defaults.temperature}; with --chat, {recommended['temperature']}"
        top_p = f"{defaults.top_p}; with --chat, {recommended['top_p']}"
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"0 = greedy (default: {temperature})")
    parser.add_argument("--top-p", type=float, default=None,
                        help=f"nucleus sampling: keep the most likely tokens up to this "
                             f"probability mass, in (0, 1] (default: {top_p})")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (stderr)")
    add_engine_args(parser)


def request_sampling(args: argparse.Namespace, *, chat: bool) -> SamplingParams:
    """The request's sampling from the flags of ``generate`` / ``chat``; in ``chat``, the ones
    left unset from what the model recommends (:func:`_chat_sampling_defaults`), else from
    SamplingParams' defaults.

    Raises:
        FileNotFoundError: (chat) the model cannot be found.
        ValueError: a value SamplingParams refuses.
    """
    defaults = _chat_sampling_defaults(args.model) if chat else {}
    chosen = {k: getattr(args, k) for k in ("temperature", "top_p") if getattr(args, k) is not None}
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                          **{**defaults, **chosen})


def _chat_sampling_defaults(model: str | None) -> dict:
    """What the model recommends (temperature, top_p, top_k), else CHAT_SAMPLING_DEFAULTS."""
    from atom.worker.model_files import recommended_sampling

    return recommended_sampling(model) or dict(CHAT_SAMPLING_DEFAULTS)


def _make_llm(args: argparse.Namespace):
    from atom.entrypoints.llm import LLM

    return LLM(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _token_ids_arg(text: str) -> list[list[int]]:
    """``--prompt-token-ids``: comma-separated ids (one prompt), or a JSON file holding a list
    of ids (one prompt) or a list of such lists (several)."""
    if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        return [[int(t) for t in text.split(",")]]
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither comma-separated token ids (1,2,3) nor a JSON file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path} is not valid JSON ({exc})") from exc
    prompts = data if data and all(isinstance(p, list) for p in data) else [data]
    if not all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p)
               for p in prompts):
        raise argparse.ArgumentTypeError(
            f"{path} must hold a list of token ids ([1, 2, 3]) or a list of such lists")
    return prompts


def _prompts(args: argparse.Namespace) -> list[str] | list[list[int]]:
    """The prompts of ``atom generate``, checked before the engine starts.

    Raises:
        ValueError: ``--chat`` with token ids, or text prompts with ``--skip-tokenizer-init``.
    """
    if args.prompt_token_ids:
        if args.chat:
            raise ValueError("--chat wraps text in the chat template: give --prompt TEXT, not "
                             "--prompt-token-ids")
        return [ids for group in args.prompt_token_ids for ids in group]
    if args.skip_tokenizer_init:
        raise ValueError("--skip-tokenizer-init leaves no tokenizer for --prompt TEXT: give "
                         "token ids with --prompt-token-ids 1,2,3 (or a JSON file)")
    return args.prompt


def _print_dp_summary(llm) -> None:
    from atom.dp.run_summary import print_dp_summary

    print_dp_summary(llm.engine)


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    params = request_sampling(args, chat=args.chat)
    llm = _make_llm(args)
    rc = _generate(llm, args, prompts, params)
    _print_dp_summary(llm)  # errors propagate without it: they are the last line
    return rc


def _generate(llm, args: argparse.Namespace, prompts: list, params: SamplingParams) -> int:
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    has_tokenizer = llm.get_tokenizer() is not None
    if len(prompts) == 1 and has_tokenizer:
        return _stream_one(llm, prompts[0], params)
    rc = 0
    for i, out in enumerate(llm.generate(prompts, params), start=1):
        completion = out.outputs[0]
        if len(prompts) > 1:
            print(f"[{i}/{len(prompts)}]", flush=True)
        if completion.finish_reason == "error":
            print(f"atom generate: error: {completion.error}", file=sys.stderr)
            rc = 1
        elif has_tokenizer:
            print(completion.text, flush=True)
        else:  # no tokenizer: the ids, in the form --prompt-token-ids takes
            print(",".join(map(str, completion.token_ids)), flush=True)
    return rc


def _stream_one(llm, prompt: str, params: SamplingParams) -> int:
    """Print one completion as it is generated; Ctrl-C stops it (what was printed stays)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # see cmd_chat
    try:
        for piece in llm.stream(prompt, params):
            print(piece, end="", flush=True)
    except ValueError as exc:  # the prompt cannot run
        print(f"atom generate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(flush=True)
        return 130
    print(flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    # Ctrl-C must end the chat even when this process inherited SIGINT as ignored (a child of a
    # non-interactive shell's background job, or of a test runner): Python only installs its
    # KeyboardInterrupt handler at start-up when SIGINT is not ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = None
    try:
        params = request_sampling(args, chat=True)
        llm = _make_llm(args)
        conversation = [{"role": "system", "content": args.system}] if args.system else []
        prompt = "> " if sys.stdin.isatty() else ""
        while True:
            try:
                line = input(prompt)
            except EOFError:  # Ctrl-D: end the session on a fresh line
                print(flush=True)
                break
            if not line.strip():
                continue
            conversation.append({"role": "user", "content": line})
            reply = _chat_turn(llm, conversation, params)
            if reply is None:
                conversation.pop()
            else:
                conversation.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:  # Ctrl-C at the prompt ends the session, not an error
        print(flush=True)
    if llm is not None:
        _print_dp_summary(llm)
    return 0


def _chat_turn(llm, conversation: list[dict], params: SamplingParams) -> str | None:
    """Stream one reply; Ctrl-C stops the reply (what was said so far is kept). None when the
    turn cannot run (e.g. the conversation outgrew the context)."""
    reply = []
    try:
        for piece in llm.stream(llm.apply_chat_template(conversation), params):
            print(piece, end="", flush=True)
            reply.append(piece)
    except ValueError as exc:
        print(f"atom chat: error: {exc}", file=sys.stderr)
        return None
    except KeyboardInterrupt:  # the stream's generator closed: the request was aborted
        print(" [stopped]", end="")
    print(flush=True)
    return "".join(reply)


def cmd_models(args: argparse.Namespace) -> int:
    from atom.models import MODEL_REGISTRY

    width = max(len(name) for name in MODEL_REGISTRY)
    print(f"{'architecture':<{width}}  {'model file':<22}  covers")
    for name, entry in sorted(MODEL_REGISTRY.items()):
        print(f"{name:<{width}}  {'atom/models/' + entry.module + '.py':<22}  {entry.description}")
    print("\nServe a Hugging Face folder (config.json with one of these architectures, "
          "*.safetensors, tokenizer files):\n  atom serve --model /path/to/folder")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from atom.benchmarks import offline as bench

    parser = ArgumentParser(prog="atom", description=__doc__.split("\n\n")[0])
    parser.set_defaults(runs_engine=False)  # add_engine_args sets it on the engine commands
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = HelpFormatter

    gen = sub.add_parser("generate", help="generate completions for prompts", formatter_class=fmt)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    prompt.add_argument("--prompt-token-ids", action="append", type=_token_ids_arg,
                        metavar="IDS|FILE",
                        help="a prompt as token ids: 1,2,3, or a JSON file with a list of ids "
                             "or a list of such lists (repeat for a batch); outputs print as "
                             "token ids with --skip-tokenizer-init")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the chat template")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming replies", formatter_class=fmt)
    chat.add_argument("--system", help="system message of the conversation")
    _add_sampling_args(chat, chat=True)
    chat.set_defaults(func=cmd_chat)

    from atom.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub, fmt)
    from atom.entrypoints.pd_proxy import add_pd_proxy_parser

    add_pd_proxy_parser(sub, fmt)

    sub.add_parser("launch", help="start N ranks torchrun-style: atom launch --nproc-per-node N -- "
                                  "COMMAND (see `atom launch --help`)")
    bench_parser = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench_parser.add_subparsers(dest="bench", required=True)
    offline = bench_sub.add_parser("offline", help="offline throughput (scripts/bench_offline.py)",
                                   description=bench.__doc__.split("\n\n")[0], formatter_class=fmt)
    bench.add_offline_args(offline)
    offline.set_defaults(func=bench.run)
    from atom.benchmarks import serving as bench_serving

    bench_serving.add_bench_serve_parser(bench_sub, fmt)
    from atom.benchmarks import multinode

    multinode.add_bench_multinode_parser(bench_sub, fmt)

    from atom.dp.sim.cli import add_sim_parser

    add_sim_parser(sub, fmt)
    models = sub.add_parser("models", help="list the supported model architectures")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``atom`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # its own parser: everything after the options is the command
        from atom.launch.launcher import main as launch_main

        return launch_main(argv[1:], prog="atom launch")
    from atom.engine.liveness import EngineStartError
    from atom.entrypoints import launched
    from atom.launch.env import rank_env_present

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    as_rank = rank_env_present() and args.runs_engine
    try:
        if as_rank:  # under atom launch / torchrun (see atom.entrypoints.launched)
            args.data_parallel_size = launched.launched_data_parallel_size(args.data_parallel_size)
            if not launched.is_front_end():
                from atom.launch.errors import install_error_handler

                install_error_handler()  # the launcher reports this rank's traceback
                return launched.run_launched_rank(argv, EngineConfig.from_kwargs(
                    **{f.name: getattr(args, f.name) for f in fields(EngineConfig)}))
        return args.func(args)
    except (ValueError, FileNotFoundError, EngineStartError) as exc:
        # a bad option or input, or what an engine core found at start-up: one line
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"atom {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
