"""Messages between the front end and EngineCore processes (msgspec msgpack; never pickle).

Front end → engine core (one ZMQ PUSH → PULL stream per core):
    :class:`EngineCoreRequest` (a resumed one carries :class:`ResumedChoice` s),
    :class:`AbortRequests`, :class:`FinishRequests`, :class:`UtilityCall`, :class:`StartWave`,
    :class:`Shutdown`.
Engine core → front end (PUSH → PULL, all cores into one socket):
    :class:`ReadyMessage` (carrying the :class:`EngineRuntime`), :class:`EngineCoreOutputs`,
    :class:`UtilityResult`, :class:`WaveWakeup` (DP only), :class:`Heartbeat` (from each
    core's heartbeat thread, on a socket of its own: :mod:`atom.engine.liveness`).

Token ids only cross the socket: tokenization, detokenization and stop strings live in the
front end (docs/ARCHITECTURE.md). One struct per concept: a request's sampling parameters travel
as the :class:`~atom.sampling_params.SamplingParams` the user built (a msgspec struct), and the
runtime values a core found at start-up as the :class:`EngineRuntime` the front end keeps.

Validation runs twice, once per boundary: at the API (``SamplingParams`` is checked when it is
built; the OpenAI server also runs :func:`check_token_ids` to answer 400) and at the core
(decoding a request re-runs ``SamplingParams.__post_init__``; the core runs
:func:`check_token_ids` against its vocabulary). This module imports no torch.
"""

from __future__ import annotations

import msgspec

from atom.sampling_params import SamplingParams


class EngineRuntime(msgspec.Struct, frozen=True):
    """Values a core found at start-up (not user settings), sent in its :class:`ReadyMessage`.

    Attributes:
        num_kv_blocks: blocks in the KV pool.
        max_model_len: max tokens (prompt + output) per sequence.
        vocab_size: token ids are in ``[0, vocab_size)``.
        eos_token_ids: ids that end a sequence (model config and tokenizer).
        kv_cache_bytes: bytes of the KV pool.
        dtype: the run dtype, ``"float32"`` or ``"bfloat16"``.
        num_experts: experts of each MoE layer over all ranks; None for a dense model.
        kv_cache_group_windows: each KV cache group's sliding window in tokens, None for full
            attention (:func:`atom.kv_cache_spec.kv_cache_groups`; one full group unless the
            model mixes windows, as gpt-oss does).
        kv_cache_group_bytes_per_token: each group's bytes per token over its layers.
    """

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_cache_bytes: int
    dtype: str
    num_experts: int | None = None
    kv_cache_group_windows: tuple[int | None, ...] = (None,)
    kv_cache_group_bytes_per_token: tuple[int, ...] = ()


def check_token_ids(prompt_token_ids: list[int], stop_token_ids: list[int],
                    logit_bias_ids: list[int], *, vocab_size: int) -> str | None:
    """Why a request's token ids cannot run (an id outside ``[0, vocab_size)``), or None."""
    for what, ids in (("prompt token ids", prompt_token_ids), ("stop_token_ids", stop_token_ids),
                      ("logit_bias token ids", logit_bias_ids)):
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            return f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    return None


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Prefill/decode disaggregation: what a request carries to and from the KV connector
    (:mod:`atom.core.kv_connector`; field names after vLLM's ``kv_transfer_params``).

    To a producer (``--kv-role producer``): ``do_remote_decode=True``: keep the request's KV
    blocks after it finishes (it runs with ``max_tokens=1``) until a consumer pulled them.
    From the producer (in its response) and to a consumer (``--kv-role consumer``):
    ``do_remote_prefill=True`` and where the KV is.

    Attributes:
        do_remote_decode: the request is the prefill half of a P/D pair.
        do_remote_prefill: the request's prompt KV is on a producer: pull it, do not compute it.
        remote_host: the producer's KV transfer address (host or IP).
        remote_port: the producer's KV transfer TCP port.
        remote_request_id: the producer's engine request id (the key its blocks are kept under).
        remote_block_ids: the producer's block ids holding the prompt's KV, in order.
        remote_num_tokens: prompt tokens whose KV those blocks hold.
        remote_group_block_ids: a hybrid model's (:func:`atom.kv_cache_spec.kv_cache_groups`),
            per KV cache group after the first (a sliding window each), the producer's blocks
            inside the window of the consumer's first query (position ``remote_num_tokens``),
            in order: from block :func:`~atom.kv_cache_spec.first_block_in_window` to the
            prompt's last. Empty for one group (not on the wire then).
        first_token_id: the token the producer sampled; the consumer emits it as its first
            output token and decodes on from it.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] = []
    remote_num_tokens: int = 0
    first_token_id: int | None = None
    remote_group_block_ids: list[list[int]] = []


class ResumedChoice(msgspec.Struct, frozen=True):
    """What one choice of a request had produced when the ranks running it were lost (a rank
    failure; docs/ARCHITECTURE.md, "Rank failures"): the core rebuilds the sequence as a
    preempted one (prompt + these output tokens, recomputed as one prefill) and continues it.

    Attributes:
        output_token_ids: the choice's output tokens the front end had received.
        cumulative_logprob: their summed logprob (the continuation adds to it).
        finished: the choice had already finished (the core does not run it again).
    """

    output_token_ids: list[int]
    cumulative_logprob: float = 0.0
    finished: bool = False


class EngineCoreRequest(msgspec.Struct, tag="add", frozen=True):
    """A request as the core sees it: token ids, sampling parameters, arrival time (seconds,
    ``time.monotonic()`` of the front end) and the DP wave the front end believed current.

    ``resumed``: None for a new request; after a rank failure, one :class:`ResumedChoice` per
    choice (``sampling_params.n`` of them), so the request continues where it stopped:
    max_tokens, min_tokens, penalties and a seeded generator all count the tokens already
    produced.

    ``arrival_tick`` (tick-clocked replay, DP ranks only; None = at once): the DP rank holds
    the request until tick ``arrival_tick`` of the wave (counted from the wave's first tick,
    identical on every rank), then hands it to its scheduler (``atom.dp.tick.TickArrivals``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float
    wave_id: int = 0
    resumed: list[ResumedChoice] | None = None
    arrival_tick: int | None = None
    kv_transfer_params: KVTransferParams | None = None  # P/D only (atom.core.kv_connector)


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    """The client gave up on these requests (disconnect, cancel)."""

    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", frozen=True):
    """The front end ended these sequences (a stop string matched); not a client abort.

    ``seq_keys`` are ``(request_id, choice index)`` pairs; ``stop_reasons`` the matched strings.
    """

    seq_keys: list[tuple[str, int]]
    stop_reasons: list[str]


class UtilityCall(msgspec.Struct, tag="utility", frozen=True):
    call_id: int
    method: str  # one of atom.engine.core.UTILITY_METHODS


class StartWave(msgspec.Struct, tag="start_wave", frozen=True):
    """Wake an idle DP rank: every rank enters the next tick of wave ``wave_id`` together."""

    wave_id: int


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


CoreInput = EngineCoreRequest | AbortRequests | FinishRequests | UtilityCall | StartWave | Shutdown


class SeqOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """New tokens of one sequence from one step (or its finish)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    # whole list (one entry per prompt token), sent once: with choice 0's first sampled token
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a producer's finished prefill: where its kept KV is (atom.core.kv_connector)
    kv_transfer_params: KVTransferParams | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", frozen=True):
    dp_rank: int
    outputs: list[SeqOutput]
    timestamp_s: float
    # DP rank 0 only: every rank finished wave ``wave_complete`` and went idle
    wave_complete: int | None = None


class WaveWakeup(msgspec.Struct, tag="wave_wakeup", frozen=True):
    """An idle DP rank got a request and woke up for wave ``wave_id``: the front end must wake
    the other ranks (``StartWave(wave_id)`` to every rank). Closes the race where the front end
    dispatched without a StartWave because it had not yet seen the wave end."""

    dp_rank: int
    wave_id: int


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """A core process is running (sent by its heartbeat thread every
    :func:`atom.engine.liveness.heartbeat_interval_s`), with the ticks its loop has completed."""

    dp_rank: int
    tick: int


class ReadyMessage(msgspec.Struct, tag="ready", frozen=True):
    """A core loaded its weights and sized its KV pool. When it publishes KV events, the
    endpoints it bound (ports resolved, per-rank offset applied), for the front end's
    subscriber: ``kv_events_endpoint`` (PUB) and ``kv_events_replay_endpoint`` (ROUTER).
    ``pid``: its process id (the front end of a launched group on one node watches it)."""

    dp_rank: int
    runtime: EngineRuntime
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    pid: int = 0


class StartupFailed(msgspec.Struct, tag="startup_failed", frozen=True):
    """A core could not start: sent instead of its :class:`ReadyMessage`, right before it
    exits 1. ``error``: the cause as one line for people (the traceback stays in the core's
    log, at DEBUG); the front end raises it as
    :class:`~atom.engine.liveness.EngineStartError`."""

    dp_rank: int
    error: str


class UtilityResult(msgspec.Struct, tag="utility_result", frozen=True):
    dp_rank: int
    call_id: int
    result: dict[str, int | float | bool | list[int]] | None = None
    error: str | None = None


CoreOutput = (ReadyMessage | EngineCoreOutputs | UtilityResult | WaveWakeup | Heartbeat
              | StartupFailed)

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: CoreInput | CoreOutput) -> bytes:
    """Raises ``OverflowError`` / ``msgspec.EncodeError`` for a value msgpack cannot hold."""
    return _encoder.encode(message)


def decode_input(data: bytes) -> CoreInput:
    """Raises ``msgspec.DecodeError`` (not msgpack) / ``msgspec.ValidationError`` (a wrong
    shape, or sampling parameters that fail their checks) on a bad frame."""
    return _input_decoder.decode(data)


def request_of_bad_frame(data: bytes) -> tuple[str, int] | None:
    """``(request_id, n)`` of a request frame that :func:`decode_input` rejected, so the core can
    finish its ``n`` choices with an error instead of leaving them hanging; None when the frame
    is not recognisably a request (garbage, or another message)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "add" or not isinstance(
            raw.get("request_id"), str):
        return None
    params = raw.get("sampling_params")
    n = params.get("n") if isinstance(params, dict) else None
    return raw["request_id"], n if isinstance(n, int) and 1 <= n <= _MAX_N_OF_BAD_FRAME else 1


_MAX_N_OF_BAD_FRAME = 1024  # a bad frame's own n is trusted only this far


def decode_output(data: bytes) -> CoreOutput:
    return _output_decoder.decode(data)
