"""The output side on the real embedded model (fp32): streaming text, emoji/CJK, stop strings
and stop token ids, seeded sampling and n > 1, logprobs and prompt logprobs against
transformers, the progress bar and chat.

One LLM serves the whole module; greedy runs compare within the module, so a rounding tie
between runs that see different batch shapes could flip a token (none observed).
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.outputs import RequestOutput


EMOJI_CJK_REQUEST = "Please repeat this text exactly: 😀😃 猫と犬 🐱🐶 中文字符"


@pytest.fixture(scope="module")
def llm():
    with LLM(dtype="float32", num_kv_blocks=64, max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def _chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.apply_chat_template([{"role": "user", "content": question}])
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _step_through(llm: LLM, request_id: str, prompt_ids: list[int], params: SamplingParams):
    """Drive the engine step by step; returns (outputs of the request, stats right after it finished)."""
    engine = llm.engine
    engine.add_request(request_id, prompt_ids, params)
    outputs: list[RequestOutput] = []
    while not outputs or not outputs[-1].finished:
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs, engine.get_stats()


def _deltas(outputs: list[RequestOutput]) -> list[str]:
    """New text per output; asserts every shown text extends the previous one."""
    shown, deltas = "", []
    for out in outputs:
        text = out.outputs[0].text
        assert text.startswith(shown), f"streamed text went back: {shown!r} -> {text!r}"
        deltas.append(text[len(shown):])
        shown = text
    return deltas


# ----- streaming -----

@pytest.mark.parametrize("stop", [[], ["this string never appears"]])
def test_streamed_text_equals_final_text(llm, tokenizer, stop):
    prompt = _chat_ids(llm, "Write one sentence about the sea.")
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=stop)
    outputs, _ = _step_through(llm, f"stream-{len(stop)}", prompt, params)
    assert len(outputs) > 3 and not any(o.finished for o in outputs[:-1])
    final = outputs[-1].outputs[0]
    (batch,) = llm.generate({"prompt_token_ids": prompt}, params)
    assert "".join(_deltas(outputs)) == final.text == batch.outputs[0].text
    assert final.token_ids == batch.outputs[0].token_ids
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert "".join(llm.stream({"prompt_token_ids": prompt}, params)) == final.text


def test_emoji_and_cjk_answer_never_streams_a_replacement_char(llm, tokenizer):
    prompt = _chat_ids(llm, EMOJI_CJK_REQUEST)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outputs, _ = _step_through(llm, "emoji", prompt, params)
    token_ids = outputs[-1].outputs[0].token_ids
    # meaningful only if the answer really has characters split across tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    deltas = _deltas(outputs)
    assert all("\ufffd" not in d for d in deltas)
    text = "".join(deltas)
    assert any(ch in text for ch in "😀😃🐱🐶") and any(ch in text for ch in "猫犬中文字符")
    pieces = list(llm.stream({"prompt_token_ids": prompt}, params))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


# ----- stop strings and stop token ids -----

@pytest.fixture(scope="module")
def plain_run(llm, tokenizer):
    """A greedy reference run (ids, tokens, text, per-token pieces) for the stop tests."""
    prompt = _chat_ids(llm, "Tell me about the history of the city of Rome in a few sentences.")
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16))
    tokens = out.outputs[0].token_ids
    return prompt, tokens, out.outputs[0].text, [tokenizer.decode([t]) for t in tokens]


def _three_token_stop(tokens: list[int], text: str, pieces: list[str]) -> tuple[str, int]:
    """A stop string that starts in token i, covers token i+1 and ends in token i+2; returns (stop, i)."""
    for i in range(2, len(tokens) - 3):
        if not all(p.isascii() for p in pieces[: i + 3]):
            break  # offsets below assume one piece per token
        a, b, c = pieces[i: i + 3]
        if not (a.strip() and b and c.strip()):
            continue
        stop = a[-1] + b + c[: len(c) - len(c.lstrip()) + 1]  # up to c's first visible char
        if text.find(stop) == len("".join(pieces[: i + 1])) - 1:  # its first occurrence
            return stop, i
    raise AssertionError(f"no usable three-token stop string in {pieces}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_three_tokens(llm, plain_run, include):
    prompt, tokens, text, pieces = plain_run
    stop, i = _three_token_stop(tokens, text, pieces)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], include_stop_str_in_output=include)
    outputs, stats = _step_through(llm, f"stop-str-{include}", prompt, params)
    final = outputs[-1].outputs[0]
    idx = text.find(stop)
    assert final.token_ids == tokens[: i + 3]  # generation ended on the token completing it
    assert final.text == (text[: idx + len(stop)] if include else text[:idx])
    assert "".join(_deltas(outputs)) == final.text
    assert final.finish_reason == "stop" and final.stop_reason == stop
    # the stop was found outside the scheduler: the sequence's KV is free at once
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_stop_token_id(llm, plain_run, tokenizer):
    prompt, tokens, _, _ = plain_run
    j = next(j for j in range(3, len(tokens)) if tokens[j] not in tokens[:j])
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokens[j]]))
    final = out.outputs[0]
    assert final.token_ids == tokens[: j + 1]
    assert final.finish_reason == "stop" and final.stop_reason == tokens[j]
    assert final.text == tokenizer.decode(tokens[:j])  # the stop token's text is left out (vLLM)


def test_metrics(llm, plain_run):
    prompt = plain_run[0]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=4))
    m = out.metrics
    assert m.arrival_time_s <= m.first_token_time_s <= m.finished_time_s
    assert m.num_output_tokens == 4 and m.ttft_s >= 0 and m.tpot_s >= 0


# ----- seeded sampling and n > 1 -----

def test_seed_gives_the_same_tokens_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8)
    prompt = "Once upon a time"
    (alone,) = llm.generate(prompt, params)
    (again,) = llm.generate(prompt, params)
    others = [f"Sentence number {i} is about" for i in range(16)]
    batch = llm.generate(others[:7] + [prompt] + others[7:],
                         [SamplingParams(temperature=1.0, max_tokens=8)] * 7 + [params]
                         + [SamplingParams(temperature=1.0, max_tokens=8)] * 9)
    assert alone.outputs[0].token_ids == again.outputs[0].token_ids == batch[7].outputs[0].token_ids
    (other_seed,) = llm.generate(prompt, SamplingParams(temperature=1.0, seed=4321, max_tokens=8))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n3_gives_three_reproducible_continuations_sharing_prefix_blocks(llm):
    prompt = _chat_ids(llm, "Invent a name for a new fruit and describe its taste in one line.")
    assert len(prompt) > 2 * 16
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    hits_before = llm.get_stats()["prefix_cache_hits"]
    (first,) = llm.generate({"prompt_token_ids": prompt}, params)
    hits = llm.get_stats()["prefix_cache_hits"] - hits_before
    # choices 1 and 2 find the prompt's full blocks computed by choice 0
    assert hits >= 2 * ((len(prompt) - 1) // 16 * 16)
    (second,) = llm.generate({"prompt_token_ids": prompt}, params)
    choices = [tuple(c.token_ids) for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len(set(choices)) == 3
    assert choices == [tuple(c.token_ids) for c in second.outputs]


# ----- logprobs against transformers -----

def test_logprobs_and_prompt_logprobs_match_transformers(llm, embedded_hf_model):
    hf_model = embedded_hf_model
    prompt = _chat_ids(llm, "What is the capital of Italy?")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=5)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    tokens = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)  # row p predicts token p + 1

    def check(entry: dict[int, float], row: int, token: int) -> None:
        assert token in entry
        for token_id, value in entry.items():
            assert abs(value - float(ref[row, token_id])) <= 1e-4, (row, token_id)
        ours_top = list(entry.values())[:5]  # the top 5 come first, in descending order
        ref_top = ref[row].topk(5).values.tolist()
        assert max(abs(a - b) for a, b in zip(ours_top, ref_top)) <= 1e-4

    assert len(out.outputs[0].logprobs) == len(tokens)
    for j, (entry, token) in enumerate(zip(out.outputs[0].logprobs, tokens)):
        assert len(entry) == 5  # greedy: the sampled token is in the top 5
        check(entry, len(prompt) - 1 + j, token)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(out.outputs[0].logprobs, tokens)), abs=1e-4)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for t in range(1, len(prompt)):
        assert len(plp[t]) in (5, 6)  # top 5, plus the prompt token when outside them
        check(plp[t], t - 1, prompt[t])


def test_sampled_token_outside_top_k_is_added(llm):
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=16, logprobs=1)
    (out,) = llm.generate("My favourite words are", params)
    entries = out.outputs[0].logprobs
    for entry, token in zip(entries, out.outputs[0].token_ids):
        assert token in entry and len(entry) in (1, 2)
        top_id = next(iter(entry))
        assert entry[top_id] == max(entry.values())
    assert any(len(e) == 2 for e in entries)


# ----- progress bar, chat -----

def test_progress_bar_shows_tokens_per_second(llm, capsys):
    llm.generate(["Hi", "Hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "output" in err and "tok/s" in err


def test_chat_applies_the_template(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    conv = [{"role": "user", "content": "Say hello."}]
    (one,) = llm.chat(conv, params)
    two = llm.chat([conv, [{"role": "user", "content": "Say bye."}]], params)
    assert one.prompt == llm.apply_chat_template(conv)
    assert one.prompt.rstrip().endswith("assistant")
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids


# ----- stream() lifecycle, request validation -----

def test_closing_a_stream_early_aborts_and_frees_kv(llm):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    pieces = llm.stream("Count from one to fifty:", params)
    first = next(pieces)
    assert first
    pieces.close()
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="n=1"):
        next(llm.stream("Hi", SamplingParams(n=2)))


def test_out_of_vocabulary_ids_in_params_fail_the_request_only(llm):
    vocab = len(llm.get_tokenizer())
    bad_stop, bad_bias, good = llm.generate(
        ["Hi"] * 3, [SamplingParams(stop_token_ids=[vocab + 5]),
                     SamplingParams(logit_bias={vocab: 1.0}),
                     SamplingParams(temperature=0.0, max_tokens=2)])
    assert bad_stop.outputs[0].finish_reason == "error" and "stop_token_ids" in bad_stop.outputs[0].error
    assert bad_bias.outputs[0].finish_reason == "error" and "logit_bias" in bad_bias.outputs[0].error
    assert good.outputs[0].finish_reason == "length"
