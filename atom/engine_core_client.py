"""The front end's handle on its engine cores: one interface, an in-process and a ZMQ family.

:class:`EngineCoreClient` is the interface every front end (:class:`atom.engine.LLMEngine`, so
``LLM``, the CLI and the OpenAI server) speaks: add, abort, finish, outputs, utility calls
(merged or per rank), per-rank stats, liveness, shutdown. :class:`InprocClient` runs an
:class:`~atom.engine_core.EngineCore` in this process (tests that look inside). :class:`MPClient`
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

- :class:`SpawnedRanks` (default): the client starts one ``python -m ENTRY_MODULE`` process per
  rank on this node, over ``ipc://`` sockets in a fresh temporary folder (so two deployments on
  one machine never collide), with the rank contract in each environment (RANK=i, WORLD_SIZE=N,
  LOCAL_RANK=i, LOCAL_WORLD_SIZE=N, MASTER_ADDR=127.0.0.1, a free MASTER_PORT, OMP_NUM_THREADS
  from :func:`atom.config.resolve_num_threads`), and forwards their stderr line by line;
- ``LaunchedRanks`` (:mod:`atom.dp.dp_client`): a launcher started the ranks.

Frames are msgspec msgpack, never pickle.

Liveness: nothing here waits on a core without also watching its process. Every wait polls in
short slices and asks ``ranks.dead_message()``, so a core that dies at start-up raises
``RuntimeError`` (rank, exit code and the tail of its stderr) and one that dies later raises
:class:`EngineDeadError` within a slice (0.1 s) of the next call, never a hang.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq

from atom.config import EngineConfig, oversubscription_warning, resolve_num_threads
from atom.kv_subscriber import PublisherEndpoints
from atom.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineRuntime,
    FinishRequests,
    ReadyMessage,
    SeqOutput,
    Shutdown,
    UtilityCall,
    UtilityResult,
    decode_output,
    encode,
)

if TYPE_CHECKING:
    from atom.engine_core import EngineCore

logger = logging.getLogger(__name__)

POLL_SLICE_S = 0.1  # how often a wait checks that the core processes are alive
SHUTDOWN_GRACE_S = 5.0  # after Shutdown, before SIGTERM; and after SIGTERM, before SIGKILL
_STDERR_TAIL_LINES = 40

# get_stats keys that are not summed across ranks by call_utility (the merged view takes the
# max): per-rank positions and the group's own counters, which every rank holds a copy of (the
# KV pool's sizes are summed: free and total blocks of the whole deployment)
_NOT_SUMMED = frozenset(("dp_rank", "tick", "wave_id", "collective_count", "collective_hash",
                         "idle", "num_waves_completed", "num_steps", "num_prefill_steps",
                         "num_mixed_prefill_steps", "num_tbo_steps"))
_NOT_SUMMED_PREFIXES = ("prefill_policy_",)  # the prefill decisions: identical on every rank


def merge_rank_results(results: list[dict]) -> dict:
    """One dict from every rank's utility result: numbers summed over ranks (counters such
    as the tick or the collective hash, and flags: the max; ``prefix_cache_hit_rate``
    recomputed from the summed tokens). One rank: its result as it is."""
    merged: dict = {}
    for result in results:
        for key, value in result.items():
            if key not in merged:
                merged[key] = value
            elif (isinstance(value, bool) or key in _NOT_SUMMED
                  or key.startswith(_NOT_SUMMED_PREFIXES)):
                merged[key] = max(merged[key], value)
            else:
                merged[key] += value
    if len(results) > 1 and "prefix_cache_hit_rate" in merged:
        queries = merged["prefix_cache_queries"]
        merged["prefix_cache_hit_rate"] = merged["prefix_cache_hits"] / queries if queries else 0.0
    return merged


class EngineDeadError(RuntimeError):
    """An engine-core process exited while the front end still needed it."""


class EngineCoreClient:
    """The client interface of a front end over its engine cores (module docstring).

    ``runtime`` (:class:`~atom.messages.EngineRuntime`) is set once the cores are ready.
    """

    runtime: EngineRuntime

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> None:
        """Send a request. ``data_parallel_rank`` pins the DP rank, ``session_id`` names the
        conversation it belongs to (DP routing; both ignored with one rank; the session id
        never reaches the core).

        Raises:
            ValueError: (DP) a bad rank hint, or a request id already running.
            OverflowError, msgspec.EncodeError: a value msgpack cannot hold (nothing is sent).
            EngineDeadError: a core process is gone.
        """
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        """Client aborts: the owning cores free these requests' KV blocks (nothing is
        reported back: the front end ended them)."""
        raise NotImplementedError

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        """Stop strings the front end matched: the owning cores finish these
        ``(request_id, index)`` sequences (not aborts) and free their KV blocks."""
        raise NotImplementedError

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        """Sequence outputs of the cores' steps, oldest first; ``[]`` when none came within
        ``timeout_s`` seconds (None = wait until some arrive).

        Raises:
            EngineDeadError: a core process exited (outputs it sent before come first).
        """
        raise NotImplementedError

    def call_utility_per_rank(self, method: str) -> list[dict]:
        """Run a core method (``get_stats``, ``reset_prefix_cache``) on every core, after every
        input sent so far; results in rank order.

        Raises:
            ValueError: the core does not know ``method``.
            EngineDeadError: a core process exited.
        """
        raise NotImplementedError

    def is_alive(self) -> bool:
        """False once any core process has exited (in-process: always True)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the cores and free what the client holds. Idempotent; never raises."""
        raise NotImplementedError

    def call_utility(self, method: str) -> dict:
        """``method`` on every core, merged over ranks (:func:`merge_rank_results`)."""
        return merge_rank_results(self.call_utility_per_rank(method))

    def get_stats(self) -> dict:
        """The KV pool, queue and prefix-cache counters summed over ranks, plus the front
        end's own (:meth:`front_end_stats`)."""
        return {**merge_rank_results(self.get_rank_stats()), **self.front_end_stats()}

    def get_rank_stats(self) -> list[dict]:
        """Each rank's ``get_stats`` (DP ranks add tick, wave, collective count and hash,
        prefill policy counters; the DP client adds its router's counters for the rank)."""
        return self.call_utility_per_rank("get_stats")

    def front_end_stats(self) -> dict:
        """Counters of this process that belong to no rank (the DP client's KV event
        subscriber); no round trip to the cores."""
        return {}


class InprocClient(EngineCoreClient):
    """An :class:`~atom.engine_core.EngineCore` in this process: ``get_outputs`` runs one step
    (tests that look inside the scheduler or block manager use this)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.runtime = core.runtime

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> None:
        encode(request)  # the same check as the socket path: a value msgpack cannot hold raises
        self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        self.core.finish_requests(seq_keys, stop_reasons)

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        return self.core.step() if self.core.has_work() else []

    def call_utility_per_rank(self, method: str) -> list[dict]:
        return [self.core.call_utility(method)]

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.core.close()


class RankProcesses(Protocol):
    """Who starts and watches a client's core processes (:class:`SpawnedRanks`, or the DP
    client's ``LaunchedRanks``)."""

    def address(self, name: str) -> str:
        """Where the client binds socket ``name`` (``output``, ``input0``, ...)."""

    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        """Start (or tell) every rank; each connects and sends its ready message."""

    def is_alive(self) -> bool: ...

    def dead_message(self) -> str | None:
        """None while every rank runs; else which one exited, how, and its stderr tail."""

    def stop(self) -> None:
        """After the Shutdown messages: make sure every rank exits."""

    def cleanup(self) -> None: ...


class MPClient(EngineCoreClient):
    """Starts the engine-core processes of a deployment and talks to them over ZMQ.

    Args:
        config: engine options (sent to the processes as JSON); ``data_parallel_size`` cores.
        extra_eos_token_ids: EOS ids the front end knows besides the model config's.
        startup_timeout_s: how long to wait for every ready message (loading weights), seconds.
        ranks: who starts the processes; default :class:`SpawnedRanks` of ``ENTRY_MODULE``.

    Raises:
        RuntimeError: a process exited during start-up (rank, exit code and stderr tail in the
            message) or sent no ready message within ``startup_timeout_s``.
        zmq.ZMQError: an address cannot be bound.
    """

    ENTRY_MODULE = "atom.engine_core_proc"  # the process each rank runs (spawned ranks)

    def __init__(self, config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...] = (),
                 startup_timeout_s: float = 600.0, ranks: RankProcesses | None = None):
        self.config = config
        self.num_ranks = config.data_parallel_size
        self.ranks = SpawnedRanks(self.ENTRY_MODULE) if ranks is None else ranks
        self._ctx = zmq.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._inputs = [self._ctx.socket(zmq.PUSH) for _ in range(self.num_ranks)]
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._inputs, self.ranks)
        self.output_addr = _bind(self._output, self.ranks.address("output"))
        self.input_addrs = [_bind(s, self.ranks.address(f"input{i}"))
                            for i, s in enumerate(self._inputs)]
        self._outputs: collections.deque[list[SeqOutput]] = collections.deque()
        # where each rank publishes KV events (from the ready messages; [] when off)
        self.kv_event_publishers: list[PublisherEndpoints] = []
        self._utility_results: dict[tuple[int, int], UtilityResult] = {}
        self._call_ids = itertools.count()
        try:
            self.ranks.start(config, input_addrs=self.input_addrs, output_addr=self.output_addr,
                             extra_eos_token_ids=extra_eos_token_ids)
            self.runtime = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ----- requests (one rank: everything goes to core 0; the DP client routes) -----

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> None:
        self._send(0, request)

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

    def call_utility_per_rank(self, method: str) -> list[dict]:
        # outputs that arrive meanwhile are kept for get_outputs
        call_id = next(self._call_ids)
        for rank in range(self.num_ranks):
            self._send(rank, UtilityCall(call_id=call_id, method=method))
        keys = [(rank, call_id) for rank in range(self.num_ranks)]
        while not all(k in self._utility_results for k in keys):
            self._poll(POLL_SLICE_S)
        results = [self._utility_results.pop(k) for k in keys]
        for r in results:
            if r.error is not None:
                raise ValueError(r.error)
        return [dict(r.result or {}) for r in results]

    # ----- lifecycle -----

    def is_alive(self) -> bool:
        return self.ranks.is_alive()

    def shutdown(self) -> None:
        """Shutdown to every core, then let :attr:`ranks` make sure they exit (spawned ones:
        SIGTERM, then SIGKILL, ``SHUTDOWN_GRACE_S`` apart); close the sockets, remove the ipc
        folder. Idempotent; never raises."""
        self._finalizer()

    # ----- internals -----

    def _wait_ready(self, timeout_s: float) -> EngineRuntime:
        deadline = time.monotonic() + timeout_s
        ready: dict[int, EngineRuntime] = {}
        while len(ready) < self.num_ranks:
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.num_ranks)) - set(ready))
                raise RuntimeError(f"engine core(s) of dp rank {missing} sent no ready message "
                                   f"within {timeout_s:.0f} s")
            if self._output.poll(int(POLL_SLICE_S * 1000)):
                message = decode_output(self._output.recv())
                if isinstance(message, ReadyMessage):
                    ready[message.dp_rank] = message.runtime
                    if message.kv_events_endpoint is not None:
                        self.kv_event_publishers.append(PublisherEndpoints(
                            message.dp_rank, message.kv_events_endpoint,
                            message.kv_events_replay_endpoint))
                else:
                    logger.warning("ignored %s before the ready messages", type(message).__name__)
                continue
            dead = self.ranks.dead_message()
            if dead is not None:
                raise RuntimeError(f"the engine core failed to start: {dead}")
        self.kv_event_publishers.sort(key=lambda p: p.dp_rank)
        return ready[0]

    def _send(self, rank: int, message: CoreInput) -> None:
        data = encode(message)  # encode first: a bad value fails here, before anything is sent
        sock = self._inputs[rank]
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                # no peer (it died) or the queue is full (it is busy): never block blind
                self._raise_if_dead()
                sock.poll(int(POLL_SLICE_S * 1000), zmq.POLLOUT)

    def _broadcast(self, message: CoreInput) -> None:
        for rank in range(self.num_ranks):
            self._send(rank, message)

    def _poll(self, timeout_s: float) -> None:
        """Receive every frame available within ``timeout_s``; raise if none came and a
        process is dead (frames it sent before dying are delivered first)."""
        if not self._output.poll(int(timeout_s * 1000)):
            self._raise_if_dead()
            return
        while self._output.poll(0):
            message = decode_output(self._output.recv())
            if isinstance(message, EngineCoreOutputs):
                self._on_outputs(message)
            elif isinstance(message, UtilityResult):
                self._utility_results[(message.dp_rank, message.call_id)] = message
            else:
                self._on_other(message)

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        if message.outputs:
            self._outputs.append(message.outputs)

    def _on_other(self, message: msgspec.Struct) -> None:
        logger.warning("ignored an unexpected %s from an engine core", type(message).__name__)

    def _raise_if_dead(self) -> None:
        dead = self.ranks.dead_message()
        if dead is not None:
            raise EngineDeadError(f"the engine core is dead: {dead}")


class SpawnedRanks:
    """The core processes a client starts itself on this node: one ``python -m entry_module``
    per rank, over ``ipc://`` sockets in a fresh temporary folder (removed by :meth:`cleanup`).

    Args:
        entry_module: the process each rank runs (its ``main()`` takes :func:`core_argv`).
    """

    def __init__(self, entry_module: str):
        self.entry_module = entry_module
        self._ipc_dir = tempfile.mkdtemp(prefix="atom-core-")
        self.procs: list[subprocess.Popen] = []
        self._tails: list[collections.deque] = []
        self._stderr_threads: list[threading.Thread] = []

    def address(self, name: str) -> str:
        return f"ipc://{self._ipc_dir}/{name}"

    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        n = config.data_parallel_size
        num_threads = resolve_num_threads(config.num_threads, num_local_ranks=n)
        warning = oversubscription_warning(n)
        if warning is not None:
            logger.warning("%s", warning)
        port = _free_port() if n > 1 else 0
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(num_threads)}
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # these ranks host their own store
            argv = [sys.executable, "-m", self.entry_module,
                    *core_argv(config, input_addr=input_addrs[rank], output_addr=output_addr,
                               extra_eos_token_ids=extra_eos_token_ids)]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
            self.procs.append(proc)
            tail: collections.deque = collections.deque(maxlen=_STDERR_TAIL_LINES)
            self._tails.append(tail)
            thread = threading.Thread(target=_forward_stderr, daemon=True,
                                      name=f"atom-dp{rank}-stderr", args=(proc.stderr, tail))
            thread.start()
            self._stderr_threads.append(thread)

    def is_alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def dead_message(self) -> str | None:
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                self._stderr_threads[rank].join(timeout=1.0)  # let the last lines arrive
                rc = p.returncode
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                tail = "".join(self._tails[rank]) or "(empty)"
                return f"process {p.pid} (dp rank {rank}) exited, {how}; stderr tail:\n{tail}"
        return None

    def stop(self) -> None:
        """Wait, then SIGTERM, then SIGKILL, each ``SHUTDOWN_GRACE_S`` long, until every rank
        has exited."""
        for stop in ("wait", "terminate", "kill"):
            live = [p for p in self.procs if p.poll() is None]
            if not live:
                break
            for p in live:
                if stop != "wait":
                    getattr(p, stop)()
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for p in live:
                try:
                    p.wait(timeout=max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for thread in self._stderr_threads:
            thread.join(timeout=1.0)

    def cleanup(self) -> None:
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def core_argv(config: EngineConfig, *, input_addr: str, output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> list[str]:
    """The command-line arguments of an engine-core process (parsed by
    :func:`atom.engine_core_proc.parse_args`)."""
    log_level = logging.getLevelName(logging.getLogger("atom").getEffectiveLevel())
    return ["--config-json", json.dumps(msgspec.to_builtins(config)),
            "--input-addr", input_addr, "--output-addr", output_addr,
            "--extra-eos-token-ids", *map(str, extra_eos_token_ids), "--log-level", log_level]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bind(sock: zmq.Socket, addr: str) -> str:
    """Bind ``addr``; returns the bound endpoint (a ``*`` port resolved)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _forward_stderr(pipe, tail: collections.deque) -> None:
    """Copy a core's stderr to ours (fd 2) line by line, keeping the last lines."""
    for raw in iter(pipe.readline, b""):
        tail.append(raw.decode(errors="replace"))
        try:
            os.write(2, raw)
        except OSError:  # our stderr is closed: keep draining so the core never blocks
            pass
    pipe.close()


def _release(ctx: zmq.Context, inputs: list[zmq.Socket], ranks: RankProcesses) -> None:
    """Shutdown to every core still listening, stop the processes, free the sockets and the
    folder (the finalizer; it holds no reference to the client)."""
    # with linger: launched ranks have nothing else telling them to stop than this Shutdown
    for sock in inputs:
        try:
            sock.setsockopt(zmq.LINGER, int(SHUTDOWN_GRACE_S * 1000))
            sock.send(encode(Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no peer: it is dying anyway; ranks.stop() signals it
    ranks.stop()
    for sock in inputs:
        sock.close()
    ctx.destroy(linger=0)
    ranks.cleanup()
