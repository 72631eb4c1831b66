"""Structured outputs on the scheduler side (no torch, no model): the params' checks, the
grammar check, the compile off the step loop, the bitmask per step, the matcher advanced by the
appended tokens, preemption, a resumed request and speculation.

The tokenizer is a byte-level one made here: token ``b`` is byte ``b`` (``'a'`` is 97), EOS is
256, so an allowed set of tokens reads as characters.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from atom.core.block_manager import BlockManager
from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import FinishReason, Sequence, SequenceStatus
from atom.core.structured_output import StructuredOutputManager, grammar_error
from atom.sampling_params import SamplingParams, StructuredOutputsParams as Spec

EOS = 256
VOCAB = 264  # a few ids past the tokenizer's, as a model's padded vocabulary has


def byte_tokenizer_json() -> str:
    """tokenizer.json of a byte-level BPE without merges: id b = byte b, <eos> = 256."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok.to_str()


def make_scheduler(*, num_blocks: int = 32, spec_tokens: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                             num_speculative_tokens=spec_tokens)
    manager = StructuredOutputManager(vocab_size=VOCAB, eos_token_ids=(EOS,),
                                      load_tokenizer_json=byte_tokenizer_json)
    return Scheduler(config, BlockManager(num_blocks, 4), eos_token_ids=(EOS,),
                     structured=manager)


def make_seq(spec: Spec | None, *, request_id: str = "r", prompt_len: int = 5) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)),
                    SamplingParams(max_tokens=16, structured_outputs=spec))


def wait_compiled(sched: Scheduler, seq: Sequence) -> None:
    """Block until ``seq``'s compile has finished (its future), not a sleep."""
    sched.structured._pending[seq.seq_id][0].exception(timeout=60)


def allowed(mask: np.ndarray) -> list[str | int]:
    ids = np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB])[0]
    return [EOS if i == EOS else chr(i) for i in ids]


def step(sched: Scheduler, tokens: dict[int, int]):
    """One step emitting ``tokens`` (seq_id -> token) for the sampled sequences (after the
    grammars ready, as ``EngineCore.step``)."""
    sched.queue_ready_grammars()
    out = sched.schedule()
    sampled = {s.seq_id for s in out.sampled_seqs()}
    outputs = sched.update_from_output(out, ModelRunnerOutput.from_tokens(
        {i: t for i, t in tokens.items() if i in sampled}))
    return out, outputs


# ----- the params and the grammar check -----

@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"choice": []}, "choice is invalid"),
    ({"choice": ["a", 3]}, "choice is invalid"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": "[1, 2]"}, "json must be a JSON schema"),
    ({"grammar": "  "}, "grammar is invalid"),
])
def test_structured_outputs_params_need_exactly_one_well_formed_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Spec(**fields)


def test_sampling_params_take_a_dict_and_refuse_ignore_eos_and_min_tokens():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == Spec(choice=["a", "b"])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert wire.structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs is invalid"):
        SamplingParams(structured_outputs={"choices": ["a"]})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=Spec(regex="a"))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=Spec(regex="a"))


@pytest.mark.parametrize("spec, message", [
    (Spec(regex="[a-z"), "structured_outputs.regex: .*unclosed character class"),
    (Spec(json={"type": "strin"}), "structured_outputs.json: .*strin"),
    (Spec(grammar="root ::= undefined_rule"), "structured_outputs.grammar: .*undefined_rule"),
])
def test_grammar_error_names_the_field_and_the_problem(spec, message):
    error = grammar_error(spec)
    assert error is not None
    assert __import__("re").search(message, error, flags=__import__("re").S), error


def test_valid_specs_have_no_grammar_error():
    for spec in (Spec(json={"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}),
                 Spec(json='{"type": "array"}'), Spec(json_object=True), Spec(regex=r"\d+"),
                 Spec(choice=["yes", "no"]), Spec(grammar='root ::= "a" | "b" root')):
        assert grammar_error(spec) is None, spec


# ----- the scheduler's side -----

def test_a_constrained_sequence_waits_for_its_grammar_then_its_tokens_are_masked():
    sched = make_scheduler()
    free = make_seq(None, request_id="free")
    seq = make_seq(Spec(choice=["ab", "cd"]))
    sched.add(free)
    sched.add(seq)
    assert seq.status is SequenceStatus.WAITING_FOR_GRAMMAR and seq not in sched.waiting
    assert sched.has_unfinished()
    wait_compiled(sched, seq)
    out, _ = step(sched, {free.seq_id: 7, seq.seq_id: ord("c")})
    assert [s for s, _ in out.scheduled] == [free, seq]  # the free one was not held back
    assert list(out.grammar_bitmask) == [seq.seq_id]  # the unconstrained one has no mask
    assert allowed(out.grammar_bitmask[seq.seq_id]) == ["a", "c"]
    out, _ = step(sched, {free.seq_id: 7, seq.seq_id: ord("d")})
    assert allowed(out.grammar_bitmask[seq.seq_id]) == ["d"]
    out, outputs = step(sched, {free.seq_id: 7, seq.seq_id: EOS})
    assert allowed(out.grammar_bitmask[seq.seq_id]) == [EOS]
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == [99, 100, EOS]
    assert seq.seq_id not in sched.structured._matchers  # released at the finish


def test_a_token_the_grammar_refuses_finishes_the_sequence_with_error():
    sched = make_scheduler()
    seq = make_seq(Spec(regex="[0-9]+"))
    sched.add(seq)
    wait_compiled(sched, seq)
    _, outputs = step(sched, {seq.seq_id: ord("x")})  # a worker that ignored the mask
    assert seq.finish_reason is FinishReason.ERROR
    assert "does not match the grammar" in outputs[-1].error


def test_a_grammar_that_does_not_compile_fails_its_request_at_the_next_step():
    sched = make_scheduler()
    seq = make_seq(Spec(regex="[a-z"))  # the front end's check bypassed
    sched.add(seq)
    wait_compiled(sched, seq)
    out, outputs = step(sched, {})
    assert out.failed == [seq] and not out.scheduled
    assert seq.finish_reason is FinishReason.ERROR and "does not compile" in seq.error_message
    assert [o.finish_reason for o in outputs] == ["error"]
    assert not sched.has_unfinished()


def test_compiled_grammars_are_cached_by_spec():
    sched = make_scheduler()
    seqs = [make_seq(Spec(json={"type": "object", "properties": {"k": {"type": "integer"}}}),
                     request_id=str(i)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert sched.structured.num_compiles == 1
    wait_compiled(sched, seqs[0])
    out, _ = step(sched, {s.seq_id: ord("{") for s in seqs})
    assert len(out.grammar_bitmask) == 3


def test_abort_while_compiling_forgets_the_sequence():
    sched = make_scheduler()
    seq = make_seq(Spec(choice=["a"]))
    sched.add(seq)
    sched.finish(seq, FinishReason.ABORT)
    assert not sched.waiting_for_grammar and not sched.has_unfinished()
    assert seq.seq_id not in sched.structured._pending


def test_preemption_keeps_the_matcher_where_the_tokens_are():
    sched = make_scheduler(num_blocks=4)  # 16 slots: the two sequences' decodes soon collide
    other = make_seq(None, request_id="other", prompt_len=4)
    seq = make_seq(Spec(regex="abcdefghij"), prompt_len=4)  # the newest: the one preempted
    sched.add(other)
    sched.add(seq)
    wait_compiled(sched, seq)
    letters = iter("abcdefghij")
    for _ in range(8):
        step(sched, {seq.seq_id: ord(next(letters)), other.seq_id: 5})
        if seq.num_preemptions:
            break
    assert seq.num_preemptions == 1 and seq.status is SequenceStatus.WAITING
    num_before = seq.num_output_tokens
    sched.finish(other, FinishReason.ABORT)
    sched.queue_ready_grammars()
    out = sched.schedule()  # re-admitted: recomputes its tokens, then samples the next letter
    assert seq.num_output_tokens == num_before
    assert allowed(out.grammar_bitmask[seq.seq_id]) == [chr(ord("a") + num_before)]


def test_a_resumed_request_consumes_its_tokens_before_its_first_mask():
    sched = make_scheduler()
    seq = make_seq(Spec(choice=["abc", "abd"]))
    seq.token_ids += [ord("a"), ord("b")]  # what Scheduler.resume gives it
    sched.add(seq)
    wait_compiled(sched, seq)
    sched.queue_ready_grammars()
    out = sched.schedule()
    assert allowed(out.grammar_bitmask[seq.seq_id]) == ["c", "d"]


def test_resumed_tokens_that_break_the_grammar_fail_the_request():
    sched = make_scheduler()
    seq = make_seq(Spec(choice=["abc"]))
    seq.token_ids += [ord("x")]
    sched.add(seq)
    wait_compiled(sched, seq)
    out, _ = step(sched, {})
    assert out.failed == [seq] and "do not match the grammar" in seq.error_message


def test_constrained_sequences_get_no_draft_slots():
    sched = make_scheduler(spec_tokens=3)
    seq = make_seq(Spec(regex="[a-z]+"))
    free = make_seq(None, request_id="free")
    sched.add(seq)
    sched.add(free)
    wait_compiled(sched, seq)
    step(sched, {seq.seq_id: ord("a"), free.seq_id: 7})
    out = sched.schedule()
    assert free.seq_id in out.spec_budget and seq.seq_id not in out.spec_budget
    assert seq.seq_id in out.grammar_bitmask


def test_a_ready_grammar_joins_the_queue_only_between_steps_so_the_dry_run_stays_exact():
    sched = make_scheduler()
    seq = make_seq(Spec(choice=["a"]))
    sched.add(seq)
    wait_compiled(sched, seq)
    preview = sched.preview_admission()
    out = sched.schedule()  # compiled, but not queued yet: what the dry run said
    assert preview.num_prefills == 0 and not out.scheduled
    sched.queue_ready_grammars()
    assert sched.preview_admission().num_prefills == 1
    assert [s for s, _ in sched.schedule().scheduled] == [seq]
