"""Tool calls out of finished text (no server): the Hermes parser of ``tool_choice: "auto"``
and the constrained outputs of ``"required"`` / a named function."""

from __future__ import annotations

import json

from atom.entrypoints.openai.tool_calls import ToolPlan, parse_output
from atom.entrypoints.openai.tool_parsers import HermesToolParser
from atom.sampling_params import StructuredOutputsParams

AUTO = ToolPlan(None, None, [], HermesToolParser())


def test_hermes_finds_every_block_and_keeps_the_text_before_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}')  # no end tag
    content, calls = parse_output(AUTO, text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2


def test_hermes_without_a_well_formed_call_leaves_the_text_as_content():
    for text in ("Just text.", "<tool_call>{not json}</tool_call>",
                 '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_output(AUTO, text) == (text, None)
    assert parse_output(AUTO, '<tool_call>{"name": "f"}</tool_call>')[0] is None


def test_constrained_outputs_become_calls_and_a_cut_one_stays_content():
    named = ToolPlan(StructuredOutputsParams(json={}), "f", [])
    content, calls = parse_output(named, '{"x": 1}')
    assert content is None and calls[0].function.name == "f"
    assert calls[0].function.arguments == '{"x": 1}' and named.finish_reason == "stop"
    required = ToolPlan(StructuredOutputsParams(json={}), None, [])
    content, calls = parse_output(required, '[{"name": "a", "parameters": {"k": "v"}}, '
                                            '{"name": "b", "parameters": {}}]')
    assert [c.function.name for c in calls] == ["a", "b"] and required.finish_reason == "tool_calls"
    assert json.loads(calls[0].function.arguments) == {"k": "v"}
    assert parse_output(required, '[{"name": "a", "par') == ('[{"name": "a", "par', None)
