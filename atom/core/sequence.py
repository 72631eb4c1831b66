"""Per-request state for one generated sequence.

A :class:`Sequence` is the unit the scheduler and the block manager work on. Only the scheduler
mutates it (status, ``num_computed_tokens``, appended tokens and their summed logprob, drafts,
finish fields, a resumed or P/D consumer request's first tokens); the block manager owns
``block_table`` and ``block_hashes``; the engine core and the model runner only read it. Torch-free on purpose.

Token bookkeeping (vLLM v1 vocabulary)::

    token_ids            = prompt tokens + output tokens
    num_computed_tokens  = how many of token_ids already have KV in the cache
    num_new_tokens       = what the scheduler asks the model to compute this step
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from atom.messages import KVTransferParams
from atom.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # P/D consumer: blocks allocated, the prompt's KV being pulled from a producer (atom.core.kv_connector)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    # structured outputs: its grammar compiling off the step loop (vLLM's WAITING_FOR_FSM;
    # atom.core.structured_output); outside the waiting queue until it is ready
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the request can never run (too long, bad input)


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sequence of one request (a request with ``n > 1`` owns ``n`` sequences).

    Attributes:
        request_id: the request this sequence belongs to.
        token_ids: prompt tokens followed by output tokens (ints, vocabulary ids).
        num_prompt_tokens: length of the prompt in tokens (default: all of ``token_ids``; a
            harness that times the model runner alone passes fewer to build a decode).
        sampling_params: the request's sampling parameters.
        index: the choice index within the request (0 .. n-1).
        arrival_time_s: ``time.monotonic()`` when the request arrived (set by the engine).
    """

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    index: int = 0
    arrival_time_s: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    num_prompt_tokens: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # the block tables of KV cache groups 1.. (hybrid models: gpt-oss's sliding layers), owned
    # by the block manager; a sliding group's blocks no future query sees are None
    group_block_tables: list[list[int | None]] = field(default_factory=list)
    # chained prefix-cache hashes of the leading full blocks of token_ids, filled lazily by the
    # block manager (which owns them, like block_table); valid for life: full blocks never change
    block_hashes: list[int] = field(default_factory=list)
    # number of prompt tokens whose KV came from the prefix cache at the last admission
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # the scheduler's step count when this sequence last entered the waiting queue (arrival or
    # preemption): waiting ages are counted in steps, never in wall time
    waiting_since_step: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error_message: str | None = None
    # summed raw logprob of the output tokens (a resumed sequence starts from its earlier sum)
    cumulative_logprob: float = 0.0
    # speculative decoding: draft tokens proposed for this step's verify forward (after the
    # last token, positions len(token_ids) ...); never part of token_ids until accepted, so they
    # never reach the prefix cache; set and cleared by the scheduler within one step
    spec_token_ids: list[int] = field(default_factory=list)
    # P/D only (atom.core.kv_connector): the request's params; on a producer, replaced at the finish
    # by the params a consumer needs
    kv_transfer_params: KVTransferParams | None = None
    # choice 0 of a request that asked for prompt logprobs: one entry per prompt token
    # ({token_id: logprob}; None for token 0 and until computed), sent once with the first
    # sampled token; None otherwise
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.token_ids)
        elif not 0 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens={self.num_prompt_tokens} must be in "
                             f"[0, {len(self.token_ids)}] (the length of token_ids)")
        if self.index == 0 and self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while some prompt (or recomputed) tokens still lack KV.

        After preemption the output tokens produced so far are recomputed as part of the
        "prefill", so this compares against all tokens but the last one. A sequence that is
        mid-chunk is a prefill, never a decode (ATOM #1318): with one prompt token left
        (``num_computed_tokens == len - 1`` before any output token exists, e.g. after a chunk or
        a prefix-cache hit) it is still a prefill, hence the comparison with the prompt length.
        """
        # two comparisons rather than max(): this runs several times per sequence per step
        n = self.num_computed_tokens
        return n < self.num_prompt_tokens or n < len(self.token_ids) - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def samples_next_token(self, num_new_tokens: int) -> bool:
        """Whether a step that computes ``num_new_tokens`` more tokens (from
        ``num_computed_tokens``; a verify's drafts included) reaches the last token, so that it
        samples the next one: every decode, a prefill's last chunk, never a chunk mid-prompt.
        The one rule of ``SchedulerOutput.sampled_seqs``, the model runner's sampled rows and
        the simulator's cost model; read before the scheduler's ``update_from_output``."""
        return self.num_computed_tokens + num_new_tokens >= len(self.token_ids)
