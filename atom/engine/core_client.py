"""The front end's handle on its engine cores: one interface, an in-process and a ZMQ family.

:class:`EngineCoreClient` is the interface every front end (:class:`atom.engine.llm_engine.LLMEngine`, so
``LLM``, the CLI and the OpenAI server) speaks: add, abort, finish, outputs, utility calls
(merged or per rank), per-rank stats, liveness, shutdown. :class:`InprocClient` runs an
:class:`~atom.engine.core.EngineCore` in this process (tests that look inside). :class:`MPClient`
talks to N engine-core processes over ZMQ; a single rank is the N = 1 case::

    front end                                 engine core i
    PUSH  input_addrs[i]  ── CoreInput ───>   PULL
    PULL  output_addr     <── CoreOutput ──   PUSH   (one socket shared by every core)

:class:`MPClient` owns the sockets, the ready handshake, the send and poll loops, utility
calls, liveness and shutdown. Its one-rank routing sends everything to core 0;
:class:`atom.dp.dp_client.DPEngineCoreClient` overrides only the routing (``add_request``,
``abort``, ``finish``) and runs the DP waves (the shape of vLLM's ``core_client.py``: one
interface, an MP base, DP subclasses that route).

Who starts and watches the core processes is the ``ranks`` object's business:

- :class:`atom.engine.spawned_ranks.SpawnedRanks` (default): the client starts one process per rank
  on this node;
- ``LaunchedRanks`` (:mod:`atom.dp.dp_client`): a launcher started the ranks.

Frames are msgspec msgpack, never pickle.

Liveness (:mod:`atom.engine.liveness`): nothing here waits on a core without also watching it. Every
wait polls in short slices; when no frame but heartbeats came, it asks ``ranks.exited()`` and
the :class:`~atom.engine.liveness.HeartbeatMonitor`. A core that dies at start-up raises
``RuntimeError`` (rank, exit code and the tail of its stderr); one that dies later, or sends no
heartbeat for ``engine_hang_timeout_s``, raises :class:`~atom.engine.liveness.RankFailedError` (an
:class:`EngineDeadError` naming the ranks) within a slice (0.1 s) of the next call, never a
hang; a hung one is killed first (its peers' collectives then fail at once). The error sticks
until :meth:`MPClient.recover` starts a fresh group (docs/ARCHITECTURE.md, "Rank failures"):
the same size or without the lost ranks, as ``on_rank_failure`` and the ranks object allow;
the front end then sends its unfinished requests again (:class:`atom.engine.llm_engine.LLMEngine`).
"""

from __future__ import annotations

import abc
import collections
import itertools
import logging
import time
import weakref
from typing import TYPE_CHECKING

import msgspec
import zmq

from atom.config import EngineConfig
from atom.engine.kv_subscriber import PublisherEndpoints
from atom.engine.liveness import (
    DEAD,
    EngineDeadError,
    EngineStartError,
    HeartbeatMonitor,
    RankFailedError,
    RankFailure,
)
from atom.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineRuntime,
    FinishRequests,
    Heartbeat,
    ReadyMessage,
    SeqOutput,
    Shutdown,
    StartupFailed,
    UtilityCall,
    UtilityResult,
    decode_output,
    encode,
)
from atom.engine.spawned_ranks import SHUTDOWN_GRACE_S, RankProcesses, SpawnedRanks, core_argv

if TYPE_CHECKING:
    from atom.engine.core import EngineCore

logger = logging.getLogger(__name__)

__all__ = ["EngineCoreClient", "EngineDeadError", "EngineStartError", "InprocClient", "MPClient", "RankFailedError",
           "RankProcesses", "SpawnedRanks", "core_argv", "merge_rank_results"]

POLL_SLICE_S = 0.1  # how often a wait checks that the core processes are alive
_MAX_FAILURES_KEPT = 8  # rank failures remembered for /health

# get_stats keys that are not summed across ranks by call_utility (the merged view takes the
# max): per-rank positions and the group's own counters, which every rank holds a copy of (the
# KV pool's sizes are summed: free and total blocks of the whole deployment)
_NOT_SUMMED = frozenset(("dp_rank", "tick", "wave_id", "collective_count", "collective_hash",
                         "idle", "num_waves_completed", "num_steps", "num_prefill_steps",
                         "num_mixed_prefill_steps", "num_tbo_steps", "num_spec_steps",
                         "kv_cache_bytes_per_token"))
# the prefill decisions, EPLB's figures and each KV cache group's bytes per token: identical on
# every rank (EPLB's timings are each rank's own: the merged view shows the slowest)
_NOT_SUMMED_PREFIXES = ("prefill_policy_", "eplb_", "kv_cache_bytes_per_token_")


def merge_rank_results(results: list[dict]) -> dict:
    """One dict from every rank's utility result: numbers summed over ranks (counters such
    as the tick or the collective hash, and flags: the max; ``prefix_cache_hit_rate``
    recomputed from the summed tokens). One rank: its result as it is."""
    merged: dict = {}
    for result in results:
        for key, value in result.items():
            if key not in merged:
                merged[key] = value
            elif isinstance(value, list):  # a histogram's buckets: element by element
                merged[key] = [_merge_value(key, a, b) for a, b in zip(merged[key], value)]
            else:
                merged[key] = _merge_value(key, merged[key], value)
    if len(results) > 1 and "prefix_cache_hit_rate" in merged:
        queries = merged["prefix_cache_queries"]
        merged["prefix_cache_hit_rate"] = merged["prefix_cache_hits"] / queries if queries else 0.0
    if len(results) > 1 and "spec_num_verifies" in merged:  # ratios of the summed counts
        from atom.core.spec_stats import SpecStats

        totals = SpecStats(1, num_verifies=merged["spec_num_verifies"],
                           num_draft_tokens=merged["spec_num_draft_tokens"],
                           num_accepted_tokens=merged["spec_num_accepted_tokens"],
                           num_emitted_tokens=merged["spec_num_emitted_tokens"])
        merged["spec_acceptance_rate"] = totals.acceptance_rate
        merged["spec_mean_tokens_per_forward"] = totals.mean_tokens_per_forward
        merged["spec_mean_acceptance_length"] = totals.mean_acceptance_length
    return merged


def _merge_value(key: str, a, b):
    if isinstance(b, bool) or key in _NOT_SUMMED or key.startswith(_NOT_SUMMED_PREFIXES):
        return max(a, b)
    return a + b


class EngineCoreClient(abc.ABC):
    """The client interface of a front end over its engine cores (module docstring).

    ``runtime`` (:class:`~atom.messages.EngineRuntime`) is set once the cores are ready.
    """

    runtime: EngineRuntime

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> int:
        """Send a request; returns the DP rank it went to (0 with one rank).
        ``data_parallel_rank`` pins the DP rank, ``session_id`` names the conversation it
        belongs to (DP routing; both ignored with one rank; the session id never reaches the
        core).

        Raises:
            ValueError: (DP) a bad rank hint, or a request id already running.
            OverflowError, msgspec.EncodeError: a value msgpack cannot hold (nothing is sent).
            EngineDeadError: a core process is gone.
        """

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Client aborts: the owning cores free these requests' KV blocks (nothing is
        reported back: the front end ended them)."""

    @abc.abstractmethod
    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        """Stop strings the front end matched: the owning cores finish these
        ``(request_id, index)`` sequences (not aborts) and free their KV blocks."""

    @abc.abstractmethod
    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        """Sequence outputs of the cores' steps, oldest first; ``[]`` when none came within
        ``timeout_s`` seconds (None = wait until some arrive).

        Raises:
            EngineDeadError: a core process exited (outputs it sent before come first).
        """

    @abc.abstractmethod
    def call_utility_per_rank(self, method: str, *, timeout_s: float | None = None) -> list[dict]:
        """Run a core method (``get_stats``, ``reset_prefix_cache``) on every core, after every
        input sent so far; results in rank order.

        Raises:
            ValueError: the core does not know ``method``.
            EngineDeadError: a core process exited.
            TimeoutError: not every core answered within ``timeout_s`` seconds (None: no limit
                but the hang timeout).
        """

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """False once any core process has exited (in-process: always True)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the cores and free what the client holds. Idempotent; never raises."""

    def check_ranks(self) -> None:
        """Take the frames that arrived (heartbeats) and look for a rank that exited or went
        silent, without waiting; in-process there is nothing to check.

        Raises:
            RankFailedError: a rank died or hung (multiprocess).
        """

    def call_utility(self, method: str) -> dict:
        """``method`` on every core, merged over ranks (:func:`merge_rank_results`)."""
        return merge_rank_results(self.call_utility_per_rank(method))

    def get_stats(self) -> dict:
        """The KV pool, queue and prefix-cache counters summed over ranks, plus the front
        end's own (:meth:`front_end_stats`)."""
        return {**merge_rank_results(self.get_rank_stats()), **self.front_end_stats()}

    def get_rank_stats(self, *, timeout_s: float | None = None) -> list[dict]:
        """Each rank's ``get_stats`` (DP ranks add tick, wave, collective count and hash,
        prefill policy counters; the DP client adds its router's counters for the rank);
        ``timeout_s`` as :meth:`call_utility_per_rank`."""
        return self.call_utility_per_rank("get_stats", timeout_s=timeout_s)

    def front_end_stats(self) -> dict:
        """Counters of this process that belong to no rank (rank failures and recoveries, the
        DP client's KV event subscriber); no round trip to the cores."""
        return {}

    def recover(self, error: RankFailedError) -> None:
        """After ``error``: a fresh group of cores, with nothing in flight (the caller sends
        its unfinished requests again).

        Raises:
            EngineDeadError: this deployment cannot go on (``on_rank_failure=stop``, no rank
                left, a launched group without restarts, or the new group failed to start).
        """
        raise EngineDeadError(str(error)) from error

    def membership(self) -> dict:
        """The group now: generation, DP size, per rank its pid, last tick and heartbeat
        silence, and the recent rank failures (``/health``); no round trip to the cores."""
        return {}


class InprocClient(EngineCoreClient):
    """An :class:`~atom.engine.core.EngineCore` in this process: ``get_outputs`` runs one step
    (tests that look inside the scheduler or block manager use this)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.runtime = core.runtime

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> int:
        encode(request)  # the same check as the socket path: a value msgpack cannot hold raises
        self.core.add_request(request)
        return 0

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        self.core.finish_requests(seq_keys, stop_reasons)

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        return self.core.step() if self.core.has_work() else []

    def call_utility_per_rank(self, method: str, *, timeout_s: float | None = None) -> list[dict]:
        return [self.core.call_utility(method)]

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.core.close()


class _Sockets:
    """The client's sockets for one group, and the ranks they talk to (what the finalizer
    releases; it holds no reference to the client)."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self.ranks: RankProcesses | None = None
        self.output: zmq.Socket | None = None
        self.inputs: list[zmq.Socket] = []
        self.output_addr, self.input_addrs = "", []

    def bind(self, ranks: RankProcesses, num_ranks: int) -> None:
        self.ranks = ranks
        self.output = self.ctx.socket(zmq.PULL)
        self.inputs = [self.ctx.socket(zmq.PUSH) for _ in range(num_ranks)]
        self.output_addr = _bind(self.output, ranks.address("output"))
        self.input_addrs = [_bind(s, ranks.address(f"input{i}")) for i, s in enumerate(self.inputs)]

    def close(self) -> None:
        for sock in [*self.inputs, *([self.output] if self.output is not None else [])]:
            sock.close(linger=0)
        self.output, self.inputs = None, []


class MPClient(EngineCoreClient):
    """Starts the engine-core processes of a deployment and talks to them over ZMQ.

    Args:
        config: engine options (sent to the processes as JSON); ``data_parallel_size`` cores.
        extra_eos_token_ids: EOS ids the front end knows besides the model config's.
        startup_timeout_s: how long to wait for every ready message (loading weights), seconds.
        ranks: who starts the processes; default :class:`SpawnedRanks` of ``ENTRY_MODULE``.

    Attributes:
        generation: groups started before the current one (0 until a recovery).
        num_ranks, config: the current group's size and options (a shrunk group has fewer).

    Raises:
        EngineStartError: a core raised during start-up (one line: the rank and the cause).
        RuntimeError: a process exited during start-up without saying why (rank, exit code
            and stderr tail in the message) or sent no ready message within
            ``startup_timeout_s``.
        zmq.ZMQError: an address cannot be bound.
    """

    ENTRY_MODULE = "atom.engine.core_proc"  # the process each rank runs (spawned ranks)

    def __init__(self, config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...] = (),
                 startup_timeout_s: float = 600.0, ranks: RankProcesses | None = None):
        self.config = config
        self.num_ranks = config.data_parallel_size
        self._extra_eos = extra_eos_token_ids
        self._startup_timeout_s = startup_timeout_s
        self._ctx = zmq.Context()
        self._sockets = _Sockets(self._ctx)
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._sockets)
        self._outputs: collections.deque[list[SeqOutput]] = collections.deque()
        self._output_poller: tuple[zmq.Socket, zmq.Poller] | None = None  # see _poll
        # where each rank publishes KV events (from the ready messages; [] when off)
        self.kv_event_publishers: list[PublisherEndpoints] = []
        self.pids: list[int] = []
        self._utility_results: dict[tuple[int, int], UtilityResult] = {}
        self._call_ids = itertools.count()
        self._monitor = HeartbeatMonitor(config.engine_hang_timeout_s)
        self._failed: RankFailedError | None = None  # sticks until recover()
        self.failures: collections.deque[dict] = collections.deque(maxlen=_MAX_FAILURES_KEPT)
        self.generation = 0
        self._failure_stats = dict.fromkeys(("rank_failures_dead", "rank_failures_hung",
                                             "rank_recoveries"), 0)
        self._recovery_s = {"recovery_seconds_total": 0.0, "recovery_seconds_last": 0.0}
        try:
            self._start_group(SpawnedRanks(self.ENTRY_MODULE) if ranks is None else ranks)
        except BaseException:
            self.shutdown()
            raise

    @property
    def ranks(self) -> RankProcesses:
        return self._sockets.ranks

    @property
    def output_addr(self) -> str:
        return self._sockets.output_addr

    @property
    def input_addrs(self) -> list[str]:
        return self._sockets.input_addrs

    # ----- requests (one rank: everything goes to core 0; the DP client routes) -----

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> int:
        self._send(0, request)
        return 0

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(0, AbortRequests(list(request_ids)))

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        if seq_keys:
            self._send(0, FinishRequests(list(seq_keys), list(stop_reasons)))

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._outputs:
            remaining_s = POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            self._poll(max(0.0, min(POLL_SLICE_S, remaining_s)))
            if deadline is not None and time.monotonic() >= deadline:
                break
        outputs: list[SeqOutput] = []
        while self._outputs:
            outputs += self._outputs.popleft()
        return outputs

    # ----- utilities -----

    def call_utility_per_rank(self, method: str, *, timeout_s: float | None = None) -> list[dict]:
        # outputs that arrive meanwhile are kept for get_outputs
        call_id = next(self._call_ids)
        for rank in range(self.num_ranks):
            self._send(rank, UtilityCall(call_id=call_id, method=method))
        keys = [(rank, call_id) for rank in range(self.num_ranks)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(k in self._utility_results for k in keys):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{method}: not every engine core answered within "
                                   f"{timeout_s:g} s")
            self._poll(POLL_SLICE_S)
        results = [self._utility_results.pop(k) for k in keys]
        for r in results:
            if r.error is not None:
                raise ValueError(r.error)
        return [dict(r.result or {}) for r in results]

    def front_end_stats(self) -> dict:
        """``rank_failures_dead`` / ``rank_failures_hung`` (ranks lost), ``rank_recoveries``
        (fresh groups started), ``recovery_seconds_total`` / ``recovery_seconds_last`` (from
        the failure's detection to the new group's ready messages), ``dp_size`` and
        ``generation`` of the current group."""
        return {**self._failure_stats, **self._recovery_s, "dp_size": self.num_ranks,
                "generation": self.generation}

    def membership(self) -> dict:
        # read from other threads too (/health): one snapshot of each list, no index into a
        # list the engine thread may replace meanwhile (a recovery resets them)
        beats = list(zip(self._monitor.silence_s(time.monotonic()), self._monitor.last_ticks))
        pids = list(self.pids)
        return {"generation": self.generation, "dp_size": self.num_ranks,
                "ranks": [{"dp_rank": r, "pid": pids[r] if r < len(pids) else None,
                           "last_tick": tick, "heartbeat_age_s": round(silence, 3)}
                          for r, (silence, tick) in enumerate(beats)],
                "rank_failures": list(self.failures)}

    # ----- lifecycle -----

    def is_alive(self) -> bool:
        return self._failed is None and self.ranks.is_alive()

    def check_ranks(self) -> None:
        self._poll(0.0)

    def recover(self, error: RankFailedError) -> None:
        """Start the group that follows ``error`` (``ranks.successor`` under
        ``on_rank_failure``): every process of the old one is killed first, then the new one
        starts (fresh rendezvous, weights loaded again, expert placement recomputed) and this
        client forgets everything in flight: outputs not yet returned are dropped, since the
        caller resends its requests from what it had received.

        Raises:
            EngineDeadError: as :meth:`EngineCoreClient.recover`.
        """
        successor = self.ranks.successor(error, policy=self.config.on_rank_failure)
        if successor is None:
            # nothing will run on the survivors any more: free them now (their collectives
            # would otherwise wait on the lost rank until the group timeout)
            self.ranks.kill(list(range(self.num_ranks)))
            raise EngineDeadError(f"{error} (on_rank_failure={self.config.on_rank_failure}: "
                                  f"the deployment stays down)") from error
        started = time.monotonic()
        old_size = self.num_ranks
        self.ranks.abandon()
        if successor is not self.ranks:
            self.num_ranks = len(successor.slots)
            self.config = self.config.with_data_parallel_size(self.num_ranks)
        self._outputs.clear()
        self._utility_results.clear()
        self._on_group_lost()
        try:
            self._start_group(successor)
        except (RuntimeError, zmq.ZMQError) as exc:
            raise EngineDeadError(f"{error}; the new group failed to start: {exc}") from exc
        self._failed = None
        self.generation += 1
        elapsed_s = time.monotonic() - started
        self._failure_stats["rank_recoveries"] += 1
        self._recovery_s["recovery_seconds_total"] += elapsed_s
        self._recovery_s["recovery_seconds_last"] = elapsed_s
        logger.warning("membership change: generation %d runs %d rank(s) (was %d; lost dp rank(s) "
                       "%s: %s), ready in %.1f s", self.generation, self.num_ranks, old_size,
                       error.dp_ranks, error, elapsed_s)

    def shutdown(self) -> None:
        """Shutdown to every core, then let :attr:`ranks` make sure they exit (spawned ones:
        SIGTERM, then SIGKILL, ``SHUTDOWN_GRACE_S`` apart); close the sockets, remove the ipc
        folder. Idempotent; never raises."""
        self._finalizer()

    # ----- internals -----

    def _start_group(self, ranks: RankProcesses) -> None:
        """Bind (unless ``ranks`` keeps the sockets it has), start the ranks, wait for them."""
        if ranks is not self._sockets.ranks:
            self._sockets.close()
            self._sockets.bind(ranks, self.num_ranks)
        ranks.start(self.config, input_addrs=self.input_addrs, output_addr=self.output_addr,
                    extra_eos_token_ids=self._extra_eos)
        self.runtime = self._wait_ready(self._startup_timeout_s)
        ranks.on_ready(self.pids)
        self._monitor.reset(self.num_ranks, time.monotonic())
        self._on_group_ready()

    def _on_group_lost(self) -> None:
        """Hook: a group was lost; forget what was in flight on it (the DP client's routing)."""

    def _on_group_ready(self) -> None:
        """Hook: every rank of a new group sent its ready message."""

    def _wait_ready(self, timeout_s: float) -> EngineRuntime:
        deadline = time.monotonic() + timeout_s
        ready: dict[int, ReadyMessage] = {}
        output = self._sockets.output
        while len(ready) < self.num_ranks:
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.num_ranks)) - set(ready))
                raise RuntimeError(f"engine core(s) of dp rank {missing} sent no ready message "
                                   f"within {timeout_s:.0f} s")
            if output.poll(int(POLL_SLICE_S * 1000)):
                message = decode_output(output.recv())
                if isinstance(message, ReadyMessage):
                    ready[message.dp_rank] = message
                elif isinstance(message, StartupFailed):
                    which = "" if self.num_ranks == 1 else f" of dp rank {message.dp_rank}"
                    raise EngineStartError(f"the engine core{which} failed to start: "
                                           f"{message.error}")
                elif not isinstance(message, Heartbeat):  # a ready rank beats while others load
                    logger.debug("ignored %s before the ready messages", type(message).__name__)
                continue
            dead = self.ranks.dead_message()
            if dead is not None:
                raise RuntimeError(f"the engine core failed to start: {dead}")
        messages = [ready[r] for r in range(self.num_ranks)]
        self.pids = [m.pid for m in messages]
        self.kv_event_publishers = [PublisherEndpoints(m.dp_rank, m.kv_events_endpoint,
                                                       m.kv_events_replay_endpoint)
                                    for m in messages if m.kv_events_endpoint is not None]
        return messages[0].runtime

    def _send(self, rank: int, message: CoreInput) -> None:
        # encode first: a bad value fails here, before anything is sent
        self._send_frame(rank, encode(message))

    def _send_frame(self, rank: int, data: bytes) -> None:
        """Send an encoded :data:`~atom.messages.CoreInput` to ``rank``'s core (waiting in
        slices while its queue is full, raising once a rank has failed)."""
        sock = self._sockets.inputs[rank]
        while True:
            self._raise_if_failed(check=False)
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                # no peer (it died) or the queue is full (it is busy): never block blind
                self._raise_if_failed()
                sock.poll(int(POLL_SLICE_S * 1000), zmq.POLLOUT)

    def _broadcast(self, message: CoreInput) -> None:
        for rank in range(self.num_ranks):
            self._send(rank, message)

    def _poll(self, timeout_s: float) -> None:
        """Receive every frame available within ``timeout_s``; when none but heartbeats came,
        check the ranks (frames a process sent before dying are delivered first).

        Raises:
            RankFailedError: a rank died or hung (or had, and no recovery followed).
        """
        self._raise_if_failed(check=False)
        output = self._sockets.output
        if self._output_poller is None or self._output_poller[0] is not output:
            # one poller per output socket (a recovery replaces the sockets): Socket.poll builds
            # a new Poller at every call, a third of the front end's CPU per token
            poller = zmq.Poller()
            poller.register(output, zmq.POLLIN)
            self._output_poller = (output, poller)
        got_data = False
        if self._output_poller[1].poll(int(timeout_s * 1000)):
            now = time.monotonic()
            while True:
                try:
                    frame = output.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = decode_output(frame)
                if isinstance(message, Heartbeat):
                    self._monitor.beat(message, now)
                    continue
                got_data = True
                if isinstance(message, EngineCoreOutputs):
                    self._on_outputs(message)
                elif isinstance(message, UtilityResult):
                    self._utility_results[(message.dp_rank, message.call_id)] = message
                else:
                    self._on_other(message)
        if not got_data:
            self._raise_if_failed()

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        if message.outputs:
            self._outputs.append(message.outputs)

    def _on_other(self, message: msgspec.Struct) -> None:
        logger.warning("ignored an unexpected %s from an engine core", type(message).__name__)

    def _raise_if_failed(self, *, check: bool = True) -> None:
        """Raise the standing failure; with ``check``, first look for a new one (an exited
        process, else a silent one: killed here, so that its peers stop waiting for it)."""
        if self._failed is None and check:
            failures = [RankFailure(rank, DEAD, what) for rank, what in self.ranks.exited()]
            if not failures:
                failures = self._monitor.hung(time.monotonic())
                self.ranks.kill([f.dp_rank for f in failures])
            if failures:
                self._record_failure(RankFailedError(failures))
        if self._failed is not None:
            raise self._failed

    def _record_failure(self, error: RankFailedError) -> None:
        self._failed = error
        for f in error.failures:
            self._failure_stats[f"rank_failures_{f.kind}"] += 1
            self.failures.append({"generation": self.generation, "dp_rank": f.dp_rank,
                                  "kind": f.kind, "reason": f.reason.splitlines()[0],
                                  "last_tick": f.last_tick})
        logger.error("rank failure in generation %d: %s", self.generation, error)


def _bind(sock: zmq.Socket, addr: str) -> str:
    """Bind ``addr``; returns the bound endpoint (a ``*`` port resolved)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _release(ctx: zmq.Context, sockets: _Sockets) -> None:
    """Shutdown to every core still listening, stop the processes, free the sockets and the
    folder (the finalizer; it holds no reference to the client)."""
    # with linger: launched ranks have nothing else telling them to stop than this Shutdown
    for sock in sockets.inputs:
        try:
            sock.setsockopt(zmq.LINGER, int(SHUTDOWN_GRACE_S * 1000))
            sock.send(encode(Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no peer: it is dying anyway; ranks.stop() signals it
    if sockets.ranks is not None:
        sockets.ranks.stop()
    for sock in sockets.inputs:
        sock.close()
    if sockets.output is not None:
        sockets.output.close(linger=0)
    ctx.destroy(linger=0)
    if sockets.ranks is not None:
        sockets.ranks.cleanup()
