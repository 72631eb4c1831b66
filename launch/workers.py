"""Local worker processes of one launcher: spawn, tee stderr, signal whole process groups.

Each worker runs in its own session (``start_new_session=True``), so it leads a process group
that also holds everything it starts (the front end that rank 0 runs as a child, tokenizer
pools, ...). Signalling the group, never only the pid, is what leaves no process behind. A
terminal's Ctrl-C reaches only the launcher (the workers are not in the terminal's foreground
group); the launcher then decides what the workers get.

Stderr goes through a pipe that the launcher's event loop drains (:meth:`WorkerProcess.pump`):
every line is written unchanged to the rank's log file and with a ``[rankN]`` prefix to the
console, and the last lines are kept for the failure report. Stdout is inherited untouched (it
carries a command's results, e.g. ``atom generate`` completions).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from atom.launch.errors import read_error_file

TAIL_LINES = 40  # stderr / traceback lines quoted in a failure report
_READ_BYTES = 1 << 16

# What a worker's death by signal usually means here; shown in the failure report.
SIGNAL_HINTS = {
    signal.SIGABRT: "gloo aborts a rank on a collective size mismatch (the ranks issued "
                    "different collectives; see the other ranks' LockstepError / "
                    "CollectiveError), or a C++ assertion failed",
    signal.SIGKILL: "killed from outside, often by the kernel's out-of-memory killer "
                    "(check `dmesg`), or by the launcher after the grace period",
    signal.SIGSEGV: "a crash in native code (a kernel or extension)",
    signal.SIGTERM: "terminated from outside the launcher",
    signal.SIGINT: "interrupted (Ctrl-C sent to the worker itself)",
}


def describe_exit_code(exit_code: int) -> str:
    """``"exit code 3"``, or for a death by signal (negative Popen code)
    ``"exit code -6 (SIGABRT: <hint>)"``."""
    if exit_code >= 0:
        return f"exit code {exit_code}"
    try:
        sig = signal.Signals(-exit_code)
    except ValueError:
        return f"exit code {exit_code} (killed by signal {-exit_code})"
    hint = SIGNAL_HINTS.get(sig)
    return f"exit code {exit_code} ({sig.name}{': ' + hint if hint else ''})"


def exit_status(exit_code: int) -> int:
    """The launcher's own exit status for a worker's ``exit_code``: the code itself when the
    worker exited, 1 when a signal killed it (a shell reads 128+N as "the launcher was
    killed", which would be misleading)."""
    return exit_code if exit_code > 0 else 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one local worker."""

    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: str  # the rank's stderr, unprefixed
    error_path: str  # ATOM_ERROR_FILE of the rank
    inherit_stdin: bool = False  # only one rank may read the terminal
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (the front end's stderr)


@dataclass(frozen=True)
class WorkerFailure:
    """A worker that exited non-zero (or was killed), as the launcher reports it."""

    rank: int
    node_rank: int
    pid: int | None
    exit_code: int
    details: str  # its recorded traceback, else the tail of its stderr ("" when unknown)
    log_path: str | None = None

    def describe(self) -> str:
        where = f"rank {self.rank} (node {self.node_rank}"
        where += f", pid {self.pid})" if self.pid is not None else ")"
        text = f"{where} failed with {describe_exit_code(self.exit_code)}"
        if self.log_path:
            text += f"\n  its stderr: {self.log_path}"
        lines = self.details.strip("\n").rstrip().splitlines()
        if lines:  # a tail of blank lines says nothing: no heading over an empty body
            body = "\n".join("  " + line for line in lines)
            text += f"\n  last lines of its error:\n{body}"
        return text


class WorkerProcess:
    """One running worker. Owns its ``Popen``, its stderr pipe, log file and pid file
    descriptor; :meth:`close` releases them (the process itself is stopped by signals)."""

    def __init__(self, spec: WorkerSpec, *, console: TextIO):
        self.spec = spec
        self._console = console
        self._prefix = f"[rank{spec.rank}] "
        self._partial = b""
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        for stale in (spec.error_path,):  # a previous run's file would be blamed on this one
            if os.path.exists(stale):
                os.remove(stale)
        self._log = open(spec.log_path, "wb")
        try:
            self.popen = subprocess.Popen(
                list(spec.argv), env=dict(spec.env), stderr=subprocess.PIPE,
                stdin=None if spec.inherit_stdin else subprocess.DEVNULL,
                pass_fds=spec.pass_fds, start_new_session=True)
        except OSError:
            self._log.close()
            raise
        self.stderr_fd: int | None = self.popen.stderr.fileno()
        os.set_blocking(self.stderr_fd, False)
        self.pidfd = _pidfd_open(self.popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code once the worker has exited (negative: killed by that signal)."""
        return self.popen.poll()

    def blame_order(self) -> tuple:
        """Sort key among workers seen exiting at the same time, root cause first: a death by
        signal (a peer's death reaches the others as Python errors, e.g. gloo's "connection
        reset"), then the earliest recorded traceback, then the rank."""
        try:
            recorded_at = os.path.getmtime(self.spec.error_path)
        except OSError:
            recorded_at = float("inf")
        return (self.popen.returncode >= 0, recorded_at, self.spec.rank)

    def pump(self) -> bool:
        """Move whatever stderr is available to the log file and the console.
        Returns False at end of file (every writer of the pipe has exited); the owner of the
        event loop then stops watching :attr:`stderr_fd` and calls :meth:`close_stderr`."""
        assert self.stderr_fd is not None, "pump() after close_stderr()"
        while True:
            try:
                data = os.read(self.stderr_fd, _READ_BYTES)
            except BlockingIOError:
                return True
            if not data:
                self._flush_partial()
                return False
            self._log.write(data)
            self._log.flush()
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                self._emit(line.decode("utf-8", errors="replace"))

    def _emit(self, text: str) -> None:
        self._tail.append(text)
        self._console.write(f"{self._prefix}{text}\n")
        self._console.flush()

    def _flush_partial(self) -> None:
        if self._partial:
            self._emit(self._partial.decode("utf-8", errors="replace"))
            self._partial = b""

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group (no-op once it is empty)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone (PermissionError: the pgid was reused by another user)

    def failure(self, node_rank: int) -> WorkerFailure:
        """Describe this (exited, non-zero) worker: its error file, else its stderr tail."""
        recorded = read_error_file(self.spec.error_path)
        if recorded:
            details = "\n".join(recorded.rstrip().splitlines()[-TAIL_LINES:])
        else:
            details = "\n".join(self._tail)
        return WorkerFailure(rank=self.spec.rank, node_rank=node_rank, pid=self.pid,
                             exit_code=self.popen.returncode, details=details,
                             log_path=self.spec.log_path)

    def close_stderr(self) -> None:
        """Stop reading stderr (end of file, or giving up on a descendant that keeps it)."""
        self._flush_partial()
        if self.stderr_fd is not None:
            self.popen.stderr.close()
            self.stderr_fd = None

    def close(self) -> None:
        """Release the pipe, pidfd and log file (the process must have been reaped)."""
        self.close_stderr()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self._log.close()


def _pidfd_open(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux ≥ 5.3), so the event loop
    sleeps until something happens; ``None`` where unsupported (the loop then polls)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def start_workers(specs: Sequence[WorkerSpec], *, console: TextIO) -> list[WorkerProcess]:
    """Start every worker; if one cannot start, kill the ones already started and re-raise."""
    workers: list[WorkerProcess] = []
    try:
        for spec in specs:
            workers.append(WorkerProcess(spec, console=console))
    except OSError:
        for w in workers:
            w.signal_group(signal.SIGKILL)
            w.popen.wait()
            w.close()
        raise
    return workers
