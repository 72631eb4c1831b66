"""SpawnedRanks: the engine-core processes a client starts itself on this node; and
RankProcesses, the base of every way a client's ranks are started.

One ``python -m ENTRY_MODULE`` process per rank, over ``ipc://`` sockets in a fresh temporary
folder (so two deployments on one machine never collide), with the rank contract in each
environment (RANK=i, WORLD_SIZE=N, LOCAL_RANK=i, LOCAL_WORLD_SIZE=N, MASTER_ADDR=127.0.0.1, a
free MASTER_PORT, TORCHELASTIC_RESTART_COUNT = the group's generation, OMP_NUM_THREADS from
:func:`atom.config.resolve_num_threads`); their stderr is forwarded line by line. Each starts in
a session (process group) of its own: a signal sent to the front end's whole group (``timeout``,
``kill -- -PGID``, a terminal's Ctrl-C) reaches the front end alone, which drains and then
stops its ranks (a rank that stopped on its own copy of a SIGTERM failed the requests in flight
as a rank failure). An orphaned rank still ends: :func:`atom.engine.parent_watch.watch_parent`.

After a rank failure (docs/ARCHITECTURE.md, "Rank failures") the client kills every process of
the group and starts the one :meth:`SpawnedRanks.successor` returns: a fresh set (a new
folder, a new rendezvous port, generation + 1) of the same size (``replace``) or without the
lost ranks (``shrink``). Each rank runs on a *slot* of this node (a local device index on a
GPU machine): a shrunk group keeps the survivors' slots, so a broken device is not used again
(``CUDA_VISIBLE_DEVICES`` lists them, in rank order, when they are not ``0..N-1``).
"""

from __future__ import annotations

import abc
import collections
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

import msgspec

from atom.config import EngineConfig, oversubscription_warning, resolve_num_threads
from atom.engine.liveness import RankFailedError

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # after Shutdown, before SIGTERM; and after SIGTERM, before SIGKILL
_STDERR_TAIL_LINES = 40


class RankProcesses(abc.ABC):
    """Who starts and watches a client's core processes (:class:`SpawnedRanks`, or the DP
    client's ``LaunchedRanks``): the base of both, with what they share.

    Attributes:
        slots: the node-local slot of each rank (set by :meth:`start` at the latest).
    """

    slots: list[int] | None

    @abc.abstractmethod
    def address(self, name: str) -> str:
        """Where the client binds socket ``name`` (``output``, ``input0``, ...)."""

    @abc.abstractmethod
    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        """Start (or tell) every rank; each connects and sends its ready message."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Every rank is known to run."""

    @abc.abstractmethod
    def exited(self) -> list[tuple[int, str]]:
        """``(dp rank, what happened)`` of every rank known to have exited."""

    def dead_message(self) -> str | None:
        """None while every rank runs; else what happened to the first that exited (how, and
        where its error is: a spawned rank's stderr tail, or the launcher's report)."""
        exited = self.exited()
        return exited[0][1] if exited else None

    @abc.abstractmethod
    def kill(self, dp_ranks: list[int]) -> None:
        """Kill these (hung) ranks now, where this object can."""

    @abc.abstractmethod
    def successor(self, error: RankFailedError, *, policy: str) -> RankProcesses | None:
        """The ranks of the group after ``error`` under ``on_rank_failure=policy`` (``slots``:
        one per rank), or None when the deployment cannot go on. Returning ``self`` means the
        same ranks come back on the same sockets (a launcher restarts them)."""

    @abc.abstractmethod
    def on_ready(self, pids: list[int]) -> None:
        """Every rank sent its ready message; ``pids`` in rank order."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """After a failure, before the successor starts: make sure no process of this group
        is left (spawned: SIGKILL and reap)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """After the Shutdown messages: make sure every rank exits."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Release what the group held on this machine (spawned: its socket folder)."""


class SpawnedRanks(RankProcesses):
    """The core processes of one group (module docstring); removes its folder in
    :meth:`cleanup`.

    Args:
        entry_module: the process each rank runs (its ``main()`` takes :func:`core_argv`).
        slots: the node-local slot of each rank; None: ``0 .. N-1`` at :meth:`start`.
        generation: which group of the deployment this is (0 first, + 1 per recovery).
    """

    def __init__(self, entry_module: str, *, slots: list[int] | None = None, generation: int = 0):
        self.entry_module = entry_module
        self.slots = slots
        self.generation = generation
        self._ipc_dir = tempfile.mkdtemp(prefix="atom-core-")
        self.procs: list[subprocess.Popen] = []
        self._tails: list[collections.deque] = []
        self._stderr_threads: list[threading.Thread] = []
        self._port_holder: socket.socket | None = None  # the group's MASTER_PORT (reserve_port)

    def address(self, name: str) -> str:
        return f"ipc://{self._ipc_dir}/{name}"

    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        n = config.data_parallel_size
        if self.slots is None:
            self.slots = list(range(n))
        assert len(self.slots) == n, (self.slots, n)
        num_threads = resolve_num_threads(config.num_threads, num_local_ranks=n)
        warning = oversubscription_warning(n)
        if warning is not None:
            logger.warning("%s", warning)
        port = 0
        if n > 1:
            self._port_holder, port = reserve_port()
        devices = _visible_devices(self.slots)
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TORCHELASTIC_RESTART_COUNT": str(self.generation),
                   "OMP_NUM_THREADS": str(num_threads)}
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # these ranks host their own store
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            argv = [sys.executable, "-m", self.entry_module,
                    *core_argv(config, input_addr=input_addrs[rank], output_addr=output_addr,
                               extra_eos_token_ids=extra_eos_token_ids)]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                    start_new_session=True)
            self.procs.append(proc)
            tail: collections.deque = collections.deque(maxlen=_STDERR_TAIL_LINES)
            self._tails.append(tail)
            thread = threading.Thread(target=_forward_stderr, daemon=True,
                                      name=f"atom-dp{rank}-stderr", args=(proc.stderr, tail))
            thread.start()
            self._stderr_threads.append(thread)

    def is_alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def exited(self) -> list[tuple[int, str]]:
        """``(dp rank, what happened)`` of every rank whose process has exited: its exit code
        or signal and the tail of its stderr."""
        out = []
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                self._stderr_threads[rank].join(timeout=1.0)  # let the last lines arrive
                rc = p.returncode
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                tail = "".join(self._tails[rank]) or "(empty)"
                out.append((rank, f"process {p.pid} (dp rank {rank}) exited, {how}; stderr "
                                  f"tail:\n{tail}"))
        return out

    def kill(self, dp_ranks: list[int]) -> None:
        """SIGKILL these ranks now (a hung process cannot be trusted to exit on a signal it can
        handle; its peers' collectives then fail at once instead of after the group timeout)."""
        for rank in dp_ranks:
            if 0 <= rank < len(self.procs) and self.procs[rank].poll() is None:
                self.procs[rank].kill()

    def successor(self, error: RankFailedError, *, policy: str) -> SpawnedRanks | None:
        """The next group after ``error``: every slot again (``replace``), the survivors'
        slots (``shrink``), or None (``stop``, or no rank left)."""
        slots = list(self.slots or [])
        if policy == "shrink":
            slots = [s for rank, s in enumerate(slots) if rank not in error.dp_ranks]
        if policy == "stop" or not slots:
            return None
        return SpawnedRanks(self.entry_module, slots=slots, generation=self.generation + 1)

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

    def on_ready(self, pids: list[int]) -> None:
        pass  # our own children: watched through their Popen objects

    def abandon(self) -> None:
        """After a rank failure: SIGKILL every rank (the group is replaced, nothing it holds
        is needed), reap them and remove the folder."""
        self.kill(list(range(len(self.procs))))
        for p in self.procs:
            p.wait()
        for thread in self._stderr_threads:
            thread.join(timeout=1.0)
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._port_holder is not None:
            self._port_holder.close()
            self._port_holder = None


def core_argv(config: EngineConfig, *, input_addr: str, output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> list[str]:
    """The command-line arguments of an engine-core process (parsed by
    :func:`atom.engine.core_proc.parse_args`)."""
    log_level = logging.getLevelName(logging.getLogger("atom").getEffectiveLevel())
    return ["--config-json", json.dumps(msgspec.to_builtins(config)),
            "--input-addr", input_addr, "--output-addr", output_addr,
            "--extra-eos-token-ids", *map(str, extra_eos_token_ids), "--log-level", log_level]


def _visible_devices(slots: list[int]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for ranks on ``slots`` (through the one already set), or None
    when the slots are ``0 .. N-1`` (nothing to hide)."""
    if slots == list(range(len(slots))):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(max(slots) + 1)]
    return ",".join(names[s] for s in slots)


def reserve_port() -> tuple[socket.socket, int]:
    """A free TCP port on 127.0.0.1 and the socket that holds it: bound with ``SO_REUSEADDR``
    but not listening, so no other bind (another process's socket asking for any port included)
    gets the port while the holder is open, yet the rank that hosts the group's ``TCPStore`` can
    bind and listen on it (c10d's server socket sets ``SO_REUSEADDR`` too). Close the holder when
    the group goes. Binding port 0 and closing at once raced: another process's socket took the
    port before rank 0 bound it (``EADDRINUSE`` at start-up, seen in a fresh-clone run of the
    suite)."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    return holder, holder.getsockname()[1]


def _forward_stderr(pipe, tail: collections.deque) -> None:
    """Copy a core's stderr to ours (fd 2) line by line, keeping the last lines."""
    for raw in iter(pipe.readline, b""):
        tail.append(raw.decode(errors="replace"))
        try:
            os.write(2, raw)
        except OSError:  # our stderr is closed: keep draining so the core never blocks
            pass
    pipe.close()
