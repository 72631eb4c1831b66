"""Workloads: the trace format (JSON lines) and the generators, shared by the simulator and
the real-engine replay (:mod:`atom.dp.sim.replay`, ``scripts/dp_experiment.py``).

One line per request, a JSON object::

    {"request_id": "b3-1", "prompt_len": 40, "output_len": 12, "arrival_tick": 16}
    {"request_id": "s0-t1", "prompt_token_ids": [1, 2, ...], "output_len": 32,
     "arrival_s": 4.5, "session_id": "s0", "dp_rank": 0}

- ``request_id`` (unique); the prompt as ``prompt_token_ids`` or ``prompt_len`` (tokens then
  drawn from a generator seeded by the request id, :func:`synthetic_prompt`);
- ``output_len``: output tokens (replayed greedy with ``ignore_eos``, so exactly this many);
- exactly one of ``arrival_tick`` (tick-clocked: the tick of the wave at which the request
  becomes visible to its rank's scheduler) or ``arrival_s`` (time-clocked, seconds after the
  start); every request of a workload uses the same clock;
- optional ``session_id`` (the router's session) and ``dp_rank`` (a rank hint: pins the rank);
- optional ``output_token_ids`` (``output_len`` ids): what the simulator emits for the request
  (a real run's outputs, :func:`with_outputs`, so speculative drafts are accepted as they were
  there); without it every output token is :data:`SIM_OUTPUT_TOKEN_ID`;
- optional ``draft_token_ids`` (a list of lists): a model-based draft's proposals for the
  request, one list per verify in order (a real run's, recorded in its DP trace:
  :func:`drafts_from_trace`, :func:`with_drafts`), which the simulator proposes again (it has
  no model to draft with: ``speculative_method`` ``mtp`` or ``draft`` needs them).

Generators (seeded, pure): :func:`dp_experiment` (the workload of
``scripts/dp_experiment.py``: long prompts pinned to one KV-pressured rank, then bursts),
:func:`bursty`, :func:`kv_skewed` (one rank's requests long) and :func:`sessions` (multi-turn
chats sharing a system prompt, each turn's prompt the conversation so far). Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VOCAB_RANGE = (100, 20000)  # synthetic token ids: clear of the special tokens, inside any vocab
SIM_OUTPUT_TOKEN_ID = 1000  # the token the simulator "samples" (its value never matters)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload (module docstring). Raises ValueError when a field is out
    of range or the arrival is not exactly one of tick / seconds."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_tick: int | None = None
    arrival_s: float | None = None
    session_id: str | None = None
    dp_rank: int | None = None
    # the tokens the simulator emits for this request (a real run's outputs, so that
    # speculative drafts are accepted as they were there); None: SIM_OUTPUT_TOKEN_ID each
    output_token_ids: tuple[int, ...] | None = None
    # a model-based draft's proposals, one tuple per verify in order (a real run's recorded
    # drafts, so the simulator verifies the same ones); None: no recorded drafts
    draft_token_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"{self.request_id}: the prompt is empty")
        if self.output_len < 1:
            raise ValueError(f"{self.request_id}: output_len={self.output_len} must be >= 1")
        if (self.arrival_tick is None) == (self.arrival_s is None):
            raise ValueError(f"{self.request_id}: give exactly one of arrival_tick, arrival_s")
        if (self.arrival_tick or 0) < 0 or (self.arrival_s or 0.0) < 0.0:
            raise ValueError(f"{self.request_id}: arrivals are >= 0")
        if self.dp_rank is not None and self.dp_rank < 0:
            raise ValueError(f"{self.request_id}: dp_rank={self.dp_rank} must be >= 0")
        if self.output_token_ids is not None and len(self.output_token_ids) != self.output_len:
            raise ValueError(f"{self.request_id}: {len(self.output_token_ids)} output_token_ids "
                             f"for output_len={self.output_len}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def arrival(self) -> float:
        """The arrival on the workload's clock (ticks or seconds)."""
        return self.arrival_tick if self.arrival_tick is not None else self.arrival_s


def with_outputs(requests: Sequence[TraceRequest], outputs: dict[str, Sequence[int]]
                 ) -> list[TraceRequest]:
    """``requests`` carrying a run's output token ids (request id → ids; a real replay's
    ``output_token_ids_by_request``) for the simulator to emit.

    Raises:
        ValueError: a request missing from ``outputs``, or ids of another length.
    """
    missing = [r.request_id for r in requests if r.request_id not in outputs]
    if missing:
        raise ValueError(f"no outputs for {missing[:5]}")
    return [dataclasses.replace(r, output_token_ids=tuple(outputs[r.request_id]))
            for r in requests]


def drafts_from_trace(folder: str | pathlib.Path) -> dict[str, list[list[int]]]:
    """Request id → the draft tokens a real run's model-based draft proposed for it, one list
    per verify in tick order: the ``drafts`` events of its DP trace folder
    (:mod:`atom.dp.dp_trace`; every rank's file)."""
    from atom.dp.dp_trace import read_trace

    events = sorted((e for trace in read_trace(folder) for e in trace.events
                     if e["event"] == "drafts"), key=lambda e: e["tick"])
    drafts: dict[str, list[list[int]]] = {}
    for event in events:  # a request is on one rank: one event per tick at most
        for request_id, tokens in event["drafts"].items():
            drafts.setdefault(request_id, []).append(list(tokens))
    return drafts


def with_drafts(requests: Sequence[TraceRequest], drafts: dict[str, Sequence[Sequence[int]]]
                ) -> list[TraceRequest]:
    """``requests`` carrying a run's recorded draft proposals (request id → one list per
    verify, :func:`drafts_from_trace`; a request that never verified has none)."""
    return [dataclasses.replace(r, draft_token_ids=tuple(
        tuple(d) for d in drafts.get(r.request_id, ()))) for r in requests]


def vocab_range(vocab_size: int | None = None) -> tuple[int, int]:
    """The synthetic token ids ``[low, high)`` for a model of ``vocab_size`` tokens:
    :data:`VOCAB_RANGE` cut at the vocabulary (the same draws wherever the vocabulary holds
    it: the embedded model's 49152 tokens do), starting at half a vocabulary smaller than 200
    tokens. None: :data:`VOCAB_RANGE`.

    Raises:
        ValueError: a vocabulary of fewer than 4 tokens.
    """
    if vocab_size is None:
        return VOCAB_RANGE
    if vocab_size < 4:
        raise ValueError(f"a vocabulary of {vocab_size} tokens leaves no synthetic token ids: "
                         f"use a model with at least 4")
    return min(VOCAB_RANGE[0], vocab_size // 2), min(VOCAB_RANGE[1], vocab_size)


def synthetic_prompt(request_id: str, length: int, *,
                     vocab_size: int | None = None) -> tuple[int, ...]:
    """``length`` token ids drawn from a generator seeded by ``request_id`` (reproducible),
    inside :func:`vocab_range` of ``vocab_size``."""
    rng = random.Random(request_id)
    id_range = vocab_range(vocab_size)
    return tuple(rng.randrange(*id_range) for _ in range(length))


def workload_clock(requests: Sequence[TraceRequest]) -> str:
    """``"tick"`` or ``"time"``. Raises ValueError for an empty or mixed-clock workload."""
    clocks = {"tick" if r.arrival_tick is not None else "time" for r in requests}
    if len(clocks) != 1:
        raise ValueError(f"a workload has one clock (all arrival_tick or all arrival_s); "
                         f"got {sorted(clocks) or 'no requests'}")
    return clocks.pop()


def read_workload(path: str | pathlib.Path) -> list[TraceRequest]:
    """A workload file (module docstring). Raises ValueError on a bad line (with its number)
    or duplicate ids, OSError when the file cannot be read."""
    requests, seen = [], set()
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            ids = fields.pop("prompt_token_ids", None)
            length = fields.pop("prompt_len", None)
            if (ids is None) == (length is None):
                raise ValueError("give exactly one of prompt_token_ids, prompt_len")
            rid = str(fields.pop("request_id"))
            prompt = tuple(ids) if ids is not None else synthetic_prompt(rid, int(length))
            if fields.get("output_token_ids") is not None:
                fields["output_token_ids"] = tuple(fields["output_token_ids"])
            if fields.get("draft_token_ids") is not None:
                fields["draft_token_ids"] = tuple(tuple(d) for d in fields["draft_token_ids"])
            request = TraceRequest(rid, prompt, **fields)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{number}: {e}") from e
        if request.request_id in seen:
            raise ValueError(f"{path}:{number}: duplicate request_id {request.request_id!r}")
        seen.add(request.request_id)
        requests.append(request)
    workload_clock(requests)
    return requests


def write_workload(path: str | pathlib.Path, requests: Iterable[TraceRequest]) -> None:
    """Write ``requests`` as a workload file (token ids in full; None fields left out)."""
    lines = []
    for r in requests:
        fields = {k: v for k, v in dataclasses.asdict(r).items() if v is not None}
        fields["prompt_token_ids"] = list(r.prompt_token_ids)
        if r.output_token_ids is not None:
            fields["output_token_ids"] = list(r.output_token_ids)
        if r.draft_token_ids is not None:
            fields["draft_token_ids"] = [list(d) for d in r.draft_token_ids]
        lines.append(json.dumps(fields, separators=(",", ":")))
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


def _arrival(clock: str, at: float) -> dict:
    if clock not in ("tick", "time"):
        raise ValueError(f"clock={clock!r}: use 'tick' or 'time'")
    return {"arrival_tick": int(at)} if clock == "tick" else {"arrival_s": float(at)}


def dp_experiment(*, clock: str = "time", burst_interval: float = 1.0, pressure_prompts: int = 3,
                  pressure_prompt_len: int = 160, pressure_max_tokens: int = 48,
                  num_bursts: int = 6, burst_size: int = 4,
                  short_prompt_len: tuple[int, int] = (24, 64),
                  short_max_tokens: tuple[int, int] = (8, 24), seed: int = 0,
                  vocab_size: int | None = None) -> list[TraceRequest]:
    """``scripts/dp_experiment.py``'s workload (its defaults): ``pressure_prompts`` long
    prompts pinned to rank 0 at 0, then ``num_bursts`` bursts of ``burst_size`` short ones
    (routed), ``burst_interval`` apart (ticks or seconds, per ``clock``). Same draws as the
    script always made (seeded ``random.Random(seed)``), so a seed is the same workload; token
    ids inside :func:`vocab_range` of ``vocab_size``."""
    rng = random.Random(seed)
    id_range = vocab_range(vocab_size)

    def prompt(length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(*id_range) for _ in range(length))

    out = [TraceRequest(str(i), prompt(pressure_prompt_len), pressure_max_tokens, dp_rank=0,
                        **_arrival(clock, 0)) for i in range(pressure_prompts)]
    for burst in range(num_bursts):
        for _ in range(burst_size):
            ids = prompt(rng.randint(*short_prompt_len))
            out.append(TraceRequest(str(len(out)), ids, rng.randint(*short_max_tokens),
                                    **_arrival(clock, burst * burst_interval)))
    return out


def bursty(*, num_requests: int, burst_size: int, burst_interval: float, clock: str = "time",
           prompt_len: tuple[int, int] = (64, 512), output_len: tuple[int, int] = (16, 256),
           seed: int = 0, vocab_size: int | None = None) -> list[TraceRequest]:
    """``num_requests`` routed requests in bursts of ``burst_size``, ``burst_interval``
    apart (ticks or seconds), lengths uniform in the given ranges; token ids inside
    :func:`vocab_range` of ``vocab_size``."""
    rng = random.Random(seed)
    return [TraceRequest(f"b{i}", synthetic_prompt(f"{seed}-b{i}", rng.randint(*prompt_len),
                                                   vocab_size=vocab_size),
                         rng.randint(*output_len),
                         **_arrival(clock, (i // burst_size) * burst_interval))
            for i in range(num_requests)]


def kv_skewed(*, num_requests: int, rate: float, clock: str = "time", skewed_rank: int = 0,
              skewed_fraction: float = 0.1, long_prompt_len: tuple[int, int] = (1024, 2048),
              long_output_len: tuple[int, int] = (128, 512),
              short_prompt_len: tuple[int, int] = (32, 256),
              short_output_len: tuple[int, int] = (16, 128), seed: int = 0,
              vocab_size: int | None = None) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` per tick or second; ``skewed_fraction`` of them long and
    pinned to ``skewed_rank`` (its KV pool fills: a KV-pressured rank), the rest short and
    routed; token ids inside :func:`vocab_range` of ``vocab_size``."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for i in range(num_requests):
        long = rng.random() < skewed_fraction
        length = rng.randint(*(long_prompt_len if long else short_prompt_len))
        out.append(TraceRequest(
            f"k{i}", synthetic_prompt(f"{seed}-k{i}", length, vocab_size=vocab_size),
            rng.randint(*(long_output_len if long else short_output_len)),
            dp_rank=skewed_rank if long else None, **_arrival(clock, at)))
        at += rng.expovariate(rate)
    return out


def sessions(*, num_sessions: int, num_turns: int, turn_interval: float, clock: str = "time",
             system_prompt_len: int = 256, user_len: tuple[int, int] = (16, 64),
             output_len: tuple[int, int] = (32, 128), session_stagger: float | None = None,
             seed: int = 0, vocab_size: int | None = None) -> list[TraceRequest]:
    """Multi-turn chats (token ids inside :func:`vocab_range` of ``vocab_size``): every session's first prompt is one shared system prompt plus a user
    message; turn k's prompt is turn k-1's prompt, its output (as the simulator generates it:
    :data:`SIM_OUTPUT_TOKEN_ID` repeated) and a new user message, so a rank that served the
    previous turn holds most of the prompt in its prefix cache. Turns of a session arrive
    ``turn_interval`` apart (open loop), sessions ``session_stagger`` apart (default
    ``turn_interval / num_sessions``); requests carry their ``session_id``."""
    rng = random.Random(seed)
    stagger = turn_interval / num_sessions if session_stagger is None else session_stagger
    system = synthetic_prompt(f"{seed}-system", system_prompt_len, vocab_size=vocab_size)
    out = []
    for s in range(num_sessions):
        history: tuple[int, ...] = system
        for t in range(num_turns):
            user = synthetic_prompt(f"{seed}-s{s}-u{t}", rng.randint(*user_len),
                                    vocab_size=vocab_size)
            prompt = history + user
            n_out = rng.randint(*output_len)
            out.append(TraceRequest(f"s{s}-t{t}", prompt, n_out, session_id=f"s{s}",
                                    **_arrival(clock, s * stagger + t * turn_interval)))
            history = prompt + (SIM_OUTPUT_TOKEN_ID,) * n_out
    out.sort(key=lambda r: r.arrival)
    return out


GENERATORS = {"dp_experiment": dp_experiment, "bursty": bursty, "kv_skewed": kv_skewed,
              "sessions": sessions}


def scaled(name: str, *, dp_size: int, clock: str = "time", seed: int = 0,
           **overrides) -> list[TraceRequest]:
    """A generator's workload sized for ``dp_size`` ranks, so the load per rank stays the
    same across DP sizes (the study's sweeps): per rank, bursty sends 4 requests a burst every
    2 s (40 per rank); kv_skewed 0.5 requests per second (60 per rank), the skewed rank's
    share (1/dp_size) long; sessions 2 sessions of 4 turns 4 s apart; dp_experiment is the
    script's workload (2 ranks). ``overrides`` replace any of the generator's arguments.

    Raises:
        ValueError: an unknown generator name.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}: use one of {sorted(GENERATORS)} or a "
                         f"workload file")
    defaults = {
        "dp_experiment": {},
        "bursty": dict(num_requests=40 * dp_size, burst_size=4 * dp_size, burst_interval=2.0),
        "kv_skewed": dict(num_requests=60 * dp_size, rate=0.5 * dp_size,
                          skewed_fraction=1.0 / dp_size),
        "sessions": dict(num_sessions=2 * dp_size, num_turns=4, turn_interval=4.0),
    }[name]
    return GENERATORS[name](**{**defaults, "clock": clock, "seed": seed, **overrides})
