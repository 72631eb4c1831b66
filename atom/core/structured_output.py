"""Structured outputs on one rank: grammars compiled off the step loop, one token bitmask per
constrained sequence and step, matchers advanced by the accepted tokens. Torch-free.

The grammar library is llguidance (vLLM's ``guidance`` backend, SGLang's ``llguidance``), not
xgrammar: xgrammar 0.2.9's wheel requires ``triton`` on Linux x86-64 (a GPU compiler, hundreds
of MB, no use on a CPU engine) and ``torch`` unpinned; llguidance 1.9.1 has no dependencies,
imports no torch, and builds its token masks in Rust with the GIL released. It compiles lazily
(an Earley parser over a lexer built on demand), so "compiling" a JSON schema or a regex takes
about a millisecond; what is slow is wrapping the tokenizer's vocabulary (``LLTokenizer``:
seconds, once per engine core, on the first constrained request).

Lifecycle, vLLM v1's (``StructuredOutputManager``, ``WAITING_FOR_FSM``): the scheduler hands a
constrained sequence to :meth:`StructuredOutputManager.submit` when it arrives; the grammar is
compiled (cached by its spec) on this manager's one worker thread, never on the step loop, and
the sequence waits outside the waiting queue until :meth:`StructuredOutputManager.poll` says it
is ready (a matcher made, the tokens it already has consumed: a request resumed after a rank
failure keeps its constraint) or failed (the request finishes with ``error``). Each step,
:meth:`StructuredOutputManager.bitmask` gives the worker one int32 row per sampled constrained
sequence (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed; llguidance's layout), and
:meth:`StructuredOutputManager.accept` advances the matcher with each token the scheduler
appends: the scheduler is the matcher's one owner. A preempted sequence keeps its output tokens
(recompute), so its matcher stays valid. Constrained sequences never get drafts (the scheduler
reserves none): a draft would need a mask per position and a rollback on rejection.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from atom.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 256  # compiled grammars kept by spec (least recently used dropped)


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``spec`` (not yet checked: see :func:`grammar_error`).

    JSON schemas compile with llguidance's defaults but compact separators (no whitespace
    between tokens), so a small model cannot wander into endless blank lines."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec.choice)
    return llguidance.grammar_from("ebnf", spec.grammar)  # EBNF/GBNF, or Lark as it is


def grammar_error(spec: StructuredOutputsParams) -> str | None:
    """Why ``spec`` cannot be compiled (a schema feature llguidance refuses, a bad regex or
    grammar), in llguidance's words prefixed by the field; None when it compiles. Runs the
    front end's check (no tokenizer needed)."""
    import llguidance

    try:
        grammar = grammar_of(spec)
    except ValueError as exc:
        return f"structured_outputs.{spec.kind}: {exc}"
    message = llguidance.LLMatcher.validate_grammar(grammar)
    return f"structured_outputs.{spec.kind}: {message}" if message else None


def _spec_key(spec: StructuredOutputsParams) -> str:
    value = getattr(spec, spec.kind)
    return spec.kind + ":" + (value if isinstance(value, str) else json.dumps(value, sort_keys=True))


class StructuredOutputManager:
    """Compiles grammars and owns the matchers of one rank's constrained sequences.

    Owns a one-thread pool (started on first use), the cache of compiled grammars (by spec,
    least recently used dropped past 256) and, per sequence id, its compile future or its
    matcher. Called by the scheduler alone (one thread); the pool only compiles.

    Args:
        vocab_size: the model's vocabulary (logits width): the bitmask covers it.
        eos_token_ids: the tokens that end a complete output (the mask's only choice then).
        load_tokenizer_json: returns the tokenizer's ``tokenizer.json`` text (called once, on
            the pool's thread, at the first constrained request).
    """

    def __init__(self, *, vocab_size: int, eos_token_ids: tuple[int, ...],
                 load_tokenizer_json: Callable[[], str]):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._load_tokenizer_json = load_tokenizer_json
        self._tokenizer = None  # llguidance.LLTokenizer, built on the pool's thread
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._pending: dict[int, tuple[Future, list[int]]] = {}
        self._matchers: dict[int, object] = {}  # seq_id -> llguidance.LLMatcher
        self.num_compiles = 0  # grammars compiled (cache misses)

    # ----- compiling -----

    def submit(self, seq_id: int, spec: StructuredOutputsParams, output_token_ids: list[int]
               ) -> None:
        """Start (or reuse) the compile of ``spec`` for sequence ``seq_id``, whose matcher will
        consume ``output_token_ids`` first (a resumed request's tokens so far)."""
        key = _spec_key(spec)
        future = self._compiled.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            future = self._executor.submit(self._compile, spec)
            self._compiled[key] = future
            self.num_compiles += 1
            if len(self._compiled) > _MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        self._pending[seq_id] = (future, list(output_token_ids))

    def _compile(self, spec: StructuredOutputsParams):
        """On the pool's thread: a fresh matcher of ``spec`` (llguidance drops the GIL while
        it builds the grammar). Raises ValueError when the grammar does not compile."""
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._load_tokenizer_json(), n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: "
                             f"{matcher.get_error()}")
        return matcher

    def poll(self, seq_id: int) -> bool | str:
        """Whether sequence ``seq_id``'s grammar is ready: True (its matcher made, its tokens
        so far consumed), False (still compiling), or the error that ends its request."""
        future, token_ids = self._pending[seq_id]
        if not future.done():
            return False
        del self._pending[seq_id]
        error = future.exception()
        if error is not None:
            return str(error)
        matcher = future.result().deep_copy()
        if token_ids and not matcher.consume_tokens(token_ids):
            return f"the tokens generated so far do not match the grammar: {matcher.get_error()}"
        self._matchers[seq_id] = matcher
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until a pending compile finishes or ``timeout_s`` passes: a step with nothing
        but sequences waiting for their grammar waits here instead of spinning (the spinning
        loop would hold the GIL and a core from the compile it waits for)."""
        if self._pending:
            wait([future for future, _ in self._pending.values()], timeout=timeout_s,
                 return_when=FIRST_COMPLETED)

    # ----- the step -----

    def is_constrained(self, seq_id: int) -> bool:
        """Whether ``seq_id`` has a matcher (its grammar is ready)."""
        return seq_id in self._matchers

    def bitmask(self, seq_ids: list[int]) -> dict[int, np.ndarray]:
        """seq_id -> int32 ``[ceil(vocab / 32)]``: the tokens its grammar allows next, for the
        constrained ones among ``seq_ids`` (rows of one array)."""
        import llguidance.numpy as llg_np

        ids = [s for s in seq_ids if s in self._matchers]
        if not ids:
            return {}
        masks = llg_np.allocate_token_bitmask(len(ids), self.vocab_size)
        for row, seq_id in enumerate(ids):
            llg_np.fill_next_token_bitmask(self._matchers[seq_id], masks, row)
        return {seq_id: masks[row] for row, seq_id in enumerate(ids)}

    def accept(self, seq_id: int, token_id: int) -> str | None:
        """Advance ``seq_id``'s matcher by the token just appended; the error when the grammar
        refuses it (None: accepted, or the sequence is not constrained)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or matcher.consume_token(token_id):
            return None
        return f"token {token_id} does not match the grammar: {matcher.get_error()}"

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence (its compile may still run: the cache keeps it)."""
        self._pending.pop(seq_id, None)
        self._matchers.pop(seq_id, None)

    def close(self) -> None:
        """Stop the pool without waiting for a compile in progress. Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
