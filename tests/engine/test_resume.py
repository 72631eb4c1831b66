"""Resumed requests (``EngineCoreRequest.resumed``, after a rank failure) on an in-process
EngineCore with the embedded model: a request resumed from any point produces exactly the
tokens the undisturbed one did next (greedy; seeded sampling, its generator advanced past the
tokens already drawn; penalties counting the tokens already produced), finished choices are
not run again, and the cumulative logprob goes on from the resumed one.
"""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.engine.core import EngineCore
from atom.engine.core_proc import build_engine_core
from atom.messages import EngineCoreRequest, ResumedChoice
from atom.sampling_params import SamplingParams

PROMPT = list(range(200, 230))
MAX_STEPS = 200  # a request of a dozen tokens finishes well within this many steps


@pytest.fixture(scope="module")
def core():
    core = build_engine_core(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256,
                                          num_threads=1))
    yield core
    core.close()


def _run(core: EngineCore, request: EngineCoreRequest) -> dict[int, dict]:
    """Per choice: its new tokens, last cumulative logprob and finish."""
    core.add_request(request)
    out: dict[int, dict] = {}
    for _ in range(MAX_STEPS):
        if not core.has_work():
            break
        for o in core.step():
            choice = out.setdefault(o.index, {"tokens": [], "finish": None, "logprob": 0.0})
            choice["tokens"] += o.new_token_ids
            choice["finish"], choice["logprob"] = o.finish_reason, o.cumulative_logprob
    assert not core.has_work()
    return out


def _request(request_id: str, params: SamplingParams, resumed=None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, PROMPT, params, 0.0, resumed=resumed)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5,
                   presence_penalty=0.5),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
], ids=["greedy", "penalties", "seeded"])
def test_resumed_request_continues_exactly(core, params):
    whole = _run(core, _request("whole", params))[0]
    assert len(whole["tokens"]) == 12 and whole["finish"] == "length"
    for k in (1, 5, 11):
        prefix = whole["tokens"][:k]
        resumed = _run(core, _request(f"resumed{k}", params, [ResumedChoice(prefix, 0.0)]))[0]
        assert prefix + resumed["tokens"] == whole["tokens"], k
        assert resumed["finish"] == "length"  # max_tokens counts the resumed tokens


def test_cumulative_logprob_goes_on_from_the_resumed_one(core):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    whole = _run(core, _request("lp-whole", params))[0]
    head = _run(core, _request("lp-head", SamplingParams(temperature=0.0, max_tokens=3,
                                                          ignore_eos=True, logprobs=1)))[0]
    resumed = _run(core, _request("lp-resumed", params,
                                  [ResumedChoice(head["tokens"], head["logprob"])]))[0]
    assert resumed["logprob"] == pytest.approx(whole["logprob"], abs=1e-3)


def test_finished_choices_are_not_run_again_and_a_bad_resume_fails_alone(core):
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True)
    whole = _run(core, _request("n2", params))
    resumed = _run(core, _request("n2-resumed", params, [
        ResumedChoice(whole[0]["tokens"][:2], 0.0),
        ResumedChoice(whole[1]["tokens"], 0.0, finished=True)]))
    assert set(resumed) == {0}  # choice 1 had finished: nothing from it
    assert whole[0]["tokens"][:2] + resumed[0]["tokens"] == whole[0]["tokens"]
    bad = _run(core, _request("bad", params, [ResumedChoice([], 0.0)]))
    assert {i: (c["finish"], c["tokens"]) for i, c in bad.items()} == {
        0: ("error", []), 1: ("error", [])}
    assert core.get_stats()["num_free_blocks"] == 64


def test_a_resumed_constrained_request_keeps_its_grammar(core):
    """Structured outputs after a rank failure: the new rank's matcher consumes the tokens
    already produced, so the resumed request continues exactly (seeded) and within the
    grammar, as the undisturbed one did."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "size": {"enum": ["S", "M", "L"]}},
              "required": ["name", "size"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                            structured_outputs={"json": schema})
    whole = _run(core, _request("json-whole", params))[0]
    assert whole["finish"] == "stop"
    for k in (1, len(whole["tokens"]) // 2):
        prefix = whole["tokens"][:k]
        resumed = _run(core, _request(f"json-resumed{k}", params,
                                      [ResumedChoice(prefix, 0.0)]))[0]
        assert prefix + resumed["tokens"] == whole["tokens"]
    text = _decode(whole["tokens"][:-1])  # EOS last
    assert set(json.loads(text)) == {"name", "size"}


def _decode(token_ids: list[int]) -> str:
    from atom.worker.model_files import load_tokenizer

    return load_tokenizer(None).decode(token_ids)
