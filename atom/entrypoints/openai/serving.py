"""The generation endpoints: OpenAI request → token ids + SamplingParams → engine → response.

One path serves ``/v1/completions`` and ``/v1/chat/completions``: every prompt of a request
becomes one engine request (``n`` choices each, numbered ``prompt_index * n + choice``); their
outputs are merged into one stream of per-choice deltas (:meth:`OpenAIServing.deltas`), which the
endpoint formats as SSE chunks or collects into one response.

Streaming rules: a choice's text only ever grows (the output side holds back a possible
stop-string prefix and never splits a UTF-8 character); each choice gets exactly one chunk with
its ``finish_reason``; with ``stream_options.include_usage`` every chunk has ``usage: null`` and
one last chunk with no choices carries the usage; without it no chunk has ``usage``.

A request's routing headers travel with its engine requests to the DP router and never reach
the core (:meth:`OpenAIServing.routing`): ``X-Session-ID`` (:func:`session_id_of`; the router
keeps a session on one rank, ``cache_aware``) and vLLM's ``X-data-parallel-rank``
(:func:`data_parallel_rank_of`: the request runs on that rank, whatever the policy). vLLM has
no body field for the rank; a ``data_parallel_rank`` in the body is refused, naming the header.

Bad input raises :class:`APIError` (mapped to OpenAI error JSON in
:mod:`atom.entrypoints.openai.api_server`) before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from atom.messages import KVTransferParams, check_token_ids
from atom.entrypoints.openai import protocol as p
from atom.entrypoints.openai.async_engine import AsyncEngine, Routing
from atom.outputs import CompletionOutput, RequestOutput
from atom.sampling_params import SamplingParams, StructuredOutputsParams

_MAX_N = 128  # OpenAI's limit on choices per request
_MIN_LOGPROB = -9999.0  # -inf is not JSON: clamp (as vLLM does)
_MAX_LOGIT_BIAS = 100.0  # OpenAI's documented range is [-100, 100]
_INT64 = 2**63


_MAX_SESSION_ID_CHARS = 256
SESSION_HEADER = "x-session-id"
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's spelling (HTTP headers ignore case)


def session_id_of(headers) -> str | None:
    """The request's session id: its ``X-Session-ID`` header (None: absent or empty).

    Raises:
        APIError: a header longer than 256 characters.
    """
    value = headers.get(SESSION_HEADER) or None
    if value is not None and len(value) > _MAX_SESSION_ID_CHARS:
        raise APIError(f"the X-Session-ID header is {len(value)} characters long; send at most "
                       f"{_MAX_SESSION_ID_CHARS}", param="X-Session-ID")
    return value


def data_parallel_rank_of(headers, *, dp_size: int) -> int | None:
    """The DP rank a request pins with vLLM's ``X-data-parallel-rank`` header (None: absent).

    Raises:
        APIError: (400) a value that is not a rank of the ``dp_size`` ranks running now.
    """
    value = headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    if not re.fullmatch(r"\s*\d{1,9}\s*", value) or int(value) >= dp_size:
        raise APIError(f"the {DP_RANK_HEADER} header is {value!r}: send a DP rank of this "
                       f"server, an integer in [0, {dp_size}) (it runs {dp_size} DP "
                       f"rank{'s' * (dp_size != 1)})", param=DP_RANK_HEADER)
    return int(value)


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class Delta:
    """New output of one choice since the last delta."""

    index: int  # choice index in the response (prompt_index * n + choice)
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the first delta of this choice
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first delta, when asked


@dataclass
class _ChoiceCursor:
    num_chars: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class UsageTally:
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    kv_transfer_params: dict | None = None  # a P/D producer's finished prefill: for the response

    def usage(self) -> p.Usage:
        prompt = sum(self.prompt_tokens)
        return p.Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                       total_tokens=prompt + self.completion_tokens,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))


class OpenAIServing:
    """Turns requests into engine requests and engine outputs into OpenAI responses.

    Args:
        engine: the running engine.
        tokenizer: the engine's tokenizer (a private copy is used here, so the event loop and
            the engine thread never share one).
        model_name: the served model name (requests naming another model get a 404).
        max_model_len, vocab_size: from the engine's runtime (context and id checks).
        tool_parser: reads ``tool_choice: "auto"`` calls (``--tool-call-parser``;
            :mod:`atom.entrypoints.openai.tool_parsers`); None: "auto" is a 400.
    """

    def __init__(self, engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int,
                 vocab_size: int, tool_parser=None):
        self.engine = engine
        self.tool_parser = tool_parser
        self.tokenizer = copy.deepcopy(tokenizer)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    # ----- request checks -----

    @property
    def dp_size(self) -> int:
        """The DP ranks running now (fewer than started after a rank failure shrank them)."""
        return int(self.engine.status.membership.get("dp_size", 1))

    def routing(self, req: p.SamplingFields, headers) -> Routing:
        """The request's :class:`~atom.entrypoints.openai.async_engine.Routing` from its
        headers (module docstring).

        Raises:
            APIError: (400) a bad header, or a ``data_parallel_rank`` body field.
        """
        if req.data_parallel_rank is not None:
            raise APIError(f"data_parallel_rank is not a request field (nor in vLLM's API): "
                           f"send the {DP_RANK_HEADER} header to pin the DP rank",
                           param="data_parallel_rank")
        return Routing(session_id=session_id_of(headers),
                       data_parallel_rank=data_parallel_rank_of(headers, dp_size=self.dp_size))

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 for a model name other than the served one."""
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model",
                           code="model_not_found")

    def sampling_params(self, req: p.SamplingFields, *, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """SamplingParams of a request (temperature and top_p default to 1, as OpenAI;
        ``structured_outputs``: :func:`atom.entrypoints.openai.structured.structured_outputs_of`).

        Raises:
            APIError: a value out of range (``param`` names the field).
        """
        if not 1 <= req.n <= _MAX_N:
            raise APIError(f"n={req.n} is invalid: must be in [1, {_MAX_N}]", param="n")
        if req.seed is not None and not -_INT64 <= req.seed < _INT64:
            raise APIError(f"seed={req.seed} does not fit 64 bits", param="seed")
        bias = req.logit_bias or {}
        if any(abs(v) > _MAX_LOGIT_BIAS for v in bias.values()):
            raise APIError(f"logit_bias values must be in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]",
                           param="logit_bias")
        options = dict(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            seed=req.seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, logit_bias=bias,
            structured_outputs=structured_outputs)
        try:
            return SamplingParams(**options)
        except ValueError as exc:
            match = re.match(r"SamplingParams\.(\w+)=", str(exc))
            raise APIError(str(exc).replace("SamplingParams.", ""),
                           param=match.group(1) if match else None) from exc

    def check_prompt(self, prompt: _Prompt, params: SamplingParams, *, param: str) -> None:
        """Raises APIError for an empty prompt, ids outside the vocabulary, or a prompt plus
        ``max_tokens`` beyond the context (``max_model_len``)."""
        num_tokens = len(prompt.token_ids)
        if num_tokens == 0:
            raise APIError(f"{param} is empty: send at least one token", param=param)
        for ids, name in ((prompt.token_ids, param), (params.stop_token_ids, "stop_token_ids"),
                          (list(params.logit_bias), "logit_bias")):
            error = check_token_ids(ids, [], [], vocab_size=self.vocab_size)
            if error is not None:
                raise APIError(error.replace("prompt token ids", name), param=name)
        num_requested = num_tokens + (params.max_tokens or 1)
        if num_requested > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_requested} tokens ({num_tokens} in the {param}, "
                f"{params.max_tokens or 1} in the completion). Reduce the length of the {param} "
                f"or the completion.", param=param, code="context_length_exceeded")

    def kv_transfer_params(self, req: p.SamplingFields,
                           prompts: list[_Prompt]) -> KVTransferParams | None:
        """The request's P/D params (:class:`~atom.messages.KVTransferParams`), or None.

        Raises:
            APIError: malformed params, or more than one prompt (one request per P/D pair).
        """
        if req.kv_transfer_params is None:
            return None
        if len(prompts) != 1:
            raise APIError("kv_transfer_params needs exactly one prompt", param="kv_transfer_params")
        try:
            return msgspec.convert(req.kv_transfer_params, KVTransferParams)
        except msgspec.ValidationError as exc:
            raise APIError(f"kv_transfer_params: {exc}", param="kv_transfer_params") from exc

    # ----- prompts -----

    def completion_prompts(self, prompt: str | list) -> list[_Prompt]:
        """The prompts of a completions request (one per string or token-id list)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt is empty: send at least one prompt", param="prompt")
        return [_Prompt(x, self.tokenizer.encode(x, add_special_tokens=False)) if isinstance(x, str)
                else _Prompt(None, list(x)) for x in prompt]

    def chat_prompt(self, messages: list[p.ChatMessage], *, add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> _Prompt:
        """The chat template applied to ``messages`` (text content only; an assistant's
        ``tool_calls`` and a tool message's ``tool_call_id`` passed on) and ``tools`` (rendered
        where the template knows them).

        Raises:
            APIError: no messages, a non-text content part, or a template error.
        """
        if not messages:
            raise APIError("messages is empty: send at least one message", param="messages")
        conversation = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" or not isinstance(part.get("text"), str)
                       for part in content):
                    raise APIError("only text content parts are supported", param="messages")
                content = "".join(part["text"] for part in content)
            extra = {key: value for key, value in (m.model_extra or {}).items()
                     if key in ("tool_calls", "tool_call_id", "name")}
            conversation.append({"role": m.role, "content": content or "", **extra})
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja2 raises its own errors for malformed conversations
            raise APIError(f"the chat template failed on these messages: {exc}",
                           param="messages") from exc
        return _Prompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ----- running -----

    async def outputs(self, prompts: list[_Prompt], params: SamplingParams, *,
                      routing: Routing = Routing(),
                      kv_transfer_params: KVTransferParams | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt_index, output)`` of every prompt's request, as the engine produces them
        (every one routed by ``routing``; ``kv_transfer_params``: the one prompt's P/D half).

        Closing the iterator aborts the requests still running.

        Raises:
            APIError: (400) the pinned rank is gone (a rank failure shrank the group since the
                header was checked).
        """
        base = uuid.uuid4().hex
        updates: asyncio.Queue = asyncio.Queue()

        extra = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}

        async def pump(i: int, prompt: _Prompt) -> None:
            try:
                async for out in self.engine.generate(f"{base}-{i}", prompt.token_ids, params,
                                                      prompt=prompt.text, routing=routing,
                                                      **extra):
                    updates.put_nowait((i, out))
            except ValueError as exc:  # the router refused the rank pin: nothing runs
                updates.put_nowait((i, APIError(str(exc), param=DP_RANK_HEADER)))
            except Exception as exc:  # the consumer re-raises it
                updates.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, x)) for i, x in enumerate(prompts)]
        try:
            num_open = len(prompts)
            while num_open:
                i, out = await updates.get()
                if isinstance(out, Exception):
                    raise out
                num_open -= out.finished
                yield i, out
        finally:
            for task in tasks:
                task.cancel()  # a running request's generator aborts it on the way out

    async def deltas(self, prompts: list[_Prompt], params: SamplingParams, tally: UsageTally, *,
                     routing: Routing = Routing(),
                     kv_transfer_params: KVTransferParams | None = None) -> AsyncIterator[Delta]:
        """Per-choice deltas; ``tally`` holds the usage once the iterator is exhausted.

        Raises:
            APIError: the engine refused a prompt (e.g. it can never fit the KV cache: 400),
                or a rank failure ended the request without resuming it (503).
        """
        cursors = [[_ChoiceCursor() for _ in range(params.n)] for _ in prompts]
        tally.prompt_tokens = [len(x.token_ids) for x in prompts]
        tally.cached_tokens = [0] * len(prompts)
        async for i, out in self.outputs(prompts, params, routing=routing,
                                         kv_transfer_params=kv_transfer_params):
            tally.cached_tokens[i] = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                tally.kv_transfer_params = msgspec.to_builtins(out.kv_transfer_params)
            for c in out.outputs:
                if c.finish_reason == "error" and out.extra.get("rank_failure"):
                    raise APIError(c.error or "the ranks running the request were lost",
                                   status=503, type="server_error", code="rank_failure")
                delta = _advance(cursors[i][c.index], c, prompt_index=i, n=params.n,
                                 want_logprobs=params.logprobs is not None)
                if delta is not None:
                    if delta.first:
                        delta.prompt_logprobs = out.prompt_logprobs
                    yield delta
            if out.finished:
                tally.completion_tokens += sum(len(c.token_ids) for c in out.outputs)


def _advance(cursor: _ChoiceCursor, c: CompletionOutput, *, prompt_index: int, n: int,
             want_logprobs: bool) -> Delta | None:
    """The delta of choice ``c`` past ``cursor`` (None while there is no new text and no
    finish: tokens without text yet wait, with their logprobs, for the next delta)."""
    if cursor.finished:
        return None
    if c.finish_reason == "error":
        raise APIError(c.error or "the request failed", param="prompt")
    text = c.text[cursor.num_chars:]
    if not text and c.finish_reason is None:
        return None
    delta = Delta(index=prompt_index * n + c.index, prompt_index=prompt_index, text=text,
                  token_ids=c.token_ids[cursor.num_tokens:],
                  logprobs=c.logprobs[cursor.num_tokens:] if want_logprobs and c.logprobs else
                  ([] if want_logprobs else None),
                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                  first=not cursor.started)
    cursor.num_chars, cursor.num_tokens = len(c.text), len(c.token_ids)
    cursor.started, cursor.finished = True, c.finish_reason is not None
    return delta


def clamp_logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def sse(payload: str) -> str:
    """One server-sent event carrying ``payload`` (JSON, or ``[DONE]``)."""
    return f"data: {payload}\n\n"


def sse_json(chunk: dict) -> str:
    return sse(json.dumps(chunk, ensure_ascii=False, separators=(",", ":")))
