"""Tool calling on ``/v1/chat/completions`` by constrained decoding (vLLM's approach for
``tool_choice`` ``"required"`` and a named function): the output is constrained to the tools'
JSON schemas and returned as ``tool_calls`` in OpenAI's shape.

- ``tool_choice: {"type": "function", "function": {"name": F}}``: the output is F's arguments,
  a JSON value of F's ``parameters`` schema; one call, ``finish_reason`` ``"stop"`` (OpenAI's,
  for a forced function).
- ``tool_choice: "required"``: the output is a non-empty JSON array of ``{"name": N,
  "parameters": {...}}``, each item one of the tools with its own schema (``anyOf``); one call
  per item, ``finish_reason`` ``"tool_calls"``.
- ``"none"``: no tools are rendered and the output is free text.
- ``"auto"`` (OpenAI's default when tools are sent): with ``--enable-auto-tool-choice
  --tool-call-parser NAME`` the output is free and the parser
  (:mod:`atom.entrypoints.openai.tool_parsers`) finds the calls the model wrote in its own
  syntax (``finish_reason`` ``"tool_calls"`` when there are some; the text before them is the
  content); without a parser, a 400 that says so.

The tools are rendered by the chat template (``tools=``) when it knows them. An output cut by
``max_tokens`` is not a complete call: it is returned as ``content`` with ``finish_reason``
``"length"``. Streamed, a named function's arguments stream as they are generated (the first
delta carries the call's id and name); with ``"required"`` or ``"auto"`` a choice sends its
calls (or its content) in one chunk at its finish.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from atom.entrypoints.openai import protocol as p
from atom.entrypoints.openai.serving import APIError
from atom.sampling_params import StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools constrain its output and how the output becomes calls.

    Attributes:
        spec: the constraint (the named function's parameters, or the array of calls).
        function_name: the forced function's name; None for ``"required"``.
        tools: the tools as sent, for the chat template.
    """

    spec: StructuredOutputsParams | None
    function_name: str | None
    tools: list[dict]
    parser: object = None  # "auto": a tool_parsers parser (spec None: the output is free)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.function_name is not None else "tool_calls"


def plan_tools(req: p.ChatCompletionRequest, parser=None) -> ToolPlan | None:
    """The request's tool plan (None: no tools, or ``tool_choice: "none"``); ``parser``: the
    server's tool-call parser for ``"auto"`` (None: ``"auto"`` is refused).

    Raises:
        APIError: ``tool_choice`` ``"auto"`` (or left out with tools), ``tool_choice``
            without tools, a malformed tool, a named function that is not among the tools, or
            tools beside another output constraint.
    """
    choice = req.tool_choice
    if req.tools is None:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    schemas = _tool_schemas(req.tools)
    if (choice is None or choice == "auto") and parser is not None:
        return ToolPlan(None, None, req.tools, parser)
    if choice is None or choice == "auto":
        raise APIError("tool_choice='auto' (the default with tools) needs a tool-call parser: "
                       "start the server with --enable-auto-tool-choice --tool-call-parser "
                       "NAME, or send tool_choice='required', a "
                       "named function ({'type': 'function', 'function': {'name': ...}}) or "
                       "'none'", param="tool_choice" if choice is not None else "tools")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        spec = StructuredOutputsParams(json={"type": "array", "minItems": 1,
                                             "items": {"anyOf": items}})
        return ToolPlan(spec, None, req.tools)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise APIError(f"tool_choice={choice!r} is invalid: send 'none', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}", param="tool_choice")
    if name not in schemas:
        raise APIError(f"tool_choice names the function {name!r}, which is not among the tools "
                       f"({', '.join(schemas)})", param="tool_choice")
    return ToolPlan(StructuredOutputsParams(json=schemas[name]), name, req.tools)


def _tool_schemas(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of each function tool.

    Raises:
        APIError: a tool that is not ``{"type": "function", "function": {"name", ...}}``, or
            two with one name.
    """
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                           f"'parameters': {{...}}}}}}", param="tools")
        if function["name"] in schemas:
            raise APIError(f"two tools are named {function['name']!r}", param="tools")
        parameters = function.get("parameters") or _NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema", param="tools")
        schemas[function["name"]] = parameters
    return schemas


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[p.ToolCall] | None]:
    """``(content, calls)`` of a choice that ended with ``stop``: a constrained output's calls
    (``(text, None)`` when it is not complete JSON: a stop string cut it before the grammar's
    end), or what the ``"auto"`` parser found (``(text, None)`` when nothing)."""
    if plan.parser is not None:
        content, found = plan.parser.extract(text)
        return (content, [_call(c.name, c.arguments) for c in found]) if found else (text, None)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    if plan.function_name is not None:
        return None, [_call(plan.function_name, text)]
    return None, [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                  for item in value]


def new_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> p.ToolCall:
    return p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=name, arguments=arguments))
