"""The EngineCore process: the busy loop between the input and output ZMQ sockets.

Started by :class:`atom.engine.core_client.MPClient` (one rank) as::

    python -m atom.engine.core_proc --config-json '{...EngineConfig fields...}' \\
        --input-addr ADDR --output-addr ADDR [--extra-eos-token-ids 2 ...] [--log-level L]

The front end binds both sockets; this process connects a PULL socket to ``--input-addr``
(:data:`~atom.messages.CoreInput` frames) and a PUSH socket to ``--output-addr``
(:data:`~atom.messages.CoreOutput` frames). Every frame is msgspec msgpack; nothing is pickled
(the config travels as JSON of :class:`~atom.config.EngineConfig` fields). A DP rank
(:mod:`atom.dp.dp_core_proc`) takes the same arguments and runs the same :func:`run_process`
skeleton with its own body; its DP rank comes from ``RANK`` in its environment.

Lifecycle and exit codes:

- after the weights are loaded and the KV pool sized, one :class:`~atom.messages.ReadyMessage`,
  then heartbeats from a thread of their own (:class:`atom.engine.liveness.HeartbeatThread`, every
  :func:`atom.engine.liveness.heartbeat_interval_s`, with :attr:`EngineCoreProc.tick`) until exit;
- the loop: with no work, block on the input socket (no busy spinning; it wakes once a second
  only to notice a dead parent); with work, drain every pending input without blocking, then
  :meth:`EngineCore.step`, then send the step's outputs (if any);
- :class:`~atom.messages.Shutdown` (or SIGTERM) → exit 0; the parent gone → exit 0 (the busy
  loop notices; before it runs, :func:`atom.engine.parent_watch.watch_parent`, started first thing,
  turns the parent's death into a SIGTERM);
- an exception in start-up → one :class:`~atom.messages.StartupFailed` (the cause in one
  line; the client raises it as :class:`~atom.engine.liveness.EngineStartError`), the
  traceback in the log at DEBUG only (the front end shows the line; ``--log-level DEBUG``
  shows both), exit 1;
- an exception in the loop → the traceback on stderr, nothing more is sent, exit 1. A client
  notices the exit code (``EngineDeadError``).

SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group of a launched rank,
and the front end owns the lifecycle (it sends Shutdown on its way out). A core its front end
spawned runs in a session of its own (:mod:`atom.engine.spawned_ranks`) and gets neither.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from atom.config import EngineConfig
from atom.engine.liveness import HeartbeatThread, heartbeat_interval_s
from atom.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    ReadyMessage,
    SeqOutput,
    Shutdown,
    StartWave,
    StartupFailed,
    UtilityCall,
    UtilityResult,
    decode_input,
    encode,
    request_of_bad_frame,
)
from atom.engine.parent_watch import watch_parent

if TYPE_CHECKING:
    from atom.engine.core import EngineCore

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # idle wake-up period, only to notice that the parent died
_STARTUP_FAILED_SEND_MS = 2000  # how long a failed core tries to hand its error over
TEARDOWN_STACKS_AFTER_S = 5.0  # below the launcher's --term-timeout-s (10 s by default)
# whether this process sent its ready message: an exception before it is a start-up failure
# (reported to the front end as one line), after it a failure of the loop
_ready_sent = False

# Rank 0 of a launched deployment sends it to its front end when SIGTERM stops the ranks (the
# launcher stops every rank: a rank failed, or it was told to stop) and no restart keeps the
# front end: its open requests cannot finish, so it fails them at once. A SIGTERM to the front
# end alone still drains (the ranks run on until it sends Shutdown).
RANKS_STOPPING_SIGNAL = signal.SIGUSR1


class ShutdownRequested(BaseException):
    """SIGTERM arrived: leave the loop as if a Shutdown message had."""


def dump_stacks_if_still_running(after_s: float = TEARDOWN_STACKS_AFTER_S) -> None:
    """Arm a timer that prints every thread's stack to stderr (:mod:`faulthandler`) if this
    process is still running ``after_s`` seconds from now; call it when a process starts
    tearing down. A teardown that hangs is SIGKILLed by the launcher after
    ``--term-timeout-s``, and without the stacks its log ends with the last line before the
    hang (a two-node deployment's rank once stopped that way after its loop had ended, and
    did not again when rerun)."""
    faulthandler.dump_traceback_later(after_s, exit=False)


def install_signal_handlers() -> None:
    """SIGINT ignored (the front end or the launcher owns the lifecycle); SIGTERM raises
    :class:`ShutdownRequested` in the main thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    raise ShutdownRequested()


class EngineCoreProc:
    """Drives one :class:`EngineCore` from ZMQ sockets (owns the sockets, not the core's state).

    Args:
        core: the loaded engine core.
        input_addr: ZMQ endpoint the front end's PUSH socket is bound on.
        output_addr: ZMQ endpoint the front end's PULL socket is bound on.
        dp_rank: this core's DP rank (stamped on every output frame).

    Attributes:
        tick: loop iterations that stepped, so far (the heartbeat reports it; the DP loop
            counts its ticks here).
    """

    def __init__(self, core: EngineCore, *, input_addr: str, output_addr: str, dp_rank: int = 0):
        self.core = core
        self.dp_rank = dp_rank
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.connect(input_addr)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.connect(output_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._input, zmq.POLLIN)
        self._parent_pid = os.getppid()
        self._shutdown = False
        self._output_addr = output_addr
        self._heartbeat: HeartbeatThread | None = None
        self.tick = 0

    def send_ready(self) -> None:
        """The ready message, then the heartbeats start (the front end watches them from the
        ready message on)."""
        global _ready_sent
        _ready_sent = True
        pub = self.core.kv_event_publisher
        self._output.send(encode(ReadyMessage(
            dp_rank=self.dp_rank, runtime=self.core.runtime,
            kv_events_endpoint=None if pub is None else pub.endpoint,
            kv_events_replay_endpoint=None if pub is None else pub.replay_endpoint,
            pid=os.getpid())))
        interval_s = heartbeat_interval_s(self.core.config.engine_hang_timeout_s)
        self._heartbeat = HeartbeatThread(self._ctx, self._output_addr, dp_rank=self.dp_rank,
                                          interval_s=interval_s, tick=lambda: self.tick)

    def run_busy_loop(self) -> None:
        """Run until Shutdown, SIGTERM or the parent's death. Exceptions propagate.

        The DP loop replaces this method (it decides from the gathered control state whether to
        block or step) and reuses :meth:`process_inputs` and :meth:`send_outputs`.
        """
        while not self._shutdown:
            if self.parent_is_gone():  # cheap; outputs would pile up unread
                logger.warning("[dp%d] the front end process is gone: exiting", self.dp_rank)
                return
            self.process_inputs(block=not self.core.has_work())
            if self._shutdown or not self.core.has_work():
                continue
            self.send_outputs(self.core.step())
            self.tick += 1

    def parent_is_gone(self) -> bool:
        return os.getppid() != self._parent_pid

    def send_outputs(self, outputs: list[SeqOutput]) -> None:
        """Send one step's sequence outputs as one frame (nothing for an empty step)."""
        if outputs:
            self._output.send(encode(EngineCoreOutputs(
                dp_rank=self.dp_rank, outputs=outputs, timestamp_s=time.monotonic())))

    def process_inputs(self, *, block: bool) -> None:
        """Handle every pending input; with ``block``, first wait up to ``_IDLE_POLL_MS`` for
        one (returning empty-handed, so the loop can check the parent). Inputs are handled in
        arrival order, so a utility call sees the effect of every input sent before it."""
        if block and not self._poller.poll(_IDLE_POLL_MS):
            return  # nothing yet: the loop checks the parent and comes back
        while self._input.poll(0):
            frame = self._input.recv()
            try:
                message = decode_input(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._reject_frame(frame, exc)
                continue
            self.handle_input(message)
            if self._shutdown:
                return

    def _reject_frame(self, frame: bytes, exc: Exception) -> None:
        """A frame the core cannot read (a front-end bug): a request in it fails alone (its
        choices finish with the error); anything else is dropped. The core keeps serving."""
        request = request_of_bad_frame(frame)
        if request is None:
            logger.error("[dp%d] dropped a malformed input frame: %s", self.dp_rank, exc)
            return
        request_id, num_seqs = request
        logger.error("[dp%d] request %r is malformed: %s", self.dp_rank, request_id, exc)
        self.core.fail_request(request_id, num_seqs, f"the engine core could not read the "
                                                     f"request: {exc}")

    def handle_input(self, message: CoreInput) -> None:
        core = self.core
        if isinstance(message, EngineCoreRequest):
            core.add_request(message)
        elif isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
        elif isinstance(message, FinishRequests):
            core.finish_requests([tuple(k) for k in message.seq_keys], message.stop_reasons)
        elif isinstance(message, UtilityCall):
            self._output.send(encode(self._run_utility(message)))
        elif isinstance(message, Shutdown):
            self._shutdown = True
        elif isinstance(message, StartWave):
            pass  # waves belong to the DP loop; a single rank is woken by the request itself
        else:  # pragma: no cover - the decoder admits only the types above
            raise TypeError(f"unexpected input {type(message).__name__}")

    def _run_utility(self, call: UtilityCall) -> UtilityResult:
        try:
            result = self.core.call_utility(call.method)
        except ValueError as exc:  # an unknown method: the caller's mistake, not the core's
            return UtilityResult(dp_rank=self.dp_rank, call_id=call.call_id, error=str(exc))
        return UtilityResult(dp_rank=self.dp_rank, call_id=call.call_id, result=result)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        # linger bounded: a front end that is gone must not keep this process alive
        self._ctx.destroy(linger=1000)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments :func:`atom.engine.core_client.core_argv` writes (both core processes)."""
    parser = argparse.ArgumentParser(description="an engine-core process (started by the front end)")
    parser.add_argument("--config-json", required=True, help="EngineConfig fields as a JSON object")
    parser.add_argument("--input-addr", required=True)
    parser.add_argument("--output-addr", required=True)
    parser.add_argument("--extra-eos-token-ids", type=int, nargs="*", default=[])
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    args.config = EngineConfig.from_kwargs(**json.loads(args.config_json))
    return args


def run_process(argv: list[str] | None, body: Callable[[argparse.Namespace], None]) -> int:
    """The ``main()`` of both engine-core processes: signal handlers, arguments, rank-prefixed
    logging, then ``body(args)`` (``args.config`` is the parsed :class:`EngineConfig`).

    Returns the exit code: 0 after a clean shutdown (Shutdown, SIGTERM, the parent gone), 1
    when start-up or the loop raised (module docstring: a start-up failure goes to the front
    end as one line, the traceback to the log at DEBUG; a loop failure's traceback is logged
    on stderr).
    """
    watch_parent()  # first: a front end that dies before ready must not leave us running
    install_signal_handlers()
    rank_label = os.environ.get("RANK", "0")
    args = None
    try:
        args = parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(),
                            format=f"%(levelname)s [dp{rank_label}] %(name)s: %(message)s")
        body(args)
    except ShutdownRequested:
        logger.info("[dp%s] SIGTERM: shutting down", rank_label)
    except Exception as exc:
        if not _ready_sent and args is not None and _report_startup_failure(
                args.output_addr, int(rank_label), exc):
            logger.debug("engine core (dp rank %s) failed to start", rank_label, exc_info=True)
        else:
            logger.exception("engine core (dp rank %s) failed; exiting", rank_label)
        return 1
    return 0


def startup_error_text(exc: BaseException) -> str:
    """``exc`` as one line for people: its message (lines joined), prefixed with the
    exception's type unless it is a ``ValueError`` or ``OSError`` (atom's errors for bad
    options and files, whose messages say what to change)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, (ValueError, OSError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _report_startup_failure(output_addr: str, dp_rank: int, exc: BaseException) -> bool:
    """Send :class:`StartupFailed` to the front end on a socket of its own (the core's may
    not exist yet); True once ZMQ has handed it over within ``_STARTUP_FAILED_SEND_MS``."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDTIMEO, _STARTUP_FAILED_SEND_MS)
        sock.setsockopt(zmq.LINGER, _STARTUP_FAILED_SEND_MS)
        sock.connect(output_addr)
        sock.send(encode(StartupFailed(dp_rank=dp_rank, error=startup_error_text(exc))))
        sock.close()  # lingers until the frame is out (or the linger ends)
        return True
    except zmq.ZMQError:
        return False
    finally:
        ctx.term()


def _run_one_rank(args: argparse.Namespace) -> None:
    core = build_engine_core(args.config, extra_eos_token_ids=tuple(args.extra_eos_token_ids))
    proc = EngineCoreProc(core, input_addr=args.input_addr, output_addr=args.output_addr)
    try:
        proc.send_ready()
        proc.run_busy_loop()
    finally:
        dump_stacks_if_still_running()
        core.close()
        proc.close()


def build_engine_core(config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...] = (),
                      dp_rank: int = 0) -> EngineCore:
    """An :class:`~atom.engine.core.EngineCore` over a freshly loaded torch
    :class:`~atom.worker.worker.Worker`: what a process that runs the forward (an engine-core
    process, a DP rank, an in-process engine) starts with.

    Raises:
        ValueError: invalid options or a model that cannot be loaded.
        RuntimeError: an endpoint (KV events, KV transfer) cannot be bound.
    """
    # the one place the engine reaches for the torch worker (docs/ARCHITECTURE.md, "The map");
    # imported here, after the signal handlers: torch takes seconds to import
    from atom.engine.core import EngineCore
    from atom.worker.worker import Worker

    worker = Worker(config, extra_eos_token_ids=extra_eos_token_ids, dp_rank=dp_rank)
    try:
        return EngineCore(config, worker, dp_rank=dp_rank)
    except BaseException:
        worker.close()
        raise


def main(argv: list[str] | None = None) -> int:
    """Run one single-rank engine-core process; returns its exit code."""
    return run_process(argv, _run_one_rank)


if __name__ == "__main__":
    sys.exit(main())
