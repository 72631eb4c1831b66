"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests follow the OpenAI API reference for ``/v1/completions`` and ``/v1/chat/completions``
plus vLLM's sampling extensions (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``).
Unknown fields are ignored (``extra="ignore"``), except that what changes the output's shape is
known here and either honoured or refused with a 400 (``response_format``, vLLM's
``structured_outputs`` / ``guided_*``, ``tools``); a known field with a value of the wrong type
(or a NaN / infinite float) fails validation, which the server turns into a 400 (:mod:`atom.entrypoints.openai.api_server`).
Range checks live in one place, :class:`atom.sampling_params.SamplingParams`.

Responses are the shapes the official ``openai`` client parses: ``text_completion``,
``chat.completion`` and ``chat.completion.chunk`` objects, ``usage`` with
``prompt_tokens_details.cached_tokens``, and the error body ``{"error": {"message", "type",
"param", "code"}}``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # NaN and infinities are not sampling parameters (and would reach the sampler's math)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` or not: either way
    the output is constrained to ``schema``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``response_format``: ``text`` (free), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Request):
    """Fields shared by both generation endpoints (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # P/D disaggregation (atom.core.kv_connector; set by atom pd-proxy): the fields of
    # atom.messages.KVTransferParams
    kv_transfer_params: dict[str, Any] | None = None
    # not a field of OpenAI's or vLLM's API: declared so that it is refused (a 400 naming the
    # X-data-parallel-rank header, OpenAIServing.routing) rather than silently ignored
    data_parallel_rank: Any = None
    # structured outputs (atom.entrypoints.openai.structured): OpenAI's, then vLLM's; at most
    # one of them per request
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted when it names what runs: a 400 else
    guided_whitespace_pattern: str | None = None  # not supported: a 400 when set


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids
    or a list of lists of token ids (one request per prompt, choices numbered prompt × n)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of ``{"type": "text", "text"}`` parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages go through the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # tool calling by constrained decoding (atom.entrypoints.openai.tool_calls): "required" or
    # a named function; "none" renders no tools; "auto" (the default with tools) is a 400
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ----- responses -----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a P/D producer's: where its KV is


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # a P/D producer's: where its KV is


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a piece of the JSON text (streamed arguments)


class DeltaToolCall(BaseModel):
    """A streamed call (OpenAI's shape): its first delta has the id, type and name; later ones
    only more of the arguments, all under the call's ``index``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atom"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
