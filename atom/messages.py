"""Messages between the front end and EngineCore processes (msgspec msgpack; never pickle).

Front end → engine core (one ZMQ PUSH → PULL stream per core):
    :class:`EngineCoreRequest`, :class:`AbortRequests`, :class:`FinishRequests`,
    :class:`UtilityCall`, :class:`StartWave`, :class:`Shutdown`.
Engine core → front end (PUSH → PULL, all cores into one socket):
    :class:`ReadyMessage`, :class:`EngineCoreOutputs`, :class:`UtilityResult`,
    :class:`WaveWakeup` (DP only).

Token ids only cross the socket: tokenization, detokenization and stop strings live in the
front end (DESIGN.md, "Processes and data flow").
"""

from __future__ import annotations

import msgspec

from atom.sampling_params import SamplingParams


class SamplingParamsMsg(msgspec.Struct, frozen=True):
    """Wire form of :class:`SamplingParams` (same field names)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int | None
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    seed: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    logit_bias: dict[int, float]

    @classmethod
    def from_params(cls, params: SamplingParams) -> "SamplingParamsMsg":
        return cls(**{f: getattr(params, f) for f in cls.__struct_fields__})

    def to_params(self) -> SamplingParams:
        return SamplingParams(**{f: getattr(self, f) for f in self.__struct_fields__})


class EngineCoreRequest(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParamsMsg
    arrival_time_s: float
    wave_id: int = 0


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
    method: str  # one of atom.engine_core.UTILITY_METHODS


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


class ReadyMessage(msgspec.Struct, tag="ready", frozen=True):
    dp_rank: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_cache_bytes: int
    dtype: str


class UtilityResult(msgspec.Struct, tag="utility_result", frozen=True):
    dp_rank: int
    call_id: int
    result: dict[str, int | float | bool] | None = None
    error: str | None = None


CoreOutput = ReadyMessage | EngineCoreOutputs | UtilityResult | WaveWakeup

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: CoreInput | CoreOutput) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> CoreInput:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on a malformed frame."""
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> CoreOutput:
    return _output_decoder.decode(data)
