"""Structured outputs offline: ``LLM.generate(..., SamplingParams(structured_outputs=...))`` on
the embedded model, sampled at temperature 1.0 (seeded), each output checked with ``json.loads``
and ``jsonschema.validate``, or against its choices or regex."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from atom import LLM, SamplingParams
from atom.sampling_params import StructuredOutputsParams
from tests.entrypoints.schemas import PERSON

PROMPTS = [f"Write a JSON record for person number {i}:" for i in range(10)]


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=512, num_kv_blocks=96, block_size=16) as engine:
        yield engine


def generate(llm, spec: StructuredOutputsParams, *, max_tokens: int = 160) -> list[str]:
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                                 structured_outputs=spec) for i in range(10)])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0] for o in outs]
    return [o.outputs[0].text for o in outs]


def test_json_schema_with_nested_objects_enums_and_arrays(llm):
    texts = generate(llm, StructuredOutputsParams(json=PERSON))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # sampled, not one greedy answer


def test_json_object_is_a_json_object(llm):
    """Free JSON at temperature 1.0 from a 135M model often rambles past any budget (about half
    of these seeded samples hit max_tokens): those are checked to be open objects, the ones
    that end (EOS, allowed only once the object is complete) to parse as objects."""
    messages = [[{"role": "user", "content": f"Give a short JSON object describing fruit {i}."}]
                for i in range(10)]
    outs = llm.chat(messages, [SamplingParams(temperature=1.0, seed=i, max_tokens=300,
                                              structured_outputs={"json_object": True})
                               for i in range(10)])
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 3, [o.outputs[0] for o in outs]
    for text in finished:
        assert isinstance(json.loads(text), dict), text
    assert all(o.outputs[0].text.startswith("{") for o in outs)


def test_choice_and_regex(llm):
    choices = ["Paris", "London", "Berlin"]
    assert set(generate(llm, StructuredOutputsParams(choice=choices))) <= set(choices)
    pattern = r"[a-z]{1,12}@[a-z]{1,8}\.(com|org)"
    for text in generate(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, text), text


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
    for text in generate(llm, StructuredOutputsParams(grammar=grammar), max_tokens=64):
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", text), text


def test_a_spec_that_does_not_compile_is_a_value_error_before_the_engine(llm):
    with pytest.raises(ValueError, match="(?s)structured_outputs.regex: .*unclosed group"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "json_object": True})


def test_with_speculation_constrained_sequences_take_no_drafts_and_others_still_do():
    """n-gram speculation on: a free prompt that repeats itself verifies drafts in the same
    batch as a constrained one, which stays within its grammar (it gets no draft slots)."""
    pattern = r"(ab){2,40}"
    with LLM(max_model_len=256, num_kv_blocks=32, block_size=16, speculative_method="ngram",
             num_speculative_tokens=3) as spec_llm:
        free, constrained = spec_llm.generate(
            ["one two three one two three one two three one two", "Letters:"],
            [SamplingParams(temperature=0, max_tokens=24),
             SamplingParams(temperature=1.0, seed=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=pattern))])
        stats = spec_llm.get_stats()
    assert re.fullmatch(pattern, constrained.outputs[0].text), constrained.outputs[0].text
    assert stats["spec_num_draft_tokens"] > 0 and free.outputs[0].text
