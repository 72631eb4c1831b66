"""The launcher's event loop: watch the local workers, stop them all on the first failure.

One thread, one ``selectors`` loop, no polling where Linux allows it: the loop sleeps until a
worker writes to stderr (teed by :meth:`WorkerProcess.pump`), a worker exits (its pidfd becomes
readable), a stop signal arrives (``signal.set_wakeup_fd``), the SIGTERM→SIGKILL grace period
ends, or, with several nodes, it is time to look for another node's stop record and to beat
(:data:`~atom.launch.rendezvous.STORE_POLL_S`); node 0 then also looks for lost nodes
(:class:`~atom.launch.rendezvous.NodeWatch`).

Stopping means SIGTERM to every worker's process group, then SIGKILL to those still there after
``term_timeout_s``; when the last worker is gone every group gets a final SIGKILL, so nothing a
worker started outlives the launcher.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from atom.launch.rendezvous import STORE_POLL_S, LaunchStore, NodeWatch, StopRecord
from atom.launch.workers import WorkerFailure, WorkerProcess, exit_status

logger = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PID_POLL_S = 0.2  # exit polling where pidfds are unavailable (not Linux)
_DRAIN_S = 2.0  # after the last worker exits, how long to wait for its stderr to end


class StopSignals:
    """While entered: SIGINT/SIGTERM/SIGHUP (unless ignored, as under nohup) are recorded, not
    fatal, and wake the event loop through :attr:`fd` (``signal.set_wakeup_fd``). Main thread
    only."""

    def __init__(self):
        self.received: list[int] = []
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._saved_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in _STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: a hang-up must not stop the ranks
            self._saved[sig] = signal.signal(sig, lambda signum, _frame:
                                             self.received.append(signum))
        return self

    def drain(self) -> None:
        try:
            while os.read(self.fd, 256):
                pass
        except BlockingIOError:
            pass

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._saved_wakeup)
        os.close(self.fd)
        os.close(self._write_fd)


@dataclass
class Outcome:
    """How the run ended. The first stop reason wins, except that a local failure seen after
    another node's stop record keeps both (the remote one is then the likely root cause), and a
    node found lost after a local failure is kept too (likely the root cause as well)."""

    failure: WorkerFailure | None = None  # a local rank that failed first
    signal: int | None = None  # a stop signal to this launcher
    remote: StopRecord | None = None  # another node stopped first
    lost: StopRecord | None = None  # node 0 only: another node's launcher went silent
    exit_codes: dict[int, int] = field(default_factory=dict)  # rank → exit code

    @property
    def stopping(self) -> bool:
        return (self.failure is not None or self.signal is not None or self.remote is not None
                or self.lost is not None)

    @property
    def exit_code(self) -> int:
        if self.failure is not None:
            return exit_status(self.failure.exit_code)
        if self.signal is not None:
            return 128 + self.signal
        if self.remote is not None:
            if self.remote.signal is not None:  # a stop asked of another node's launcher
                return 128 + self.remote.signal
            return exit_status(self.remote.exit_code) if self.remote.exit_code else 1
        return 1 if self.lost is not None else 0


class Supervisor:
    """The event loop of one launcher: owns the running workers until all have exited."""

    def __init__(self, workers: Sequence[WorkerProcess], *, signals: StopSignals,
                 store: LaunchStore, term_timeout_s: float, watch: NodeWatch | None = None,
                 restart_on_failure: bool = False):
        self.workers, self.signals, self.store = workers, signals, store
        # a restart follows a rank's failure (--max-restarts, restarts left): the other ranks
        # are killed at once, since nothing of theirs outlives the group (the front end that
        # resumes the requests runs in a session of its own) and the new group waits for them
        self.restart_on_failure = restart_on_failure
        self.node_rank, self.term_timeout_s = store.node_rank, term_timeout_s
        self.watch = watch  # node 0 of several: the other nodes' heartbeats
        self.outcome = Outcome()
        self._kill_at: float | None = None
        self._num_signals_seen = 0
        self._sel = selectors.DefaultSelector()
        self._sel.register(signals.fd, selectors.EVENT_READ, None)
        for w in workers:
            self._sel.register(w.stderr_fd, selectors.EVENT_READ, w)
            if w.pidfd is not None:
                self._sel.register(w.pidfd, selectors.EVENT_READ, None)

    def run(self) -> Outcome:
        running = list(self.workers)
        next_store_poll = time.monotonic() + STORE_POLL_S
        try:
            while running:
                self._wait(next_store_poll)
                exited = [w for w in running if w.poll() is not None]
                for w in sorted(exited, key=WorkerProcess.blame_order):
                    running.remove(w)
                    self._on_exit(w)
                self._on_signals()
                now = time.monotonic()
                if self.store.multi_node and now >= next_store_poll:
                    next_store_poll = now + STORE_POLL_S
                    self.store.beat()
                    if not self.outcome.stopping:
                        self._poll_other_nodes(now)
                if self._kill_at is not None and now >= self._kill_at:
                    self._kill("did not exit within --term-timeout-s after SIGTERM")
        finally:
            self._finish()
        return self.outcome

    def _poll_other_nodes(self, now: float) -> None:
        remote = self.store.remote_stop()
        if remote is not None:
            self.outcome.remote = remote
            self._stop(f"node {remote.node_rank} stopped: {remote.reason.splitlines()[0]}")
            return
        lost = lost_node_record(self.watch, self.node_rank, now) if self.watch else None
        if lost is not None:
            self.outcome.lost = lost
            self.store.publish_stop(lost)
            self._stop(lost.reason)

    def _wait(self, next_store_poll: float) -> None:
        deadlines = [t for t in (self._kill_at, next_store_poll if self.store.multi_node
                                 else None) if t is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        if any(w.pidfd is None for w in self.workers):
            timeout = _PID_POLL_S if timeout is None else min(timeout, _PID_POLL_S)
        for key, _ in self._sel.select(timeout):
            if key.data is not None:
                self._pump(key.data)

    def _pump(self, w: WorkerProcess) -> None:
        if w.stderr_fd is not None and not w.pump():
            self._sel.unregister(w.stderr_fd)
            w.close_stderr()

    def _on_exit(self, w: WorkerProcess) -> None:
        if w.pidfd is not None:
            self._sel.unregister(w.pidfd)
        code = w.poll()
        self.outcome.exit_codes[w.spec.rank] = code
        if code == 0 or self.outcome.stopping:
            logger.info("rank %d exited with exit code %d%s", w.spec.rank, code,
                        " (stopped by the launcher)" if self.outcome.stopping else "")
            return
        self._pump(w)  # the last words on its stderr belong in the report
        failure = w.failure(self.node_rank)
        self.outcome.failure = failure
        # a rank here often dies of a peer's death elsewhere (gloo: connection reset): keep
        # another node's earlier stop record as the likely root cause
        self.outcome.remote = self.store.remote_stop()
        self.store.publish_stop(StopRecord(node_rank=self.node_rank,
                                           reason=failure.describe(), rank=failure.rank,
                                           exit_code=failure.exit_code))
        if self.restart_on_failure:
            self._kill(f"rank {w.spec.rank} failed with exit code {code}, for a restart")
        else:
            self._stop(f"rank {w.spec.rank} failed with exit code {code}")

    def _on_signals(self) -> None:
        """The first stop signal stops the workers gracefully; any later one (a second
        Ctrl-C, or one while a failure is being handled) kills them at once."""
        new = self.signals.received[self._num_signals_seen:]
        if not new:
            return
        self._num_signals_seen += len(new)
        self.signals.drain()
        for sig in new:
            name = signal.Signals(sig).name
            if self.outcome.stopping:
                self._kill(f"{name} while stopping")
                continue
            self.outcome.signal = sig
            self.store.publish_stop(StopRecord(node_rank=self.node_rank,
                                               reason=f"{name} to the launcher of node "
                                                      f"{self.node_rank}", signal=sig))
            self._stop(f"{name} received")

    def _stop(self, why: str) -> None:
        logger.warning("%s: stopping every rank of this node (SIGTERM, SIGKILL after %gs)",
                       why, self.term_timeout_s)
        for w in self.workers:  # exited ones too: their children may still run
            w.signal_group(signal.SIGTERM)
        self._kill_at = time.monotonic() + self.term_timeout_s

    def _kill(self, why: str) -> None:
        logger.warning("%s: sending SIGKILL to every rank of this node", why)
        for w in self.workers:
            w.signal_group(signal.SIGKILL)
        self._kill_at = None

    def _finish(self) -> None:
        for w in self.workers:  # whatever the workers left behind in their groups
            if w.poll() is None:
                w.signal_group(signal.SIGKILL)
                w.popen.wait()
            w.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + _DRAIN_S
        while any(w.stderr_fd is not None for w in self.workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break  # a descendant in another session still holds the pipe
            for key, _ in self._sel.select(remaining):
                if key.data is not None:
                    self._pump(key.data)
        self._sel.close()
        for w in self.workers:
            w.close()


def lost_node_record(watch: NodeWatch, node_rank: int, now: float) -> StopRecord | None:
    """The stop record naming the first lost node :meth:`NodeWatch.lost` finds, or None."""
    try:
        lost = watch.lost(now)
    except RuntimeError:  # our own store failing: nothing to judge the others by
        return None
    if not lost:
        return None
    node, silent_s = lost[0]
    return StopRecord(node_rank=node_rank, lost_node=node,
                      reason=f"node {node} is lost: its launcher has not been heard from for "
                             f"{silent_s:.0f}s (--node-timeout-s {watch.node_timeout_s:g}): "
                             f"killed, crashed, or cut off from node {node_rank}")


def wait_for_other_nodes(store: LaunchStore, signals: StopSignals, *, timeout_s: float,
                         watch: NodeWatch | None = None) -> StopRecord | None:
    """Node 0 keeps the store up until every launcher is done (bounded by ``timeout_s``), one
    is found lost (returned as its stop record, also published), or a new stop signal comes
    (one that stopped the workers already must not cut the others' stop short: they would
    lose the store mid-way)."""
    deadline = time.monotonic() + timeout_s
    num_signals = len(signals.received)
    with selectors.DefaultSelector() as sel:
        sel.register(signals.fd, selectors.EVENT_READ)
        while not store.all_done() and len(signals.received) == num_signals:
            now = time.monotonic()
            lost = lost_node_record(watch, store.node_rank, now) if watch else None
            if lost is not None:
                store.publish_stop(lost)
                return lost
            if now >= deadline:
                logger.warning("not every node finished within %gs; closing the store",
                               timeout_s)
                return None
            if sel.select(min(deadline - now, STORE_POLL_S / 2)):
                signals.drain()  # a wake-up byte; the signal itself is in signals.received
    return None
