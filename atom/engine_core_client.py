"""EngineCoreClient: the front end's handle on one EngineCore process (ZMQ, msgpack frames).

The client binds two sockets and starts :mod:`atom.engine_core_proc`, which connects to them:

    front end                           engine core process
    PUSH  input_addr   ── CoreInput ──>  PULL
    PULL  output_addr  <─ CoreOutput ──  PUSH

By default both are ``ipc://`` paths in a fresh ``tempfile.mkdtemp()`` folder, so two
deployments on one machine never collide; explicit addresses (``tcp://127.0.0.1:PORT``, or
``tcp://127.0.0.1:*`` for a free port) let flags pin them. Frames are msgspec msgpack, never
pickle.

Liveness: nothing here waits on the core without also watching its process. Every wait polls
in short slices and checks ``proc.poll()``, so a core that dies at start-up raises
``RuntimeError`` (exit code and the tail of its stderr) and one that dies later raises
:class:`EngineDeadError` within a slice (0.1 s) of the next call, never a hang. The core's
stderr is forwarded to this process's stderr line by line (and its tail kept for those errors).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable

import zmq

from atom.config import EngineConfig
from atom.engine_core import EngineRuntime
from atom.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    ReadyMessage,
    SeqOutput,
    Shutdown,
    UtilityCall,
    UtilityResult,
    decode_output,
    encode,
)

logger = logging.getLogger(__name__)

_POLL_SLICE_S = 0.1  # how often a wait checks that the core process is alive
_STDERR_TAIL_LINES = 40
_SHUTDOWN_GRACE_S = 5.0  # after Shutdown, before SIGTERM; and after SIGTERM, before SIGKILL


class EngineDeadError(RuntimeError):
    """The engine-core process exited while the front end still needed it."""


class EngineCoreClient:
    """Starts one EngineCore process and talks to it.

    Args:
        config: engine options (sent to the process as JSON).
        dp_rank: the core's DP rank.
        input_addr, output_addr: ZMQ endpoints to bind; None = ``ipc://`` paths in a fresh
            temporary folder (removed at shutdown).
        extra_eos_token_ids: EOS ids the front end knows besides the model config's.
        startup_timeout_s: how long to wait for the ready message (loading weights) in seconds.

    Raises:
        RuntimeError: the process exited (exit code and stderr tail in the message) or sent no
            ready message within ``startup_timeout_s``.
        zmq.ZMQError: an address cannot be bound (e.g. a pinned TCP port in use).
    """

    def __init__(self, config: EngineConfig, *, dp_rank: int = 0, input_addr: str | None = None,
                 output_addr: str | None = None, extra_eos_token_ids: tuple[int, ...] = (),
                 startup_timeout_s: float = 600.0):
        self.dp_rank = dp_rank
        self._ipc_dir = None if input_addr and output_addr else tempfile.mkdtemp(prefix="atom-core-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.proc: subprocess.Popen | None = None
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._input, None, self._ipc_dir)
        self.input_addr = _bind(self._input, input_addr or f"ipc://{self._ipc_dir}/input")
        self.output_addr = _bind(self._output, output_addr or f"ipc://{self._ipc_dir}/output")
        self._outputs: collections.deque[list[SeqOutput]] = collections.deque()
        self._utility_results: dict[int, UtilityResult] = {}
        self._call_ids = itertools.count()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atom.engine_core_proc",
             "--config-json", json.dumps(dataclasses.asdict(config)),
             "--input-addr", self.input_addr, "--output-addr", self.output_addr,
             "--dp-rank", str(dp_rank), "--extra-eos-token-ids", *map(str, extra_eos_token_ids),
             "--log-level", logging.getLevelName(logging.getLogger("atom").getEffectiveLevel())],
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._input, self.proc,
                                           self._ipc_dir)
        self._stderr_thread = threading.Thread(target=_forward_stderr, daemon=True, name="atom-core-stderr",
                                               args=(self.proc.stderr, self._stderr_tail))
        self._stderr_thread.start()
        try:
            self.runtime = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ----- requests -----

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request.

        Raises:
            OverflowError: a number in it does not fit msgpack's 64-bit integers.
            EngineDeadError: the core process is gone.
        """
        self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        """Client aborts: the core frees these requests' KV blocks."""
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        """Stop strings the front end matched: the core finishes these sequences (not aborts)."""
        if seq_keys:
            self._send(FinishRequests(list(seq_keys), list(stop_reasons)))

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        """Sequence outputs of the core's steps, oldest first; waits up to ``timeout_s`` seconds
        (None = until some arrive) and returns ``[]`` when none came.

        Raises:
            EngineDeadError: the core process exited (outputs it sent before are returned first).
        """
        return drain_outputs(self._outputs, self._poll, timeout_s)

    def call_utility(self, method: str) -> dict:
        """Run a core method (``get_stats``, ``reset_prefix_cache``) after every input sent so
        far and return its result. Outputs that arrive meanwhile are kept for ``get_outputs``.

        Raises:
            ValueError: the core does not know ``method``.
            EngineDeadError: the core process exited.
        """
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id=call_id, method=method))
        while call_id not in self._utility_results:
            self._poll(_POLL_SLICE_S)
        result = self._utility_results.pop(call_id)
        if result.error is not None:
            raise ValueError(result.error)
        return dict(result.result or {})

    def get_stats(self) -> dict:
        return self.call_utility("get_stats")

    def shutdown(self) -> None:
        """Stop the core (Shutdown, then SIGTERM, then SIGKILL, ``_SHUTDOWN_GRACE_S`` apart),
        close the sockets and remove the ipc folder. Idempotent; never raises."""
        self._finalizer()
        if self._stderr_thread_started():
            self._stderr_thread.join(timeout=1.0)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ----- internals -----

    def _stderr_thread_started(self) -> bool:
        return getattr(self, "_stderr_thread", None) is not None and self._stderr_thread.is_alive()

    def _wait_ready(self, timeout_s: float) -> EngineRuntime:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output.poll(int(_POLL_SLICE_S * 1000)):
                message = decode_output(self._output.recv())
                if isinstance(message, ReadyMessage):
                    return EngineRuntime(
                        num_kv_blocks=message.num_kv_blocks, max_model_len=message.max_model_len,
                        vocab_size=message.vocab_size, eos_token_ids=tuple(message.eos_token_ids),
                        kv_cache_bytes=message.kv_cache_bytes, dtype=message.dtype)
                logger.warning("ignored %s before the ready message", type(message).__name__)
            elif self.proc.poll() is not None:
                raise RuntimeError(f"the engine core failed to start: {self._death_message()}")
        raise RuntimeError(f"the engine core sent no ready message within {timeout_s:.0f} s "
                           f"(pid {self.proc.pid}); stderr tail:\n{self._tail()}")

    def _send(self, message: CoreInput) -> None:
        data = encode(message)  # encode first: a bad value fails here, before anything is sent
        while True:
            try:
                self._input.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                # no peer (it died) or the queue is full (it is busy): never block blind
                self._raise_if_dead()
                self._input.poll(int(_POLL_SLICE_S * 1000), zmq.POLLOUT)

    def _poll(self, timeout_s: float) -> None:
        """Receive every frame available within ``timeout_s``; raise if none came and the
        process is dead (frames it sent before dying are delivered first)."""
        if not self._output.poll(int(timeout_s * 1000)):
            self._raise_if_dead()
            return
        while self._output.poll(0):
            message = decode_output(self._output.recv())
            if isinstance(message, EngineCoreOutputs):
                self._outputs.append(message.outputs)
            elif isinstance(message, UtilityResult):
                self._utility_results[message.call_id] = message
            else:
                logger.warning("ignored an unexpected %s from the engine core", type(message).__name__)

    def _raise_if_dead(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise EngineDeadError(f"the engine core is dead: {self._death_message()}")

    def _death_message(self) -> str:
        if self.proc is None:
            return "it was shut down"
        self._stderr_thread.join(timeout=1.0)  # let the last lines arrive
        rc = self.proc.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
        return f"process {self.proc.pid} (dp rank {self.dp_rank}) exited, {how}; stderr tail:\n{self._tail()}"

    def _tail(self) -> str:
        return "".join(self._stderr_tail) or "(empty)"


def drain_outputs(pending: collections.deque, poll: Callable[[float], None],
                  timeout_s: float | None) -> list[SeqOutput]:
    """Wait (in ``_POLL_SLICE_S`` slices, so a dead process is noticed) until ``pending`` holds
    output batches or ``timeout_s`` passed (None = no limit); then empty it, oldest first.

    ``poll(slice_s)`` receives frames into ``pending`` and raises if the process died.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not pending:
        remaining_s = _POLL_SLICE_S if deadline is None else deadline - time.monotonic()
        poll(max(0.0, min(_POLL_SLICE_S, remaining_s)))
        if deadline is not None and time.monotonic() >= deadline:
            break
    outputs: list[SeqOutput] = []
    while pending:
        outputs += pending.popleft()
    return outputs


def _bind(socket: zmq.Socket, addr: str) -> str:
    """Bind ``addr``; returns the bound endpoint (a ``*`` port resolved)."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(addr)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def _forward_stderr(pipe, tail: collections.deque) -> None:
    """Copy the core's stderr to ours (fd 2) line by line, keeping the last lines."""
    for raw in iter(pipe.readline, b""):
        tail.append(raw.decode(errors="replace"))
        try:
            os.write(2, raw)
        except OSError:  # our stderr is closed: keep draining so the core never blocks
            pass
    pipe.close()


def _release(ctx: zmq.Context, input_socket: zmq.Socket, proc: subprocess.Popen | None,
             ipc_dir: str | None) -> None:
    """Stop ``proc`` and free the sockets and folder (the finalizer; holds no client ref)."""
    if proc is not None and proc.poll() is None:
        try:
            input_socket.send(encode(Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no peer: it is dying anyway; SIGTERM below
        for stop in (None, proc.terminate, proc.kill):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=_SHUTDOWN_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue
    ctx.destroy(linger=0)
    if ipc_dir is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)
