"""``atom serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (behind
``--api-key`` when given: ``Authorization: Bearer KEY``), and ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, and with
``--record-expert-load`` or ``--enable-eplb`` ``GET /expert_load`` (:func:`_expert_load`).

Errors, in one place (:func:`_install_error_handlers`): bad input is a 400 and an unknown model a
404, both with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``; a missing or
wrong API key is a 401; a dead engine is a 503. Bad input never reaches the engine.

An ``X-Session-ID`` header names the conversation a request belongs to; the DP router keeps a
session on one rank (``--dp-load-balance cache_aware``). vLLM's ``X-data-parallel-rank`` header
runs the request on that DP rank, bypassing the router (a value that is not a rank: 400).

A client that disconnects aborts its request (streaming: the response task is cancelled;
non-streaming: a watcher on the connection cancels the handler), so its KV blocks are freed
within a step. ``/health`` answers at once from what the front end already knows, never waiting
on the engine thread: 503 once an engine core has exited, when a rank has sent no heartbeat for
``--engine-hang-timeout-s`` (stopped or frozen; the engine thread then replaces or fails it),
and while the engine recovers from a rank failure (its JSON body says which rank failed and
why, and the membership: generation, DP size, ranks with their heartbeat ages).

Once it listens, the server prints where on stderr (``serving on http://127.0.0.1:8000 (model
NAME, DP 2, EP on)``). SIGTERM (or Ctrl-C) drains: uvicorn stops accepting connections and
waits up to ``--drain-timeout`` seconds for in-flight responses, then cancels the rest (which
aborts their requests); then, with several DP ranks, one line on stderr says what they did
(:func:`atom.dp.run_summary.print_dp_summary`), the engine cores shut down and the process
exits 0. Under ``atom launch`` the launcher's own stop (a rank failed, Ctrl-C) stops every
rank at once, so nothing could drain: rank 0 tells the front end
(:data:`atom.engine.core_proc.RANKS_STOPPING_SIGNAL`)
and its open streams end at once with an error event and ``[DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.metadata
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.engine.llm_engine import DEAD, SERVING, LLMEngine
from atom.engine.core_client import EngineDeadError
from atom.engine.core_proc import RANKS_STOPPING_SIGNAL, dump_stacks_if_still_running
from atom.entrypoints.launched import is_front_end
from atom.entrypoints.openai import protocol as p
from atom.entrypoints.openai.async_engine import AsyncEngine
from atom.entrypoints.openai.cli_args import DEFAULT_MODEL_NAME
from atom.entrypoints.openai.tool_parsers import TOOL_PARSERS
from atom.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from atom.entrypoints.openai.serving import APIError, OpenAIServing, sse, sse_json
from atom.entrypoints.openai.serving_chat import create_chat_completion
from atom.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger(__name__)

# why the open requests of a launched front end failed when it got SIGTERM
LAUNCHER_STOPPING = ("the launcher is stopping every rank (a rank failed, or the launcher was "
                     "told to stop): its report on stderr says which and why")
_METRICS_TIMEOUT_S = 10.0  # a round trip through every engine core (stats, expert load) in this


def _health(engine: AsyncEngine) -> tuple[bool, dict]:
    """``/health``'s answer from what this process knows now (the engine thread's status, the
    ranks' processes, their heartbeats), read from this thread (the membership is a snapshot,
    the process check a poll): no call waits on the engine thread, which may be in a step that
    waits on a stopped rank until its hang timeout."""
    status = engine.status
    body = {"status": status.state, "message": status.message, "front_end_pid": os.getpid(),
            **status.membership}
    if status.state != SERVING:
        return False, body
    llm = engine.engine
    body.update(llm.membership())
    if not llm.client_is_alive():
        body["status"] = DEAD
        body["message"] = "an engine core exited; the engine thread is handling it"
        return False, body
    timeout_s = llm.config.engine_hang_timeout_s
    silent = [r for r in body.get("ranks", []) if r["heartbeat_age_s"] >= timeout_s]
    if silent:
        body["status"] = "unresponsive"
        body["message"] = "; ".join(
            f"dp rank {r['dp_rank']} sent no heartbeat for {r['heartbeat_age_s']:.1f} s "
            f"(engine_hang_timeout_s={timeout_s:g}): stopped or frozen" for r in silent)
        return False, body
    return True, body


def _expert_load(engine: LLMEngine) -> dict[str, Any]:
    """``GET /expert_load``'s body, read on the engine thread: the last closed window's tokens
    routed to each logical expert, summed over the DP ranks (``logical_count``, ``[MoE layers,
    experts]``, zeros before the first window; SGLang's recorder's name), the current placement
    (``physical_to_logical_map``, ``[MoE layers, slots]``: the logical expert of each slot, rank
    ``r`` owning the ``r``-th run of ``slots / DP size``; vLLM's name), the window's
    ``balancedness`` (None before the first), the windows closed (``num_windows``), the group's
    step count and the window's settings (steps)."""
    load, placement = engine.get_expert_load(), engine.get_expert_placement()
    stats = engine.get_rank_stats()[0]  # the window's figures are the group's, on every rank
    config = engine.config
    return {"object": "expert_load", "num_layers": int(load.shape[0]),
            "num_experts": int(load.shape[1]), "num_slots": int(placement.shape[1]),
            "step": stats.get("eplb_step"), "num_windows": stats.get("eplb_num_windows"),
            "window_size": config.eplb_window_size, "step_interval": config.eplb_step_interval,
            "balancedness": stats.get("eplb_balancedness"), "logical_count": load.tolist(),
            "physical_to_logical_map": placement.tolist()}


def build_app(serving: OpenAIServing, metrics: ServerMetrics, *, api_key: str | None) -> FastAPI:
    """The FastAPI app over a running engine (``serving.engine``)."""
    app = FastAPI(title="atom", version=_version())
    _install_error_handlers(app)
    engine = serving.engine
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

    @v1.post("/completions")
    async def completions(req: p.CompletionRequest, request: Request):
        routing = serving.routing(req, request.headers)
        return await respond(request, create_completion(serving, req, routing=routing))

    @v1.post("/chat/completions")
    async def chat_completions(req: p.ChatCompletionRequest, request: Request):
        routing = serving.routing(req, request.headers)
        return await respond(request, create_chat_completion(serving, req, routing=routing))

    @v1.get("/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=serving.model_name,
                                             max_model_len=serving.max_model_len)])

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        """200 while serving: every core process runs and beat within
        ``--engine-hang-timeout-s``; the body is the group's membership and this process's pid
        (``front_end_pid``: the process to SIGTERM for a drain, also under ``atom launch``).
        503 otherwise: recovering from a rank failure, dead, or unresponsive; ``message`` says
        which rank and why. Answers at once (:func:`_health`)."""
        alive, body = _health(engine)
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            rank_stats, front_end_stats = await engine.call(
                lambda e: (e.get_rank_stats(), e.front_end_stats()), timeout_s=_METRICS_TIMEOUT_S)
        except (EngineDeadError, TimeoutError):
            rank_stats, front_end_stats = [], {}
        return Response(metrics.render(rank_stats, front_end_stats), media_type=CONTENT_TYPE)

    @app.get("/expert_load")
    async def expert_load() -> dict[str, Any]:
        """The experts' routed tokens of the last window (:func:`_expert_load`); 400 unless
        the server records them."""
        if not engine.engine.config.resolved_record_expert_load():
            raise APIError("this server does not record the expert load: start it with "
                           "--record-expert-load (or --enable-eplb), with "
                           "--enable-expert-parallel and --data-parallel-size > 1",
                           code="expert_load_off")
        return await engine.call(_expert_load, timeout_s=_METRICS_TIMEOUT_S)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = serving.chat_prompt(req.messages,
                                      add_generation_prompt=req.add_generation_prompt).token_ids
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest) -> dict[str, str]:
        serving.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < serving.vocab_size]
        if bad:
            raise APIError(f"token ids {bad[:5]} are outside the vocabulary [0, {serving.vocab_size})",
                           param="tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    return app


def _version() -> str:
    return importlib.metadata.version("atom")


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect API key provided: pass 'Authorization: Bearer KEY'",
                           status=401, code="invalid_api_key")
    return check


# ----- responses, disconnects -----


async def respond(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` (a response model, or an SSE iterator for ``stream``), cancelling it if
    the client disconnects first (which aborts its engine requests). A stream is started here
    up to its first event, so an error the engine reports at once is still a 400. The
    generation routes of this server and of the P/D proxy (:mod:`atom.entrypoints.pd_proxy`)
    answer through it."""
    async def run() -> Any:
        result = await work
        if not isinstance(result, AsyncIterator):
            return result
        first = await anext(result)
        return StreamingResponse(_stream_events(first, result), media_type="text/event-stream")

    handler = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()  # the client left (or this task was cancelled): abort
    if not handler.done() or handler.cancelled():  # a cancel lands at the handler's next await
        return Response(status_code=499)  # nobody reads this
    return handler.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream_events(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE events; an error after the stream started becomes an error event."""
    yield first
    try:
        async for event in rest:
            yield event
    except (APIError, EngineDeadError) as exc:  # the 200 is out: say it in the stream
        yield sse_json(_error_body(exc)[1])
        yield sse("[DONE]")


def _error_body(exc: Exception) -> tuple[int, dict]:
    if isinstance(exc, APIError):
        info = p.ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
        return exc.status, p.ErrorResponse(error=info).model_dump()
    if isinstance(exc, EngineDeadError):
        info = p.ErrorInfo(message=f"the engine is not running: {exc}", type="server_error",
                           code="engine_dead")
        return 503, p.ErrorResponse(error=info).model_dump()
    info = p.ErrorInfo(message=f"internal server error: {type(exc).__name__}", type="server_error")
    return 500, p.ErrorResponse(error=info).model_dump()


def _install_error_handlers(app: FastAPI) -> None:
    """Every error the server returns goes through here, as OpenAI error JSON."""

    @app.exception_handler(APIError)
    @app.exception_handler(EngineDeadError)
    async def known_error(request: Request, exc: Exception) -> JSONResponse:
        status, body = _error_body(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # loc is ("body", offset): not a field
            message = (f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')}"
                       f" at offset {first.get('loc', ('', '?'))[-1]}): send a JSON object")
            return JSONResponse(p.ErrorResponse(error=p.ErrorInfo(
                message=message, type="invalid_request_error")).model_dump(), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None  # the request field (deeper parts are pydantic's)
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(p.ErrorResponse(error=p.ErrorInfo(
            message=message, type="invalid_request_error", param=param)).model_dump(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(p.ErrorResponse(error=p.ErrorInfo(
            message=str(exc.detail), type="invalid_request_error")).model_dump(),
            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        status, body = _error_body(exc)
        return JSONResponse(body, status_code=status)


# ----- the process -----


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, serve until SIGTERM / Ctrl-C, drain, shut the engine down; returns 0.

    Raises:
        ValueError: bad engine options, or ``--skip-tokenizer-init`` (the API needs text).
        RuntimeError: an engine core failed to start.
    """
    from atom.config import config_from_args
    from atom.dp.run_summary import print_dp_summary
    from atom.entrypoints.llm import build_engine

    config = config_from_args(args)
    if config.skip_tokenizer_init:
        raise ValueError("atom serve needs the tokenizer: drop --skip-tokenizer-init")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together (vLLM's "
                         "flags): name the model's parser, e.g. --tool-call-parser hermes")
    listener = bind_listener(args.host, args.port)  # before the engine: a busy port fails fast
    model_name = args.served_model_name or config.model or DEFAULT_MODEL_NAME
    metrics = ServerMetrics(model_name, prefill_policy=config.resolved_prefill_policy())
    try:
        engine = build_engine(config)
    except BaseException:
        listener.close()
        raise
    async_engine = AsyncEngine(engine, on_finished=metrics.record_finished)
    try:
        serving = OpenAIServing(async_engine, engine.tokenizer, model_name=model_name,
                                max_model_len=engine.runtime.max_model_len,
                                vocab_size=engine.runtime.vocab_size,
                                tool_parser=(None if args.tool_call_parser is None
                                             else TOOL_PARSERS[args.tool_call_parser]()))
        app = build_app(serving, metrics, api_key=args.api_key)
        banner = (f"serving on {url_of(args.host, args.port)} (model {model_name}, DP "
                  f"{config.data_parallel_size}, EP "
                  f"{'on' if config.enable_expert_parallel else 'off'})")
        # the launcher is stopping every rank (a rank failed, or it was told to stop): nothing
        # can finish, so open streams end at once with an error event and [DONE], not with a
        # connection cut when the launcher's grace period runs out
        on_ranks_stopping = (partial(async_engine.fail_open_requests, LAUNCHER_STOPPING)
                             if is_front_end() else None)
        server = AnnouncingServer(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(),
            access_log=args.access_log, timeout_graceful_shutdown=args.drain_timeout),
            banner=banner, on_ranks_stopping=on_ranks_stopping)
        # uvicorn re-raises every signal it caught once it has drained (a launched front end
        # may get SIGTERM twice: from the launcher and from rank 0); with this handler a
        # re-raise only logs, once, so a drained server exits 0 instead of dying by it
        drained: set[int] = set()

        def on_drained(signum: int, frame: Any) -> None:
            if not drained:
                logger.info("drained after %s; shutting the engine down",
                            signal.Signals(signum).name)
            drained.add(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_drained)
        server.run(sockets=[listener])
        dump_stacks_if_still_running()
        async_engine.stop()
        print_dp_summary(engine)  # the engine thread has ended: this thread may use it
    finally:
        async_engine.shutdown()
        listener.close()
    return 0


def url_of(host: str, port: int) -> str:
    """The http URL of ``host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints ``banner`` on stderr once it listens (uvicorn itself says
    nothing when it is handed a bound socket, as ``atom serve`` does). In the front end of a
    launched deployment it calls ``on_ranks_stopping`` on the event loop when rank 0 sends
    :data:`RANKS_STOPPING_SIGNAL`."""

    def __init__(self, config: uvicorn.Config, *, banner: str,
                 on_ranks_stopping: Callable[[], None] | None = None):
        super().__init__(config)
        self.banner = banner
        self.on_ranks_stopping = on_ranks_stopping

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_ranks_stopping is not None:
            asyncio.get_running_loop().add_signal_handler(RANKS_STOPPING_SIGNAL,
                                                          self.on_ranks_stopping)

        await super().startup(sockets=sockets)
        if self.started:
            print(self.banner, file=sys.stderr, flush=True)


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the engine loads (uvicorn serves on it).

    Raises:
        ValueError: the address cannot be bound (the port is in use, or the host is not an
            address of this machine); the message says which flag to change.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"--host {host}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use: stop what holds it or "
                             f"pick another --port") from exc
        raise ValueError(f"cannot bind {host}:{port} ({exc}): check --host and --port") from exc
    return sock

