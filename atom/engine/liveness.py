"""Liveness of engine-core processes: heartbeats, hang detection and rank failures.

Every engine-core process (one rank, or each DP rank) runs a :class:`HeartbeatThread` once it
is ready: a daemon thread with a PUSH socket of its own on the front end's output address that
sends a :class:`~atom.messages.Heartbeat` (the rank and the ticks its loop has completed) every
:func:`heartbeat_interval_s`. The front end's :class:`HeartbeatMonitor` notes when each rank
last beat and declares a rank **hung** after ``engine_hang_timeout_s`` without one.

Why a thread and not the tick: a tick can legitimately take long (a 2,048-token prefill on a
slow CPU, an expert-parallel step waiting for a busy peer), while the thread beats through it
because torch releases the GIL inside its ops. What stops the heartbeat is what a user means
by a hung rank: a stopped process (SIGSTOP, a debugger, a frozen container), or a native call
that never returns and holds the GIL. A rank whose loop waits in a collective for a hung peer
keeps beating, so the front end blames the peer that went silent, not the ranks waiting for
it. (Not caught here: a main thread stuck with the GIL released while the process runs, e.g. a
wedged device queue; the group timeout still ends that one, and the heartbeat's tick shows it.)

A rank that **died** (its process exited) is found by the process watcher of the client
(:meth:`atom.engine.core_client.RankProcesses.exited`). Both become a :class:`RankFailure`;
the client raises :class:`RankFailedError` (an :class:`EngineDeadError`) naming the ranks.

Torch-free; the front-end side touches no socket.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from atom.messages import Heartbeat, encode

logger = logging.getLogger(__name__)

DEAD, HUNG = "dead", "hung"
_MAX_HEARTBEAT_INTERVAL_S = 1.0
_HEARTBEATS_PER_TIMEOUT = 5  # beats sent per hang timeout: one lost or late beat never trips it


def heartbeat_interval_s(hang_timeout_s: float) -> float:
    """Seconds between heartbeats for a front end that declares a rank hung after
    ``hang_timeout_s`` seconds of silence: a fifth of it, at most 1 s."""
    return min(_MAX_HEARTBEAT_INTERVAL_S, hang_timeout_s / _HEARTBEATS_PER_TIMEOUT)


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (for processes that are not our
    children, which we cannot ``wait()`` on)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class EngineStartError(RuntimeError):
    """An engine core raised during start-up and said why (its
    :class:`~atom.messages.StartupFailed`): the message is one line, naming the rank when
    there are several, e.g. ``the engine core failed to start: KeyError: 'lm_head.weight'``.
    The core's traceback is in its log at DEBUG (``--log-level DEBUG``)."""


class EngineDeadError(RuntimeError):
    """An engine-core process exited (or hung) while the front end still needed it, and the
    deployment cannot go on (the message says which rank and why)."""


@dataclass(frozen=True)
class RankFailure:
    """One lost rank.

    Attributes:
        dp_rank: the rank in the group that failed.
        kind: :data:`DEAD` (its process exited) or :data:`HUNG` (no heartbeat).
        reason: what happened, for people (exit code and stderr tail, or the silence).
        last_tick: the last tick it reported (None: no heartbeat arrived).
    """

    dp_rank: int
    kind: str
    reason: str
    last_tick: int | None = None

    def describe(self) -> str:
        return f"dp rank {self.dp_rank} is {self.kind}: {self.reason}"


class RankFailedError(EngineDeadError):
    """Ranks of the deployment died or hung. The client may still recover
    (:meth:`atom.engine.core_client.MPClient.recover`); until then it is an
    :class:`EngineDeadError` like any other.

    Attributes:
        failures: the lost ranks, in rank order.
    """

    def __init__(self, failures: list[RankFailure]):
        self.failures = tuple(sorted(failures, key=lambda f: f.dp_rank))
        super().__init__("; ".join(f.describe() for f in self.failures))

    @property
    def dp_ranks(self) -> list[int]:
        return [f.dp_rank for f in self.failures]


class HeartbeatThread:
    """Sends this process's heartbeats (module docstring) until :meth:`close`.

    Args:
        ctx: the process's ZMQ context (the thread opens a socket of its own on it).
        output_addr: the front end's output endpoint.
        dp_rank: stamped on every beat.
        interval_s: seconds between beats.
        tick: returns the ticks the loop has completed (read from this thread; an int).

    A beat that cannot be queued (the front end is not reading) is dropped: the next one
    carries the same news.
    """

    def __init__(self, ctx: zmq.Context, output_addr: str, *, dp_rank: int, interval_s: float,
                 tick: Callable[[], int]):
        self._ctx, self._addr = ctx, output_addr
        self._dp_rank, self._interval_s, self._tick = dp_rank, interval_s, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"atom-dp{dp_rank}-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)  # created here: a ZMQ socket belongs to one thread
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self._addr)
        try:
            while True:
                try:
                    sock.send(encode(Heartbeat(dp_rank=self._dp_rank, tick=self._tick())),
                              zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if self._stop.wait(self._interval_s):
                    return
        finally:
            sock.close()

    def close(self) -> None:
        """Stop beating (idempotent); returns once the thread's socket is closed."""
        self._stop.set()
        self._thread.join(timeout=5.0)


class HeartbeatMonitor:
    """The front end's view of its ranks' heartbeats (times are the front end's
    ``time.monotonic()`` at receipt, never a rank's clock).

    Args:
        hang_timeout_s: silence after which a rank is hung.
    """

    def __init__(self, hang_timeout_s: float):
        self.hang_timeout_s = hang_timeout_s
        self._last_beat_s: list[float] = []
        self.last_ticks: list[int | None] = []

    def reset(self, num_ranks: int, now_s: float) -> None:
        """A new group is ready: every rank counts as having just beaten."""
        self._last_beat_s = [now_s] * num_ranks
        self.last_ticks = [None] * num_ranks

    def beat(self, beat: Heartbeat, now_s: float) -> None:
        if 0 <= beat.dp_rank < len(self._last_beat_s):
            self._last_beat_s[beat.dp_rank] = now_s
            self.last_ticks[beat.dp_rank] = beat.tick

    def silence_s(self, now_s: float) -> list[float]:
        """Seconds since each rank's last heartbeat."""
        return [now_s - t for t in self._last_beat_s]

    def hung(self, now_s: float) -> list[RankFailure]:
        """The ranks silent for ``hang_timeout_s`` or more."""
        return [RankFailure(rank, HUNG, f"no heartbeat for {silence:.1f} s (engine_hang_timeout_s"
                                        f"={self.hang_timeout_s:g}); last tick "
                                        f"{self.last_ticks[rank]}", self.last_ticks[rank])
                for rank, silence in enumerate(self.silence_s(now_s))
                if silence >= self.hang_timeout_s]
