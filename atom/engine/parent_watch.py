"""Exit when the parent process dies, at any moment of a child's life (torch-free).

An engine-core process spends its first seconds to minutes importing torch, loading weights
and possibly building the CPU kernels before its busy loop (which also watches its parent)
starts. A front end killed in that window (SIGKILL, the OOM killer, a CI time-out) would leave
it running as an orphan. :func:`watch_parent`, called first thing in the process's ``main()``,
closes the window: a daemon thread polls ``os.getppid()`` every :data:`POLL_INTERVAL_S`; when
the parent changes (the process was re-parented to init or a subreaper) it logs one line and
sends SIGTERM to its own process, which the engine-core processes turn into a clean shutdown;
if the process is still alive :data:`GRACE_S` later (the main thread stuck in a long C call),
it ends it with ``os._exit(1)``.

Linux's ``PR_SET_PDEATHSIG`` would do this in the kernel, but it fires when the *thread* that
started the child exits, not the parent process, so it would tie an engine core's life to
whichever thread of its front end happened to spawn it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
GRACE_S = 5.0


def watch_parent() -> threading.Thread:
    """Start the watcher thread for this process's current parent; returns the thread.

    A parent that is already gone (the process is a child of init, pid 1) counts as dead at once.
    Raises nothing; the thread is a daemon and never returns while the parent lives.
    """
    parent_pid = os.getppid()
    thread = threading.Thread(target=_watch, args=(parent_pid,), daemon=True,
                              name="atom-parent-watch")
    thread.start()
    return thread


def _watch(parent_pid: int) -> None:
    while parent_pid != 1 and os.getppid() == parent_pid:
        time.sleep(POLL_INTERVAL_S)
    logger.warning("parent process %d is gone: shutting down (pid %d)", parent_pid, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)
