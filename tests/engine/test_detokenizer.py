"""IncrementalDetokenizer with the embedded model's real tokenizer (no model weights needed).

Token ids are fed one at a time, as the engine does: pieces never carry half a UTF-8 character,
stop strings are found across token boundaries, and every text a running sequence shows is a
prefix of its final text.
"""

from __future__ import annotations

import pytest

from atom.engine.detokenizer import IncrementalDetokenizer

EMOJI_CJK = "🐱🐶 中文字符 日本語のテキスト 🎉 and 한국어!"
PLAIN = " Hello world, stop here please. Then more text follows."


@pytest.fixture(scope="module")
def tokenizer():
    from atom.worker.model_files import load_tokenizer

    return load_tokenizer(None)


def _detok(tokenizer, stop=(), include=False, skip_special=True, min_tokens=0):
    return IncrementalDetokenizer(tokenizer.backend_tokenizer, stop=list(stop),
                                  include_stop_str_in_output=include,
                                  skip_special_tokens=skip_special, min_tokens=min_tokens)


def _feed(detok, ids):
    """Feed ids; returns (streamed deltas of safe_text, index of the token that stopped or None)."""
    deltas, shown, stop_at = [], "", None
    for i, token_id in enumerate(ids):
        if detok.add_token(token_id) is not None:
            stop_at = i
        safe = detok.safe_text()
        assert safe.startswith(shown), "a shown text was taken back"
        deltas.append(safe[len(shown):])
        shown = safe
        if stop_at is not None:
            break
    return deltas, stop_at


def test_emoji_and_cjk_never_yield_half_characters(tokenizer):
    ids = tokenizer.encode(EMOJI_CJK, add_special_tokens=False)
    # the test means something only if some characters are split across tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = _detok(tokenizer)
    deltas, _ = _feed(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == EMOJI_CJK


def test_spaces_kept_and_text_matches_batch_decode(tokenizer):
    ids = tokenizer.encode(PLAIN, add_special_tokens=False)
    detok = _detok(tokenizer)
    deltas, _ = _feed(detok, ids)
    assert deltas[0] == " Hello"
    assert "".join(deltas) == tokenizer.decode(ids) == PLAIN


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_three_tokens(tokenizer, include):
    ids = tokenizer.encode(PLAIN, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert pieces[1:4] == [" world", ",", " stop"]
    stop = "d, st"  # ends inside " world", covers ",", starts " stop": three tokens
    detok = _detok(tokenizer, stop=[stop], include=include)
    deltas, stop_at = _feed(detok, ids)
    assert stop_at == 3 and detok.stop_reason == stop
    expected = " Hello world, st" if include else " Hello worl"
    assert detok.text == "".join(deltas) == expected
    assert detok.add_token(ids[4]) is None and detok.text == expected  # nothing after a stop


def test_running_text_holds_back_a_possible_stop_prefix(tokenizer):
    ids = tokenizer.encode(PLAIN, add_special_tokens=False)
    detok = _detok(tokenizer, stop=["never appears"])
    for t in ids[:3]:
        detok.add_token(t)
    hold = len("never appears") - 1
    assert detok.text == " Hello world,"
    assert detok.safe_text() == detok.text[: len(detok.text) - hold]
    deltas, stop_at = _feed(detok, ids[3:])
    assert stop_at is None
    # a finished sequence shows all its text (the engine uses .text then)
    assert detok.text == PLAIN


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode(PLAIN, add_special_tokens=False)
    detok = _detok(tokenizer, stop=["please", "stop"])
    _, stop_at = _feed(detok, ids)
    assert detok.stop_reason == "stop" and detok.text == " Hello world, "
    assert stop_at == 3


def test_stop_string_across_a_split_character(tokenizer):
    ids = tokenizer.encode(EMOJI_CJK, add_special_tokens=False)
    detok = _detok(tokenizer, stop=["🐶 中"])
    deltas, stop_at = _feed(detok, ids)
    assert detok.text == "".join(deltas) == "🐱"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode(PLAIN, add_special_tokens=False)  # " Hello" is token 0
    early = _detok(tokenizer, stop=["Hello", "please"], min_tokens=0)
    _feed(early, ids)
    assert early.stop_reason == "Hello"
    late = _detok(tokenizer, stop=["Hello", "please"], min_tokens=2)
    _feed(late, ids)
    assert late.stop_reason == "please" and late.text == " Hello world, stop here "


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [eos]
    skipped, kept = _detok(tokenizer), _detok(tokenizer, skip_special=False)
    _feed(skipped, ids)
    _feed(kept, ids)
    assert skipped.text == "Hi"
    assert kept.text == "Hi" + tokenizer.eos_token
