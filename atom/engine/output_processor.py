"""The front end's output side: turns an engine core's token-id outputs into RequestOutputs.

The engine core reports token ids only (:class:`~atom.messages.SeqOutput`); here each request
keeps its prompt, one :class:`~atom.engine.detokenizer.IncrementalDetokenizer` per choice, the tokens
and logprobs received so far and its metrics, and every core step becomes one
:class:`~atom.outputs.RequestOutput` per request that changed:

- while running, each choice's text is its safe text (a possible stop-string prefix held back),
  so every streamed text extends the previous one; at the finish it is the full text;
- a stop string is matched here, in the text (vLLM semantics, see :mod:`atom.engine.detokenizer`): the
  choice finishes with ``stop`` at once and its ``(request_id, index)`` is handed back so the
  caller sends :class:`~atom.messages.FinishRequests` to the core (which frees its KV blocks).
  Tokens the core produced for it in the meantime are dropped;
- the token that ended a sequence on EOS or a stop token id (``finish_reason="stop"`` from the
  core) is not fed to the detokenizer unless ``include_stop_str_in_output`` (vLLM); on the token
  that also hit ``max_tokens``, a stop string wins (vLLM checks it last, too).

Owns only front-end state; never talks to the core itself (the caller does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from atom.engine.detokenizer import IncrementalDetokenizer
import msgspec

from atom.messages import ResumedChoice, SeqOutput
from atom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from atom.sampling_params import SamplingParams


@dataclass
class _Choice:
    """What the front end knows of one sequence (choice) of a request."""

    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_resumes: int = 0  # rank failures this request was resumed after
    kv_transfer_params: object | None = None  # from a P/D producer's finish


@dataclass(frozen=True)
class ResumableRequest:
    """An unfinished request as a rank failure found it: what the front end sends again.

    Attributes:
        request_id, prompt_token_ids, arrival_time_s: as first sent.
        params: its sampling parameters (prompt logprobs dropped once they were received).
        choices: per choice, the output tokens received so far, their summed logprob, and
            whether it finished already.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time_s: float
    choices: list[ResumedChoice]


@dataclass
class ProcessedOutputs:
    """One core step, seen from the front end.

    Attributes:
        request_outputs: one per request that changed, in the order the core reported them;
            a finished request appears here for the last time.
        finish_seq_keys: ``(request_id, index)`` of choices a stop string just ended while the
            core may still run them: send them as ``FinishRequests``.
        stop_reasons: the matched stop string of each key.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    finish_seq_keys: list[tuple[str, int]] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)


class OutputProcessor:
    """Per-request output state of the front end.

    Args:
        tokenizer: a Hugging Face tokenizer (its ``backend_tokenizer`` decodes), or None
            (``skip_tokenizer_init``: outputs carry no text and stop strings are refused).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None, arrival_time_s: float) -> RequestOutput | None:
        """Start tracking a request.

        Returns None when the request may go to the core, or its final ``error`` output when
        the front end cannot serve it (then it is not tracked and must not be sent).

        Raises:
            ValueError: ``request_id`` is already in use.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id")
        state = _RequestState(
            request_id, prompt, list(prompt_token_ids), params,
            [_Choice(self._detokenizer(params)) for _ in range(params.n)],
            RequestMetrics(arrival_time_s=arrival_time_s),
            prompt_logprobs=[None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        if params.stop and self.tokenizer is None:
            message = "stop strings need the tokenizer (skip_tokenizer_init=True): use stop_token_ids"
            return self._finish_all(state, "error", error=message)
        self._requests[request_id] = state
        return None

    def set_dp_rank(self, request_id: str, dp_rank: int) -> None:
        """The DP rank the request was sent to (its outputs' ``metrics.dp_rank``); unknown
        ids are ignored."""
        state = self._requests.get(request_id)
        if state is not None:
            state.metrics.dp_rank = dp_rank

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer.backend_tokenizer, stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens,
                                      min_tokens=params.min_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """End a tracked request with ``error`` (e.g. it could not be sent); its final output,
        or None for an unknown id."""
        state = self._requests.pop(request_id, None)
        return None if state is None else self._finish_all(state, "error", error=message)

    def take_resumable(self, *, max_resumes: int) -> tuple[list[ResumableRequest],
                                                          list[RequestOutput]]:
        """Every unfinished request, after the ranks running them were lost: the ones to send
        again (their state stays here and goes on from where it stopped), and the final
        ``error`` outputs of those resumed ``max_resumes`` times already (a request that takes
        ranks down with it must not do it forever; they are no longer tracked).
        """
        resumable, failed = [], []
        for request_id in list(self._requests):
            state = self._requests[request_id]
            if state.num_resumes >= max_resumes:
                failed.append(self.fail_on_rank_failure(request_id, (
                    f"the request was in flight during {state.num_resumes + 1} rank failures "
                    f"and is not resumed again")))
                continue
            state.num_resumes += 1
            params = state.params
            if params.prompt_logprobs is not None and state.choices[0].token_ids:
                params = msgspec.structs.replace(params, prompt_logprobs=None)  # received
            resumable.append(ResumableRequest(
                request_id, state.prompt_token_ids, params, state.metrics.arrival_time_s,
                [ResumedChoice(list(c.token_ids), c.cumulative_logprob, c.finish_reason is not None)
                 for c in state.choices]))
        return resumable, failed

    def fail_on_rank_failure(self, request_id: str, message: str) -> RequestOutput:
        """End a tracked request with ``error`` because the ranks running it were lost; its
        final output says so in ``extra["rank_failure"]`` (the server answers 503, not 400)."""
        out = self.fail_request(request_id, message)
        assert out is not None, request_id
        out.extra["rank_failure"] = True
        return out

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request with ``abort`` here and now; returns its final output, or None for an
        unknown (or already finished) id. The caller tells the core (``AbortRequests``)."""
        state = self._requests.pop(request_id, None)
        return None if state is None else self._finish_all(state, "abort")

    def _finish_all(self, state: _RequestState, reason: str, *, error: str | None = None) -> RequestOutput:
        for choice in state.choices:
            if choice.finish_reason is None:
                choice.finish_reason, choice.error = reason, error
        return self._final_output(state)

    def process_outputs(self, seq_outputs: list[SeqOutput]) -> ProcessedOutputs:
        """Apply one core step's outputs. Outputs of unknown requests (aborted here, or
        finished) and of choices that already finished here are ignored."""
        result = ProcessedOutputs()
        touched: dict[str, _RequestState] = {}
        now = time.monotonic()
        for out in seq_outputs:
            state = self._requests.get(out.request_id)
            if state is None or not 0 <= out.index < len(state.choices):
                continue
            choice = state.choices[out.index]
            if choice.finish_reason is not None:
                continue  # a stop string ended it here; the core had not heard yet
            touched[out.request_id] = state
            if out.index == 0 and not choice.token_ids:  # the first admission's, not a resumed one's
                state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs = list(out.prompt_logprobs)
            if out.new_token_ids and state.metrics.first_token_time_s is None:
                state.metrics.first_token_time_s = now
            choice.cumulative_logprob = out.cumulative_logprob
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            stop = self._append_tokens(state, choice, out)
            if stop is None:
                choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
                choice.error = out.error
                continue
            choice.finish_reason, choice.stop_reason = "stop", stop
            if out.finish_reason is None:  # the core still runs it: have it freed
                result.finish_seq_keys.append((out.request_id, out.index))
                result.stop_reasons.append(stop)
        for request_id, state in touched.items():
            if all(c.finish_reason is not None for c in state.choices):
                del self._requests[request_id]
                result.request_outputs.append(self._final_output(state))
            else:
                result.request_outputs.append(self._make_output(state, finished=False))
        return result

    def _append_tokens(self, state: _RequestState, choice: _Choice, out: SeqOutput) -> str | None:
        """Add ``out``'s tokens to ``choice``; returns the stop string one of them completed
        (the tokens after it are dropped), else None. Leaves ``choice.finish_reason`` alone."""
        include_stop = state.params.include_stop_str_in_output
        for j, token_id in enumerate(out.new_token_ids):
            choice.token_ids.append(token_id)
            if out.new_logprobs is not None and state.params.logprobs is not None:
                choice.logprobs.append(out.new_logprobs[j])
            is_last = j == len(out.new_token_ids) - 1
            if choice.detokenizer is None or (is_last and out.finish_reason == "stop" and not include_stop):
                continue  # EOS / stop token id: its text is left out (vLLM)
            stop = choice.detokenizer.add_token(token_id)
            if stop is not None:
                return stop
        return None

    def _make_output(self, state: _RequestState, *, finished: bool) -> RequestOutput:
        completions = []
        for index, choice in enumerate(state.choices):
            detok = choice.detokenizer
            text = "" if detok is None else (detok.text if choice.finish_reason else detok.safe_text())
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=list(choice.token_ids),
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                logprobs=list(choice.logprobs) if state.params.logprobs is not None else None,
                cumulative_logprob=choice.cumulative_logprob, error=choice.error))
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=list(state.prompt_token_ids), outputs=completions,
                             finished=finished, num_cached_tokens=state.num_cached_tokens,
                             prompt_logprobs=(None if state.prompt_logprobs is None
                                              else list(state.prompt_logprobs)),
                             metrics=state.metrics, kv_transfer_params=state.kv_transfer_params)

    def _final_output(self, state: _RequestState) -> RequestOutput:
        state.metrics.finished_time_s = time.monotonic()
        state.metrics.num_output_tokens = max(len(c.token_ids) for c in state.choices)
        return self._make_output(state, finished=True)
