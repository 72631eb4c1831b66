"""``/v1/chat/completions``: messages through the chat template, streamed or not, with
``logprobs`` / ``top_logprobs``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from atom.entrypoints.openai import protocol as p
from atom.entrypoints.openai.async_engine import Routing
from atom.entrypoints.openai.serving import APIError, Delta, OpenAIServing, UsageTally
from atom.entrypoints.openai.serving import clamp_logprob, sse, sse_json
from atom.entrypoints.openai.structured import structured_outputs_of
from atom.entrypoints.openai.tool_calls import ToolPlan, new_call_id, parse_output, plan_tools


async def create_chat_completion(serving: OpenAIServing, req: p.ChatCompletionRequest, *,
                                 routing: Routing = Routing()
                                 ) -> p.ChatCompletionResponse | AsyncIterator[str]:
    """The response, or (``stream``) an iterator of SSE events ending in ``[DONE]``: per
    choice a first chunk with the role, content chunks, and one chunk with its finish_reason
    (``routing``: the DP router's session and rank pin, from the headers).

    Raises:
        APIError: bad input (400) or an unknown model (404).
    """
    serving.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream=true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    plan, spec = plan_tools(req, serving.tool_parser), structured_outputs_of(req)
    if plan is not None and plan.spec is not None and spec is not None:
        raise APIError("tools with tool_choice 'required' or a named function constrain the "
                       "output already: drop response_format / structured_outputs / guided_*",
                       param="tool_choice")
    params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=num_top,
                                     structured_outputs=spec if plan is None or plan.spec is None
                                     else plan.spec)
    prompt = serving.chat_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                                 tools=None if plan is None else plan.tools)
    serving.check_prompt(prompt, params, param="messages")
    tally = UsageTally()
    header = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                  model=serving.model_name)
    deltas = serving.deltas([prompt], params, tally, routing=routing,
                            kv_transfer_params=serving.kv_transfer_params(req, [prompt]))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(serving, deltas, tally, num_top=num_top, include_usage=include_usage,
                       header=header, plan=plan)
    choices: dict[int, p.ChatChoice] = {}
    async for delta in deltas:
        logprobs = _logprobs(serving, delta, num_top)
        choice = choices.setdefault(delta.index, p.ChatChoice(
            index=delta.index, message=p.AssistantMessage(content=""),
            logprobs=None if logprobs is None else p.ChatLogprobs()))
        choice.message.content += delta.text
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if logprobs is not None:
            choice.logprobs.content.extend(logprobs.content)
    if plan is not None:
        for choice in choices.values():
            if choice.finish_reason != "stop":  # cut: not a complete call, left as content
                continue
            content, calls = parse_output(plan, choice.message.content)
            if calls is not None:
                choice.message.content, choice.message.tool_calls = content, calls
                choice.finish_reason = plan.finish_reason
    return p.ChatCompletionResponse(**header, choices=[choices[i] for i in sorted(choices)],
                                    usage=tally.usage(), kv_transfer_params=tally.kv_transfer_params)


def _logprobs(serving: OpenAIServing, delta: Delta, num_top: int | None) -> p.ChatLogprobs | None:
    if num_top is None or delta.logprobs is None:
        return None
    content = []
    for token_id, top in zip(delta.token_ids, delta.logprobs):
        token = serving.token_str(token_id)
        content.append(p.TokenLogprob(
            token=token, logprob=clamp_logprob(top[token_id]), bytes=list(token.encode()),
            top_logprobs=[p.TopLogprob(token=(t := serving.token_str(tid)), logprob=clamp_logprob(v),
                                       bytes=list(t.encode()))
                          for tid, v in list(top.items())[:num_top]]))
    return p.ChatLogprobs(content=content)


async def _stream(serving: OpenAIServing, deltas: AsyncIterator[Delta], tally: UsageTally, *,
                  num_top: int | None, include_usage: bool, header: dict,
                  plan: ToolPlan | None = None) -> AsyncIterator[str]:
    """With a named function's plan the text streams as the call's arguments
    (:func:`_arguments_delta`); with another tool plan a choice's text is held until its
    finish, which comes with its calls (:func:`_tool_delta`), and chunks before it carry only
    logprobs, when asked."""
    def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> str:
        body = p.ChatCompletionChunk(**header, choices=choices, usage=usage).model_dump()
        if not include_usage:
            del body["usage"]
        return sse_json(body)

    held: dict[int, str] = {}  # choice index -> text held back (tool calls)
    async for delta in deltas:
        if delta.first:  # OpenAI's first chunk of a choice carries the role only
            yield chunk([p.ChatChunkChoice(index=delta.index,
                                           delta=p.DeltaMessage(role="assistant", content=""))])
        message, finish = p.DeltaMessage(content=delta.text), delta.finish_reason
        if plan is not None and plan.function_name is not None:
            message = _arguments_delta(plan, delta.text, first=delta.index not in held)
            held[delta.index] = ""
        elif plan is not None:
            held[delta.index] = held.get(delta.index, "") + delta.text
            if finish is None and num_top is None:
                continue
            message, finish = _tool_delta(plan, held[delta.index], finish)
        yield chunk([p.ChatChunkChoice(index=delta.index, delta=message,
                                       logprobs=_logprobs(serving, delta, num_top),
                                       finish_reason=finish, stop_reason=delta.stop_reason)])
    if include_usage:
        yield chunk([], tally.usage())
    yield sse("[DONE]")


def _arguments_delta(plan: ToolPlan, text: str, *, first: bool) -> p.DeltaMessage:
    """A named function's streamed arguments: the first piece with the call's id and name (a
    stream cannot take back what it sent: an output cut by max_tokens ends with ``length``
    and incomplete arguments, as in vLLM)."""
    function = p.DeltaFunctionCall(name=plan.function_name if first else None, arguments=text)
    call = p.DeltaToolCall(index=0, function=function)
    if first:
        call.id, call.type = new_call_id(), "function"
    return p.DeltaMessage(tool_calls=[call])


def _tool_delta(plan: ToolPlan, text: str, finish: str | None) -> tuple[p.DeltaMessage, str | None]:
    """A tool-call choice's chunk: empty before its finish; at a complete finish its calls
    (OpenAI's stream shape, each with its ``index``) and the plan's finish_reason; a cut one
    gives back its text as content."""
    if finish is None:
        return p.DeltaMessage(), None
    content, calls = parse_output(plan, text) if finish == "stop" else (text, None)
    if calls is None:
        return p.DeltaMessage(content=text), finish
    return (p.DeltaMessage(content=content, tool_calls=[
        p.DeltaToolCall(index=i, id=call.id, type="function", function=p.DeltaFunctionCall(
            **call.function.model_dump())) for i, call in enumerate(calls)]),
        plan.finish_reason)
