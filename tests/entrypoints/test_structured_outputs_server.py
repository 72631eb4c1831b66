"""Structured outputs over HTTP with the official ``openai`` client, on one rank and on DP=2:
``response_format`` (``json_schema``, ``json_object``), vLLM's ``guided_*`` and
``structured_outputs``, ``client.chat.completions.parse``, and the 400s for what is refused.
JSON is sampled at temperature 1.0 (seeded), 10 requests at once, streamed and not."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from tests.entrypoints.remote_server import API_KEY, ATOM, MODEL, RemoteServer
from tests.entrypoints.schemas import PERSON


def chat_texts(client, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) of 10 chat requests sent at once (seeds 0..9)."""
    def one(i: int) -> tuple[str, str]:
        messages = [{"role": "user", "content": f"Describe person {i} as JSON."}]
        if not stream:
            r = client.chat.completions.create(model=MODEL, messages=messages, seed=i,
                                               temperature=1.0, **kwargs)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, seed=i,
                                                    temperature=1.0, stream=True, **kwargs):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(10) as pool:
        return list(pool.map(one, range(10)))


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_json_schema_with_nested_objects_enums_and_arrays(any_server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    results = chat_texts(any_server.client(), stream, response_format=fmt, max_tokens=160)
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in results}) > 1


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_json_object(any_server, stream):
    """As offline: a 135M model's free JSON at temperature 1.0 may hit max_tokens; those stay
    open objects, the ones that end parse as objects."""
    results = chat_texts(any_server.client(), stream, response_format={"type": "json_object"},
                         max_tokens=120)
    finished = [text for text, finish in results if finish == "stop"]
    assert len(finished) >= 3, results
    for text in finished:
        assert isinstance(json.loads(text), dict), text
    assert all(text.startswith("{") for text, _ in results)


def test_guided_fields_on_completions(any_server):
    client = any_server.client()
    choices = ["yes", "no", "maybe"]
    r = client.completions.create(model=MODEL, prompt=["Is the sky blue?", "Is fire cold?"],
                                  max_tokens=8, temperature=1.0, seed=1, n=2,
                                  extra_body={"guided_choice": choices})
    assert len(r.choices) == 4 and all(c.text in choices for c in r.choices)
    pattern = r"[0-9]{3}-[0-9]{4}"
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=16,
                                  temperature=1.0, seed=2, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=160, seed=3,
                                  extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=32, seed=4,
                                  extra_body={"structured_outputs": {
                                      "grammar": 'root ::= [0-9] "+" [0-9] "=" [0-9]+'}})
    assert re.fullmatch(r"[0-9]\+[0-9]=[0-9]+", r.choices[0].text), r.choices[0].text


def test_chat_completions_parse_with_a_pydantic_model(server):
    class Answer(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    r = server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Where is the Eiffel tower?"}],
        response_format=Answer, max_tokens=64, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Answer), r.choices[0].message


@pytest.mark.parametrize("body, param, message", [
    ({"extra_body": {"guided_regex": "[a-z"}}, "guided_regex", "unclosed character class"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "response_format.json_schema.schema does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
     "guided_choice", "at most one of response_format, guided_choice"),
    ({"extra_body": {"structured_outputs": {"json": {}, "whitespace_pattern": " "}}},
     "structured_outputs", "structured_outputs.whitespace_pattern is not supported"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
     "structured_outputs", "exactly one of"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "choice is invalid"),
    ({"extra_body": {"guided_json": "{}", "guided_whitespace_pattern": " "}},
     "guided_whitespace_pattern", "not supported"),
    ({"extra_body": {"guided_regex": "a", "guided_decoding_backend": "outlines"}},
     "guided_decoding_backend", "this server runs llguidance"),
    ({"extra_body": {"guided_regex": "a", "ignore_eos": True}}, "ignore_eos", "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools", "needs a tool-call parser"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "auto"}, "tool_choice", "needs a tool-call parser"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constrain the output already"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
])
def test_unsupported_or_invalid_asks_are_400_naming_the_field(any_server, body, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        any_server.client().chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "Hi"}], max_tokens=4, **body)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert message in error["message"], error


def test_tool_choice_none_renders_no_tools_and_text_format_is_free(any_server):
    r = any_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="none", response_format={"type": "text"})
    assert r.choices[0].message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def tool_calls(client, stream: bool, tool_choice, seed: int):
    """(tool_calls as dicts, finish_reason) of one chat request with both tools."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=1.0, seed=seed,
                  max_tokens=120)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert message.content is None, message
        return [c.model_dump() for c in message.tool_calls], r.choices[0].finish_reason
    calls, finish, num_deltas = {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.content
            for call in c.delta.tool_calls or []:  # OpenAI's stream shape, merged by index
                num_deltas += 1
                if call.index not in calls:  # its first delta: id, type and name
                    assert call.id and call.function.name, call
                    calls[call.index] = {"id": call.id, "type": call.type,
                                         "function": {"name": None, "arguments": ""}}
                else:
                    assert call.id is None and not call.function.name, call
                entry = calls[call.index]
                if call.function.name:
                    entry["function"]["name"] = call.function.name
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = c.finish_reason or finish
    if isinstance(tool_choice, dict):  # a named function's arguments stream piece by piece
        assert num_deltas > 1
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_tool_choice_required_and_named_return_valid_tool_calls(any_server, stream):
    client = any_server.client()
    for seed in range(3):
        calls, finish = tool_calls(client, stream, "required", seed)
        assert finish == "tool_calls" and calls
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])
        named = {"type": "function", "function": {"name": "get_time"}}
        calls, finish = tool_calls(client, stream, named, seed)
        assert finish == "stop" and [c["function"]["name"] for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS["get_time"])


@pytest.fixture(scope="module")
def auto_server():
    srv = RemoteServer("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_auto_tool_choice_parses_the_calls_the_model_writes(auto_server, stream):
    """The model's own Hermes syntax, forced here by a regex so that a 135M model writes it:
    the parser turns the generated text into tool_calls, the text before it into content."""
    forced = (r'Checking\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}'
              r'</tool_call>')
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
                  tools=[WEATHER, TIME], max_tokens=64, temperature=1.0, seed=0,
                  extra_body={"guided_regex": forced})
    client = auto_server.client()
    if stream:
        content, calls, finish = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
    else:
        r = client.chat.completions.create(**kwargs)
        content, calls = r.choices[0].message.content, r.choices[0].message.tool_calls
        finish = r.choices[0].finish_reason
    assert content == "Checking." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_time"])
    # without the regex the model writes what it likes: content, or calls that parse
    r = client.chat.completions.create(**{**kwargs, "extra_body": {}})
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_auto_tool_choice_flags_go_together():
    done = subprocess.run([ATOM, "serve", "--enable-auto-tool-choice"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--tool-call-parser" in done.stderr, done.stderr
