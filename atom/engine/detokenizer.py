"""Incremental detokenization and stop-string matching for one sequence.

Text comes from ``tokenizers.decoders.DecodeStream``, which buffers tokens until they form
whole UTF-8 characters, so no piece ever carries half a character (no U+FFFD from splits) and
the spaces the tokenizer encodes are kept.

Stop strings are matched on the text across token boundaries (vLLM semantics: only once the
sequence has more than ``min_tokens`` output tokens; the earliest match wins). While a sequence
runs, the last ``max(len(stop)) - 1`` characters are held back from the streamed text, because
they may be the start of a stop string; a match always starts at or after the held-back part, so
every streamed text is a prefix of the final text.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text and finds stop strings.

    Owns the decoded text of one sequence; the engine feeds it every output token that should
    show in the text (a stop token id or EOS that ended the sequence is not fed unless
    ``include_stop_str_in_output``, as in vLLM).

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` backend of the model's tokenizer.
        stop: stop strings of the request.
        include_stop_str_in_output: keep a matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.
        min_tokens: stop strings are not looked for until more output tokens than this were added.
    """

    def __init__(self, tokenizer: Tokenizer, *, stop: list[str], include_stop_str_in_output: bool,
                 skip_special_tokens: bool, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded text so far (after a stop: cut at the stop string)
        self.stop_reason: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Decode one token. Returns the matched stop string if this token completed one."""
        if self.stop_reason is not None:
            return None
        self._num_tokens += 1
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self._hold)  # a match before here was found earlier
        self.text += piece
        if not self._stop or self._num_tokens <= self._min_tokens:
            return None
        matches = [(idx, stop) for stop in self._stop if (idx := self.text.find(stop, start)) != -1]
        if not matches:
            return None
        idx, stop = min(matches, key=lambda m: m[0])
        self.stop_reason = stop
        self.text = self.text[: idx + len(stop)] if self._include_stop else self.text[:idx]
        return stop

    def safe_text(self) -> str:
        """The text a running sequence may show: a possible stop-string prefix is held back."""
        if not self._stop or self.stop_reason is not None:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]
