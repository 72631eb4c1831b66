"""``--max-restarts K``: restart the whole worker group after a rank failure, as torchrun does.

When a worker fails and restarts are left, the launcher kills every other worker at once
(SIGKILL: nothing of theirs outlives the group, and the new group waits for them;
:class:`atom.launch.supervisor.Supervisor`), reports the failure as a warning, and starts the
group again with ``TORCHELASTIC_RESTART_COUNT`` one higher (the workers rendezvous under keys
of that start in the store, which outlives the group: :mod:`atom.dp.groups`). Each start
writes its own logs (``rank<N>.stderr.log``, then ``rank<N>.restart<k>.stderr.log``). With no
restarts left the failure ends the run with the report, as without the option. A stop signal
or another node's stop is never restarted; restarts need a single node (``--nnodes 1``).

The front end of an ``atom`` command outlives the restarts: rank 0 of the first start runs it
in a session of its own and writes its pid to ``ATOM_FRONT_END_PID_FILE``
(:mod:`atom.entrypoints.launched`), and it resumes its in-flight requests on the restarted
group. The launcher does not restart a group whose front end has exited (nothing would talk
to it), and stops the front end when the run ends: a moment to exit by itself after a clean
end, then SIGTERM to its process group, SIGKILL after ``--term-timeout-s``.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from atom.dp.rank_contract import MAX_RESTARTS_ENV, RESTART_COUNT_ENV
from atom.launch.env import FRONT_END_PID_FILE_ENV
from atom.engine.liveness import pid_running

logger = logging.getLogger(__name__)

_FRONT_END_PID_FILE = "front_end.pid"
_POLL_S = 0.1


def restart_env(*, restart_count: int, max_restarts: int, log_dir: str) -> dict[str, str]:
    """The variables a worker of start ``restart_count`` gets (none without restarts)."""
    if max_restarts == 0:
        return {}
    return {RESTART_COUNT_ENV: str(restart_count), MAX_RESTARTS_ENV: str(max_restarts),
            FRONT_END_PID_FILE_ENV: os.path.join(log_dir, _FRONT_END_PID_FILE)}


def log_name(rank: int, restart_count: int) -> str:
    """The stderr log of ``rank`` in start ``restart_count``."""
    suffix = f".restart{restart_count}" if restart_count else ""
    return f"rank{rank}{suffix}.stderr.log"


def front_end_pid(log_dir: str) -> int | None:
    """The running front end's pid (its process group's id too), or None."""
    try:
        with open(os.path.join(log_dir, _FRONT_END_PID_FILE)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_running(pid) else None


def should_restart(outcome, *, restart_count: int, max_restarts: int, log_dir: str) -> bool:
    """Whether the group that ended with ``outcome`` (an :class:`~atom.launch.supervisor.Outcome`)
    is started again: a rank failed (no stop signal, no other node's stop), restarts are left,
    and the front end, if the command has one, still runs."""
    if outcome.failure is None or outcome.signal is not None or outcome.remote is not None:
        return False
    if restart_count >= max_restarts:
        return False
    has_front_end = os.path.exists(os.path.join(log_dir, _FRONT_END_PID_FILE))
    if has_front_end and front_end_pid(log_dir) is None:
        logger.error("the front end has exited: not restarting the ranks")
        return False
    logger.warning("%s\nrestarting every rank (restart %d of %d)", outcome.failure.describe(),
                   restart_count + 1, max_restarts)
    return True


def stop_front_end(log_dir: str, *, clean: bool, term_timeout_s: float) -> None:
    """End the front end the restarts kept running (module docstring); nothing without one."""
    pid = front_end_pid(log_dir)
    if pid is None:
        return
    if clean and _wait_gone(pid, term_timeout_s):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if _wait_gone(pid, term_timeout_s):
            return


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)  # not our child: no wait() on it, only polling
    return True
