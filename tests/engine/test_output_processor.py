"""The front end's OutputProcessor with fake core outputs (real tokenizer, no model).

Checks how token-id outputs become RequestOutputs: safe text while running, stop strings
ending a choice at once (and asking the core to finish it), late core outputs dropped, the
stop string winning over max_tokens, EOS text left out, aborts, n > 1 and prompt logprobs.
"""

from __future__ import annotations

import msgspec
import pytest

from atom.messages import (
    EngineCoreOutputs,
    FinishRequests,
    SeqOutput,
    decode_input,
    decode_output,
    encode,
)
from atom.engine.output_processor import OutputProcessor
from atom.sampling_params import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from atom.worker.model_files import load_tokenizer

    return load_tokenizer(None)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _out(request_id: str, token: int | None, *, index: int = 0, finish: str | None = None,
         **extra) -> SeqOutput:
    return SeqOutput(request_id=request_id, index=index,
                     new_token_ids=[] if token is None else [token], finish_reason=finish, **extra)


def _feed(proc: OutputProcessor, request_id: str, tokens: list[int], *, last_finish: str | None = None):
    """Feed one token per step; returns (request outputs, finish keys) over all steps."""
    outputs, keys = [], []
    for j, token in enumerate(tokens):
        finish = last_finish if j == len(tokens) - 1 else None
        result = proc.process_outputs([_out(request_id, token, finish=finish)])
        outputs += result.request_outputs
        keys += list(zip(result.finish_seq_keys, result.stop_reasons))
    return outputs, keys


def test_text_streams_as_safe_prefixes_and_stop_string_ends_the_choice(tokenizer):
    text = "Hello world. Stop here, and more text follows."
    tokens = _tokens(tokenizer, text)
    proc = OutputProcessor(tokenizer)
    assert proc.add_request("r", [1, 2, 3], SamplingParams(stop=["Stop"]), prompt="p",
                            arrival_time_s=0.0) is None
    outputs, keys = _feed(proc, "r", tokens)
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "Stop" and final.outputs[0].text == "Hello world. "
    assert keys == [(("r", 0), "Stop")]  # once; the tokens the core sent after it are dropped
    shown = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))
    assert tokenizer.decode(final.outputs[0].token_ids).startswith("Hello world. Stop")
    assert not proc.has_unfinished_requests()


def test_stop_string_wins_over_max_tokens_without_a_finish_request(tokenizer):
    tokens = _tokens(tokenizer, "one two three")
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", [1], SamplingParams(stop=["three"]), prompt=None, arrival_time_s=0.0)
    outputs, keys = _feed(proc, "r", tokens, last_finish="length")
    assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].outputs[0].text == "one two "
    assert keys == []  # the core had already finished it


def test_eos_text_is_left_out(tokenizer):
    tokens = _tokens(tokenizer, "Fine") + [EOS]
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", [1], SamplingParams(skip_special_tokens=False), prompt=None, arrival_time_s=0.0)
    outputs, _ = _feed(proc, "r", tokens, last_finish="stop")
    final = outputs[-1].outputs[0]
    assert final.text == "Fine" and final.token_ids == tokens and final.stop_reason is None


def test_n2_finishes_when_both_choices_do_and_abort_ends_the_rest(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, stop=["b"], logprobs=0, prompt_logprobs=0)
    proc.add_request("r", [5, 6], params, prompt=None, arrival_time_s=0.0)
    (a,) = _tokens(tokenizer, "a")
    (b,) = _tokens(tokenizer, "b")
    prompt_lp = [None, {6: -1.0}]
    result = proc.process_outputs([
        _out("r", a, index=0, new_logprobs=[{a: -0.5}], cumulative_logprob=-0.5, prompt_logprobs=prompt_lp),
        _out("r", b, index=1, new_logprobs=[{b: -0.25}], cumulative_logprob=-0.25)])
    (out,) = result.request_outputs
    assert not out.finished and result.finish_seq_keys == [("r", 1)]
    assert out.prompt_logprobs == prompt_lp and out.metrics.first_token_time_s is not None
    assert out.outputs[0].logprobs == [{a: -0.5}] and out.outputs[1].finish_reason == "stop"
    late = proc.process_outputs([_out("r", a, index=1)])  # choice 1 already ended here
    assert late.request_outputs == []
    final = proc.abort_request("r")
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "stop"]
    assert proc.process_outputs([_out("r", a)]).request_outputs == []  # gone
    assert proc.abort_request("r") is None


def test_stop_strings_without_tokenizer_are_rejected_up_front():
    proc = OutputProcessor(None)
    out = proc.add_request("r", [1], SamplingParams(stop=["x"]), prompt=None, arrival_time_s=0.0)
    assert out.finished and out.outputs[0].finish_reason == "error" and "stop_token_ids" in out.outputs[0].error
    assert not proc.has_unfinished_requests()
    with pytest.raises(ValueError, match="already running"):
        proc.add_request("s", [1], SamplingParams(), prompt=None, arrival_time_s=0.0)
        proc.add_request("s", [1], SamplingParams(), prompt=None, arrival_time_s=0.0)


def test_messages_are_plain_msgpack():
    frame = encode(FinishRequests(seq_keys=[("r", 0)], stop_reasons=["x"]))
    assert msgspec.msgpack.decode(frame) == {"type": "finish", "seq_keys": [["r", 0]], "stop_reasons": ["x"]}
    assert decode_input(frame) == FinishRequests(seq_keys=[("r", 0)], stop_reasons=["x"])
    outputs = EngineCoreOutputs(dp_rank=0, timestamp_s=1.5, outputs=[
        _out("r", 7, new_logprobs=[{7: -0.1, 3: -2.0}], stop_reason=7, finish="stop")])
    assert decode_output(encode(outputs)) == outputs
