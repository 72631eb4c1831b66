"""A sequence's per-step output on the wire (:class:`~atom.messages.SeqOutput`), built from its
state: the one place that decides what a step reports of a sequence (the scheduler's
``update_from_output``, and the engine core for finishes decided outside a step)."""

from __future__ import annotations

from atom.core.sequence import FinishReason, Sequence
from atom.messages import SeqOutput


def seq_output(seq: Sequence, new_token_ids: list[int],
               new_logprobs: list[dict[int, float]] | None) -> SeqOutput:
    """``seq``'s output for a step that gave it ``new_token_ids`` (already appended to
    ``seq.token_ids``) with their logprobs entries (None: not asked for). Choice 0 sends the
    request's prompt logprobs with its first output token; a finished producer prefill sends
    its ``kv_transfer_params``."""
    send_prompt_logprobs = seq.index == 0 and seq.num_output_tokens == len(new_token_ids)
    return SeqOutput(
        request_id=seq.request_id, index=seq.index, new_token_ids=new_token_ids,
        new_logprobs=new_logprobs, cumulative_logprob=seq.cumulative_logprob,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        stop_reason=seq.stop_reason, error=seq.error_message,
        num_cached_tokens=seq.num_cached_tokens, num_prompt_tokens=seq.num_prompt_tokens,
        prompt_logprobs=seq.prompt_logprobs if send_prompt_logprobs else None,
        kv_transfer_params=seq.kv_transfer_params if seq.is_finished else None)


def finish_output(seq: Sequence, *, reason: FinishReason | None = None,
                  error: str | None = None) -> SeqOutput:
    """A finish with no new token (rejected, cut by the KV pool, a failed pull). ``reason``
    and ``error`` default to the sequence's own (given for a request the scheduler never
    registered: a duplicate id)."""
    reason = seq.finish_reason if reason is None else reason
    return SeqOutput(request_id=seq.request_id, index=seq.index, new_token_ids=[],
                     cumulative_logprob=seq.cumulative_logprob,
                     finish_reason=None if reason is None else reason.value,
                     stop_reason=seq.stop_reason,
                     error=seq.error_message if error is None else error,
                     num_cached_tokens=seq.num_cached_tokens,
                     num_prompt_tokens=seq.num_prompt_tokens)
