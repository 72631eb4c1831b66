"""Structured outputs and tools on the OpenAI endpoints: the request's fields → one
:class:`~atom.sampling_params.StructuredOutputsParams`, or a 400 naming the field.

Accepted, at most one per request (vLLM's names): OpenAI's ``response_format``
(``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}``, strict or not, constrained to ``schema`` either way; ``{"type": "text"}`` is free
text); vLLM's ``structured_outputs`` (the fields of ``StructuredOutputsParams``) and its older
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. A spec that does not
compile (a schema feature llguidance refuses, a bad regex or grammar) is a 400 naming the field
the client used, before anything reaches the engine. ``guided_whitespace_pattern`` is refused;
``guided_decoding_backend`` is accepted only when it names what runs (``guidance`` /
``llguidance``, or ``auto``).

Tools constrain the output too: :mod:`atom.entrypoints.openai.tool_calls`.
"""

from __future__ import annotations

import msgspec

from atom.core.structured_output import grammar_error
from atom.entrypoints.openai import protocol as p
from atom.entrypoints.openai.serving import APIError
from atom.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_BACKENDS = ("auto", "guidance", "llguidance")


def structured_outputs_of(req: p.SamplingFields) -> StructuredOutputsParams | None:
    """The constraint a request asks for (None: free text).

    Raises:
        APIError: more than one constraint, a malformed one, one that does not compile, or an
            unsupported option (``param`` names the field).
    """
    asked = _asked(req)
    if req.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported: JSON is generated without "
                       "whitespace between tokens", param="guided_whitespace_pattern")
    if req.guided_decoding_backend not in (None, *_BACKENDS):
        raise APIError(f"guided_decoding_backend={req.guided_decoding_backend!r} is not "
                       f"available: this server runs llguidance (send one of {list(_BACKENDS)} "
                       f"or leave it out)", param="guided_decoding_backend")
    if len(asked) > 1:
        raise APIError(f"send at most one of {', '.join(asked)}", param=asked[1])
    if not asked:
        return None
    field, fields = asked[0], _fields(req, asked[0])
    try:
        spec = msgspec.convert(fields, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as exc:
        raise APIError(f"{field}: {str(exc).replace('StructuredOutputsParams.', '')}",
                       param=field) from exc
    error = grammar_error(spec)
    if error is not None:
        where = {"response_format": "response_format.json_schema.schema",
                 "structured_outputs": f"structured_outputs.{spec.kind}"}.get(field, field)
        raise APIError(f"{where} does not compile: {error.split(': ', 1)[1]}", param=field)
    return spec


def _asked(req: p.SamplingFields) -> list[str]:
    """The constraint fields the request sets, in a fixed order."""
    asked = []
    if req.response_format is not None and req.response_format.type != "text":
        asked.append("response_format")
    if req.structured_outputs is not None:
        asked.append("structured_outputs")
    return asked + [name for name in _GUIDED if getattr(req, name) is not None]


def _fields(req: p.SamplingFields, field: str) -> dict:
    """``StructuredOutputsParams``' fields for the constraint in ``field``.

    Raises:
        APIError: a ``json_schema`` response format without its schema.
    """
    if field == "response_format":
        fmt = req.response_format
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        return {"json": fmt.json_schema.json_schema}
    if field == "structured_outputs":
        unknown = sorted(set(req.structured_outputs) - set(StructuredOutputsParams.__struct_fields__))
        if unknown:
            raise APIError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                           f"{', '.join(StructuredOutputsParams.__struct_fields__)})",
                           param="structured_outputs")
        return req.structured_outputs
    return {_GUIDED[field]: getattr(req, field)}
