"""Request outputs returned by the offline API (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (``time.monotonic()`` seconds) and derived latencies,
    and the DP rank that ran it (``dp_rank``: the last one when a rank failure resumed it on
    another; 0 with one rank; None when it never reached a rank)."""

    arrival_time_s: float
    first_token_time_s: float | None = None
    finished_time_s: float | None = None
    num_output_tokens: int = 0
    dp_rank: int | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        if self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.arrival_time_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time_s is None or self.first_token_time_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time_s - self.first_token_time_s) / (self.num_output_tokens - 1)

    @property
    def e2e_latency_s(self) -> float | None:
        if self.finished_time_s is None:
            return None
        return self.finished_time_s - self.arrival_time_s


@dataclass
class CompletionOutput:
    """One choice of a request.

    Attributes:
        index: choice index (0 .. n-1).
        text: detokenized output ("" with skip_tokenizer_init). While the request runs it is
            the text so far minus a held-back tail that could start a stop string, so each
            streamed text extends the previous one and the last equals the final text.
        token_ids: output token ids.
        finish_reason: "stop", "length", "abort", "error" or None while running.
        stop_reason: the stop string or stop token id that ended it (None for EOS).
        logprobs: per output token, {token_id: logprob}: the top ``SamplingParams.logprobs``
            tokens in descending order, then the sampled token if it is not among them (raw
            model distribution; None unless requested).
        cumulative_logprob: sum of the sampled tokens' (raw) logprobs.
        error: why the request failed (finish_reason "error" only).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and one :class:`CompletionOutput` per choice.

    Attributes:
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token
            (``None`` for the first, and for positions not computed yet while running), shaped
            like ``CompletionOutput.logprobs`` with the prompt token in place of the sampled one.
        metrics: arrival, first-token and finish times; TTFT, TPOT and E2E latency.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # a P/D producer's finished prefill: where its KV is kept (atom.messages.KVTransferParams)
    kv_transfer_params: object | None = None
