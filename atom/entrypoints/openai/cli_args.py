"""The ``atom serve`` subcommand's flags (kept free of FastAPI imports so ``atom --help`` and the
other subcommands stay fast)."""

from __future__ import annotations

import argparse

from atom.config import add_engine_args
from atom.entrypoints.openai.tool_parsers import TOOL_PARSERS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_PORT = 65535


def tcp_port(text: str) -> int:
    """``--port``'s type: a TCP port, 1 to 65535 (argparse's one-line error otherwise)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: use 1 to {MAX_PORT}")
    return port


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags plus every engine option."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=tcp_port, default=8000, help="TCP port to bind")
    parser.add_argument("--served-model-name",
                        help=f"model name in the API (default: --model, or {DEFAULT_MODEL_NAME})")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests before aborting them")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (stderr)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice='auto' (the default with tools): the model calls "
                             "tools in its own syntax, which --tool-call-parser reads")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                        help="the model family's tool-call syntax (hermes: Qwen2.5, Qwen3, "
                             "Hermes); needs --enable-auto-tool-choice")
    add_engine_args(parser)


def add_serve_parser(subparsers, formatter_class=argparse.ArgumentDefaultsHelpFormatter) -> None:
    """Register ``serve`` on the ``atom`` command's subparsers."""
    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", formatter_class=formatter_class,
        description="The OpenAI API (completions, chat completions, models) over HTTP. As in "
                    "vLLM, a request without max_tokens generates until EOS, a stop, or the "
                    "model's context (--max-model-len): send max_tokens to bound it.")
    add_serve_args(serve)
    serve.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from atom.entrypoints.openai.api_server import run_server

    return run_server(args)
