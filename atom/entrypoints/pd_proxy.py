"""``atom pd-proxy``: one OpenAI-compatible endpoint in front of P/D instances.

    atom pd-proxy --prefill http://p0:8100[,http://p1:8100] --decode http://d0:8200[,...]

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes twice (vLLM's disaggregated
prefill proxy shape):

1. to a prefill instance (``atom serve --kv-role producer``, round robin), non-streaming, with
   ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``: it prefills, samples
   the first token and keeps the prompt's KV blocks; its response carries the
   ``kv_transfer_params`` a consumer needs (producer address, block ids, first token);
2. to a decode instance (``atom serve --kv-role consumer``, round robin) with the original
   body (streamed or not) plus those params: it pulls the KV, emits the first token and
   decodes on. Its response is what the client gets, unchanged: one normal response.

A request whose ``max_tokens`` is 1 goes to a prefill instance alone, as a plain request; a
prefill that ends before a decode could start (its first token was EOS or a stop token, so no
params came back) is sent to a decode instance as a plain request (it prefills there). Requests
P/D cannot carry (``n > 1``, several prompts, ``logprobs``, ``echo``) get a 400.

A client that disconnects cancels the request being forwarded: the instance it was on sees the
disconnect and aborts it (a consumer mid-pull frees its blocks and tells the producer, which
frees its own); the producer frees blocks nobody pulled after its keep timeout.
"""


import argparse
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from atom.entrypoints.openai.cli_args import tcp_port

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "x-session-id")


def _error(message: str, status: int = 400, *, type: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": None}},
                        status_code=status)


def unsupported(path: str, body: dict) -> str | None:
    """Why ``body`` cannot go through P/D, or None."""
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:  # a bad n: the instance's 400
        return "n > 1 is not supported through atom pd-proxy: send n=1"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        return "logprobs and echo are not supported through atom pd-proxy"
    prompt = body.get("prompt")
    if path.endswith("/completions") and not path.endswith("chat/completions") and isinstance(
            prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            return "send one prompt per request through atom pd-proxy"
    return None


def build_app(prefill_urls: list[str], decode_urls: list[str], *, timeout_s: float = 600.0):
    """The proxy's FastAPI app (round robin over each side's URLs)."""
    import httpx
    from contextlib import asynccontextmanager
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    from atom.entrypoints.openai.api_server import respond

    state: dict[str, Any] = {}
    prefill, decode = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)

    @asynccontextmanager
    async def lifespan(app):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        yield
        await state["client"].aclose()

    app = FastAPI(title="atom pd-proxy", lifespan=lifespan)

    async def forward(url: str, body: dict, headers: dict) -> Any:
        """POST ``body`` to ``url``: a Response, or (streaming 200) an iterator of SSE text."""
        client: httpx.AsyncClient = state["client"]
        try:
            resp = await client.send(client.build_request("POST", url, json=body, headers=headers),
                                     stream=True)
        except httpx.TransportError as exc:
            return _error(f"{url} is unreachable: {exc}", 502, type="server_error")
        if not body.get("stream") or resp.status_code != 200:
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        return _relay(resp)

    async def handle(path: str, request: Request) -> Any:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return _error(f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error("send a JSON object")
        reason = unsupported(path, body)
        if reason is not None:
            return _error(reason)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None and not path.endswith("chat/completions"):
            max_tokens = 16  # the completions default
        if max_tokens == 1:
            return await forward(next(prefill) + path, body, headers)
        prefill_body = {**body, "stream": False, "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True}}
        for key in ("stream_options", "max_completion_tokens"):
            prefill_body.pop(key, None)
        first = await forward(next(prefill) + path, prefill_body, headers)
        if first.status_code != 200:
            return first
        params = json.loads(first.body).get("kv_transfer_params")
        decode_body = dict(body) if params is None else {**body, "kv_transfer_params": params}
        return await forward(next(decode) + path, decode_body, headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, handle("/v1/completions", request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, handle("/v1/chat/completions", request))

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        resp = await state["client"].get(decode_urls[0] + "/v1/models", headers=headers)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    @app.get("/health")
    async def health():
        """200 when every instance answers its /health with 200; the body lists them."""
        result = {}
        for url in prefill_urls + decode_urls:
            try:
                result[url] = (await state["client"].get(url + "/health", timeout=10.0)).status_code
            except httpx.TransportError:
                result[url] = None
        ok = all(code == 200 for code in result.values())
        return JSONResponse({"instances": result}, status_code=200 if ok else 503)

    return app


async def _relay(resp) -> AsyncIterator[str]:
    """A decode instance's SSE stream, whole events as they come; closing it closes the upstream
    request.

    Raises:
        APIError: (502) the instance's connection broke mid-stream (it died): the events relayed
            so far stand, the partial one is dropped, and the client's stream ends with an
            error event (:func:`atom.entrypoints.openai.api_server.respond`).
    """
    import httpx

    from atom.entrypoints.openai.serving import APIError

    pending = ""  # the text after the last whole event
    try:
        async for text in resp.aiter_text():
            events, sep, pending = (pending + text).rpartition("\n\n")
            if sep:
                yield events + sep
        if pending:
            yield pending
    except httpx.TransportError as exc:
        raise APIError(f"the decode instance {resp.request.url} failed mid-stream: {exc}",
                       status=502, type="server_error") from exc
    finally:
        await resp.aclose()


def _urls(value: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("give at least one URL")
    return urls


def add_pd_proxy_parser(subparsers, formatter_class=argparse.ArgumentDefaultsHelpFormatter) -> None:
    """Register ``pd-proxy`` on the ``atom`` command's subparsers."""
    parser = subparsers.add_parser("pd-proxy", help="OpenAI-compatible proxy over prefill and "
                                   "decode instances (P/D disaggregation)",
                                   formatter_class=formatter_class,
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=_urls, required=True,
                        help="prefill instances (atom serve --kv-role producer), comma-separated")
    parser.add_argument("--decode", type=_urls, required=True,
                        help="decode instances (atom serve --kv-role consumer), comma-separated")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=tcp_port, default=8000, help="TCP port to bind")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a forwarded request may take")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (stderr)")
    parser.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C; returns 0.

    Raises:
        ValueError: the address cannot be bound.
    """
    import uvicorn

    from atom.entrypoints.openai.api_server import AnnouncingServer, bind_listener, url_of

    listener = bind_listener(args.host, args.port)
    app = build_app(args.prefill, args.decode, timeout_s=args.timeout)
    banner = (f"serving on {url_of(args.host, args.port)} (P/D proxy over "
              f"{len(args.prefill)} prefill and {len(args.decode)} decode instance(s))")
    server = AnnouncingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                             log_level=args.log_level.lower(),
                                             access_log=False), banner=banner)
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
    return 0
