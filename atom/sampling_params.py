"""Sampling parameters of one request (vLLM's names and meanings).

A msgspec struct, so that the very object a user builds is what travels to the engine core
(:class:`atom.messages.EngineCoreRequest`): one definition of the concept. Decoding it runs
``__post_init__`` again, which is the core boundary's check. Imports no torch.
"""

from __future__ import annotations

import json

import msgspec

_MAX_LOGPROBS = 20
_MIN_TEMPERATURE = 1e-5  # below this, temperature sampling is greedy (vLLM's _SAMPLING_EPS)


class StructuredOutputsParams(msgspec.Struct):
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one field set.

    The grammar is compiled per request in the engine core (:mod:`atom.core.structured_output`,
    llguidance) and masks every sampled token; the output ends with EOS once the grammar is
    complete. Only shapes are checked here; whether the schema, regex or grammar compiles is
    checked at the API boundary (:func:`atom.core.structured_output.grammar_error`).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is a JSON value it accepts.
        json_object: True: the output is any JSON object (OpenAI's ``json_object``).
        regex: the output matches this regular expression (Rust ``regex`` syntax).
        choice: the output is exactly one of these strings.
        grammar: the output matches this grammar (EBNF / GBNF as llama.cpp, or Lark).
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in _STRUCTURED_KINDS
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of "
                             f"{', '.join(_STRUCTURED_KINDS)}; got {kinds or 'none'}")
        if isinstance(self.json, str):
            try:
                decoded = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {exc}") from None
            if not isinstance(decoded, dict):
                raise ValueError("StructuredOutputsParams.json must be a JSON schema (an object)")
        _check_kind(self.json is None or isinstance(self.json, (dict, str)), "json",
                    "a JSON schema (a dict or its JSON text)")
        _check_kind(self.json_object in (None, True, False), "json_object", "true")
        _check_kind(self.regex is None or (isinstance(self.regex, str) and self.regex), "regex",
                    "a non-empty string")
        _check_kind(self.choice is None or (isinstance(self.choice, list) and self.choice and all(
            isinstance(c, str) and c for c in self.choice)), "choice",
            "a non-empty list of non-empty strings")
        _check_kind(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
                    "grammar", "a non-empty grammar (EBNF or Lark)")

    @property
    def kind(self) -> str:
        """The field that is set (``json``, ``json_object``, ``regex``, ``choice`` or
        ``grammar``)."""
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _check_kind(ok: bool, name: str, allowed: str) -> None:
    if not ok:
        raise ValueError(f"StructuredOutputsParams.{name} is invalid: must be {allowed}")


class SamplingParams(msgspec.Struct):
    """How to sample the output tokens of one request.

    Every field is implemented; invalid values raise ``ValueError`` naming the field and the
    allowed range (from ``__post_init__``), so a bad request fails before it reaches the engine.

    Attributes:
        n: number of output sequences (choices) per prompt; they share the prompt's KV blocks.
        temperature: 0 (or below 1e-5, where dividing would overflow) means greedy; otherwise
            logits are divided by it.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` × the top probability.
        presence_penalty / frequency_penalty: OpenAI penalties over output tokens, in [-2, 2].
        repetition_penalty: CTRL-style penalty over prompt and output tokens, > 0 (1 = off).
        max_tokens: output tokens to generate at most (None = up to max_model_len).
        min_tokens: output tokens before EOS / stop ids / stop strings may end the sequence.
        stop: strings that end the output when they appear in the text.
        stop_token_ids: token ids that end the output (besides EOS).
        include_stop_str_in_output: keep a matched stop string in the text.
        ignore_eos: keep generating after EOS.
        seed: per-request random seed; a seeded request's tokens do not depend on batch-mates.
        logprobs: per output token, return the logprobs (raw model distribution, before any
            processing) of the ``logprobs`` most likely tokens plus the sampled token when it is
            not among them (``logprobs`` or ``logprobs + 1`` entries, as in vLLM); 0 = the
            sampled token only.
        prompt_logprobs: the same per prompt token (the first has none), with the prompt token
            in place of the sampled one. Such requests bypass the prefix cache.
        skip_special_tokens: drop special tokens from the detokenized text.
        logit_bias: token id → bias added to its logit before sampling.
        structured_outputs: a JSON schema, JSON object, regex, choice or grammar the output
            must match (:class:`StructuredOutputsParams`; None = free text). Such a sequence
            never speculates (no drafts: each token is masked by its grammar first), and cannot
            be combined with ``ignore_eos`` or ``min_tokens`` (the grammar's end is EOS).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = {}
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # normalize what may come in another shape; a wrong type stays for its check below
        # (a ValueError naming the field, never a TypeError from a conversion)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is None:
            self.logit_bias = {}
        _check(isinstance(self.logit_bias, dict)
               and all(_is_int(k) or (isinstance(k, str) and k.lstrip("-").isdigit())
                       for k in self.logit_bias)
               and all(_is_real(v) for v in self.logit_bias.values()), "logit_bias",
               self.logit_bias, "a map of token ids to numbers")
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check(_is_real(getattr(self, name)), name, getattr(self, name), "a number")
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
               "top_k", self.top_k, "-1, 0 (both disable) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "None or an integer >= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               "min_tokens", self.min_tokens, "an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a string or a list of non-empty strings")
        _check(isinstance(self.stop_token_ids, list)
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= _MAX_LOGPROBS),
                   name, value, f"None or an integer in [0, {_MAX_LOGPROBS}]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed,
               "None or an integer")
        if isinstance(self.structured_outputs, dict):  # as vLLM accepts it
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise ValueError(f"SamplingParams.structured_outputs is invalid: {exc}") from None
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "None or StructuredOutputsParams")
        if self.structured_outputs is not None:
            _check(not self.ignore_eos, "ignore_eos", self.ignore_eos,
                   "False with structured_outputs (a complete output ends with EOS)")
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens,
                   "0 with structured_outputs (the grammar decides the length)")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _MIN_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """An int or float that is not a bool (NaN included: the range checks refuse it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")
