"""AsyncEngine: an :class:`atom.engine.llm_engine.LLMEngine` driven by one thread, used from asyncio.

``LLMEngine`` is synchronous and not thread-safe, and its ``step()`` blocks (up to a second)
waiting for the engine cores. So one thread owns it and does everything with it:

    asyncio handlers ──(command queue: add / abort / call / stop)──> engine thread
    engine thread: drain commands → engine.step() → RequestOutputs
    engine thread ──(loop.call_soon_threadsafe)──> one asyncio.Queue per request

While no request is unfinished the thread sleeps on the command queue, waking every
:data:`IDLE_CHECK_S` to look at its ranks (:meth:`LLMEngine.check_ranks`): a rank that dies
while the server is idle is recovered from at once, not when the next request comes. A request
whose consumer goes away (client disconnect, cancelled task) is aborted by :meth:`generate`'s
``finally``; a request that finished inside the engine is never aborted (no abort message).

If the engine dies (an engine-core process exited or hung and the deployment cannot go on:
``EngineDeadError``), every open request and every later call gets that error;
:attr:`dead_error` says why. A rank failure the engine recovers from happens inside a
``step()`` on this thread (docs/ARCHITECTURE.md, "Rank failures"): open streams pause and go on,
requests submitted meanwhile wait in the queue, and :attr:`status` (readable from any thread)
says ``recovering``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from atom.engine.llm_engine import DEAD, EngineStatus
from atom.engine.core_client import EngineDeadError
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_CHECK_S = 1.0  # an idle engine thread's wake-up period, to notice a failed rank


@dataclass(frozen=True)
class Routing:
    """Where the DP router sends a request (both ignored with one rank).

    Attributes:
        session_id: the conversation it belongs to (``cache_aware`` keeps a session on its rank).
        data_parallel_rank: pins the DP rank, bypassing the router's policy.
    """

    session_id: str | None = None
    data_parallel_rank: int | None = None


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    routing: Routing
    stream: "_Stream"
    kv_transfer_params: Any = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


@dataclass(eq=False)  # hashable by identity: AsyncEngine keeps the open ones in a set
class _Stream:
    """Where one request's outputs go: an asyncio queue on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """Owns an ``LLMEngine`` and the thread that drives it.

    Args:
        engine: the engine (built by :func:`atom.entrypoints.llm.build_engine`); from now on
            only this object's thread touches it.
        on_finished: called on the engine thread with every request's final output (metrics).

    Guarantees: each request's outputs arrive in order, the last one with ``finished=True``;
    outputs of requests nobody waits for any more are dropped.
    """

    def __init__(self, engine, *, on_finished: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self._on_finished = on_finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # the engine thread's
        self._open: set[_Stream] = set()  # the event loop's: streams a generate() awaits
        self._lock = threading.Lock()  # orders "submit a command" against "the thread ended"
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="atom-engine", daemon=True)
        self._thread.start()

    @property
    def status(self) -> EngineStatus:
        """The engine's :class:`~atom.engine.llm_engine.EngineStatus`; ``dead`` once the thread stopped
        (safe from any thread: the engine replaces its status, never mutates it)."""
        status = self.engine.status
        if self.dead_error is not None and status.state != DEAD:
            status = EngineStatus(DEAD, str(self.dead_error), status.membership)
        return status

    # ----- asyncio side -----

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, prompt: str | None = None, routing: Routing = Routing(),
                       kv_transfer_params: Any = None) -> AsyncIterator[RequestOutput]:
        """Run one request (``routing``: its session and rank pin, for the DP router; with
        ``kv_transfer_params``, a :class:`~atom.messages.KVTransferParams`: its P/D half);
        yields its outputs, the last one finished.

        Closing the iterator early (or cancelling the task awaiting it) aborts the request, so
        its KV blocks are freed within a step.

        Raises:
            EngineDeadError: the engine died before or while the request ran.
            ValueError: ``request_id`` is already in use, or ``routing.data_parallel_rank`` is
                not a rank of the group now.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(_Add(request_id, list(prompt_token_ids), params, prompt, routing, stream,
                          kv_transfer_params))
        finished = False
        self._open.add(stream)
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has no such request: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            self._open.discard(stream)
            if not finished and self.dead_error is None:
                self._commands.put(_Abort(request_id))

    def fail_open_requests(self, reason: str) -> None:
        """End every open request now with ``EngineDeadError(reason)`` and refuse new ones,
        without waiting for the engine thread (it may be inside a step that waits for ranks
        that are being stopped); then stop that thread. For the event loop's thread: a front
        end whose ranks are stopping at the same moment (``atom launch``) cannot drain.
        Idempotent."""
        error = EngineDeadError(reason)
        with self._lock:
            if self.dead_error is None:
                self.dead_error = error
        for stream in list(self._open):
            stream.queue.put_nowait(error)
        self._commands.put(_Stop())

    async def call(self, fn: Callable[[Any], T], *, timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread (between steps) and return its result.

        Raises:
            EngineDeadError: the engine is dead.
            TimeoutError: no result within ``timeout_s`` seconds (a stuck engine).
            Whatever ``fn`` raises.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (open requests get ``EngineDeadError``); the engine keeps running
        and, once the thread has ended, the caller may use it (the server's last stats).
        Idempotent."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """:meth:`stop`, then shut the engine down (its cores exit). Idempotent."""
        self.stop(timeout_s)
        self.engine.shutdown()

    def _submit(self, command: _Add | _Call) -> None:
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is not running: {self.dead_error}")
            self._commands.put(command)

    # ----- engine thread -----

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
            reason: BaseException = EngineDeadError("the server is shutting down")
        except EngineDeadError as exc:  # the cause is named in the message: no traceback
            logger.error("the engine thread stopped: %s", exc)
            reason = exc
        except Exception as exc:  # a bug: never hang clients
            logger.exception("the engine thread stopped")
            reason = exc
        with self._lock:
            if self.dead_error is None:  # fail_open_requests may have said why first
                self.dead_error = reason
        for stream in self._streams.values():
            stream.put(reason)
        self._streams.clear()
        self._fail_pending_calls(reason)

    def _handle_commands(self, *, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once told to stop."""
        try:
            command = self._commands.get(timeout=IDLE_CHECK_S) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            if block:
                self.engine.check_ranks()
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._streams[command.request_id] = command.stream
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids,
                                        command.params, prompt=command.prompt,
                                        session_id=command.routing.session_id,
                                        data_parallel_rank=command.routing.data_parallel_rank,
                                        **({} if command.kv_transfer_params is None else
                                           {"kv_transfer_params": command.kv_transfer_params}))
            except ValueError as exc:  # a duplicate id or rank: that request fails, nothing else
                self._streams.pop(command.request_id)
                command.stream.put(exc)
        elif isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
        else:
            # a caller that timed out (a slow /health or /metrics under load) cancelled its
            # future: nobody waits for the answer, and setting one would raise here, on the
            # engine thread, and stop the server
            if not command.future.set_running_or_notify_cancel():
                return
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:  # the caller gets it; a dead core also ends this thread
                command.future.set_exception(exc)
                if not self.engine.client_is_alive():
                    raise

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            stream = self._streams.pop(out.request_id, None)
            if self._on_finished is not None:
                self._on_finished(out)
        else:
            stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)

    def _fail_pending_calls(self, reason: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.future.set_exception(EngineDeadError(str(reason)))
            elif isinstance(command, _Add):
                command.stream.put(EngineDeadError(str(reason)))
