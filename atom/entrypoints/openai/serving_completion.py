"""``/v1/completions``: legacy completions, streamed or not, with ``echo`` and ``logprobs``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from atom.entrypoints.openai import protocol as p
from atom.entrypoints.openai.async_engine import Routing
from atom.entrypoints.openai.serving import (
    APIError,
    Delta,
    OpenAIServing,
    UsageTally,
    clamp_logprob,
    sse,
    sse_json,
)
from atom.entrypoints.openai.structured import structured_outputs_of


async def create_completion(serving: OpenAIServing, req: p.CompletionRequest, *,
                            routing: Routing = Routing()
                            ) -> p.CompletionResponse | AsyncIterator[str]:
    """The response, or (``stream``) an iterator of SSE events ending in ``[DONE]``
    (``routing``: the DP router's session and rank pin, from the headers).

    With ``echo`` each choice's text starts with its prompt (and ``logprobs`` with the prompt
    tokens', the first one ``None``).

    Raises:
        APIError: bad input (400) or an unknown model (404).
    """
    serving.check_model(req.model)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream=true", param="stream_options")
    params = serving.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                     prompt_logprobs=req.logprobs if req.echo else None,
                                     structured_outputs=structured_outputs_of(req))
    prompts = serving.completion_prompts(req.prompt)
    for prompt in prompts:
        serving.check_prompt(prompt, params, param="prompt")
    tally = UsageTally()
    header = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=serving.model_name)
    format_choice = _ChoiceFormatter(serving, prompts, echo=req.echo, num_top=req.logprobs)
    deltas = serving.deltas(prompts, params, tally, routing=routing,
                            kv_transfer_params=serving.kv_transfer_params(req, prompts))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(deltas, format_choice, tally, include_usage=include_usage, header=header)
    choices: dict[int, p.CompletionChoice] = {}
    async for delta in deltas:
        choice = format_choice(delta)
        if delta.index in choices:
            _merge(choices[delta.index], choice)
        else:
            choices[delta.index] = choice
    return p.CompletionResponse(**header, choices=[choices[i] for i in sorted(choices)],
                                usage=tally.usage(), kv_transfer_params=tally.kv_transfer_params)


def _merge(into: p.CompletionChoice, more: p.CompletionChoice) -> None:
    into.text += more.text
    into.finish_reason, into.stop_reason = more.finish_reason, more.stop_reason
    if into.logprobs is not None and more.logprobs is not None:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(into.logprobs, name).extend(getattr(more.logprobs, name))


class _ChoiceFormatter:
    """Delta → ``CompletionChoice`` (the prompt first when ``echo``); keeps each choice's
    text offset for ``logprobs.text_offset``."""

    def __init__(self, serving: OpenAIServing, prompts, *, echo: bool, num_top: int | None):
        self.serving, self.prompts, self.echo, self.num_top = serving, prompts, echo, num_top
        self.offsets: dict[int, int] = {}

    def __call__(self, delta: Delta) -> p.CompletionChoice:
        text, token_ids, logprobs = delta.text, delta.token_ids, delta.logprobs
        if self.echo and delta.first:
            prompt = self.prompts[delta.prompt_index]
            text = (prompt.text if prompt.text is not None
                    else self.serving.tokenizer.decode(prompt.token_ids)) + text
            token_ids = prompt.token_ids + token_ids
            if logprobs is not None:
                logprobs = (delta.prompt_logprobs or [None] * len(prompt.token_ids)) + logprobs
        return p.CompletionChoice(index=delta.index, text=text, finish_reason=delta.finish_reason,
                                  stop_reason=delta.stop_reason,
                                  logprobs=None if logprobs is None else
                                  self._logprobs(delta.index, token_ids, logprobs))

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs()
        offset = self.offsets.get(index, 0)
        for token_id, top in zip(token_ids, logprobs):
            token = self.serving.token_str(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if top is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(top[token_id]))
            out.top_logprobs.append({self.serving.token_str(t): clamp_logprob(v)
                                     for t, v in list(top.items())[: self.num_top]})
        self.offsets[index] = offset
        return out


async def _stream(deltas: AsyncIterator[Delta], format_choice: _ChoiceFormatter,
                  tally: UsageTally, *, include_usage: bool, header: dict) -> AsyncIterator[str]:
    async for delta in deltas:
        chunk = p.CompletionResponse(**header, choices=[format_choice(delta)]).model_dump()
        if not include_usage:
            del chunk["usage"]
        yield sse_json(chunk)
    if include_usage:
        yield sse_json(p.CompletionResponse(**header, choices=[], usage=tally.usage()).model_dump())
    yield sse("[DONE]")
