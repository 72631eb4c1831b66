"""What one forward step of a rank's worker returns to its scheduler (vLLM v1's
``ModelRunnerOutput``). Torch-free: plain ints, floats and dicts, so the scheduler, the engine
core and the simulator's cost-model worker share it without importing torch.

The step in three parts (docs/ARCHITECTURE.md, "One rank")::

    SchedulerOutput = Scheduler.schedule()            # which sequences, how many tokens each
    ModelRunnerOutput = worker.execute_model(...)      # forward, sampling, draft verification
    Scheduler.update_from_output(sched, output)        # tokens appended, stops, outputs

A worker only reads sequences; everything it found travels back in this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.core.kv_connector import KVConnectorOutput


@dataclass
class ModelRunnerOutput:
    """One step's results, per sampled sequence in batch order.

    Attributes:
        seq_ids: the sequences that sampled this step (those that reached their last token:
            :meth:`~atom.core.sequence.Sequence.samples_next_token`), in scheduled order.
        sampled_token_ids: per sequence, the tokens it emitted: one sampled token, or for a
            sequence that verified drafts the accepted drafts then one more (1 .. k + 1 ids).
            The scheduler appends them up to the first stop.
        sampled_logprobs: per sequence, the raw logprob (natural log, float) of each emitted
            token, for ``cumulative_logprob``; None when not computed (the simulator).
        logprobs: per sequence, per emitted token ``{token_id: logprob}`` (the top
            ``SamplingParams.logprobs`` and the emitted token), or None when the request did not
            ask for logprobs.
        prompt_logprobs: ``seq_id -> {target position p: {token_id: logprob}}`` for choice 0 of
            requests that asked for prompt logprobs: the entries of prompt token ``p`` computed
            this step (from the logits at ``p - 1``), only positions not filled before.
        kv_connector_output: what the P/D connector's worker side finished since the last
            step (None without a connector).
        execute_s: the step's forward and sampling time in seconds (measured by the torch
            worker, modelled by the simulator's).
    """

    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    sampled_logprobs: list[list[float]] | None = None
    logprobs: list[list[dict[int, float]] | None] | None = None
    prompt_logprobs: dict[int, dict[int, dict[int, float]]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    execute_s: float = 0.0

    @classmethod
    def from_tokens(cls, tokens: dict[int, int | list[int]], **kwargs) -> ModelRunnerOutput:
        """An output that emits ``tokens`` (seq_id → one token, or a verify's list) with no
        logprobs: the simulator's worker and the scheduler's unit tests."""
        return cls(seq_ids=list(tokens),
                   sampled_token_ids=[t if isinstance(t, list) else [t] for t in tokens.values()],
                   **kwargs)
