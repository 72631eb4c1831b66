"""``atom launch`` / ``python -m atom.launch``: start the ranks of a deployment, torchrun-style.

Usage::

    python -m atom.launch [--nproc-per-node N] [--nnodes M] [--node-rank R]
                          [--master-addr A] [--master-port P] [--no-python] [--log-dir DIR]
                          [--term-timeout-s S] [--rdzv-timeout-s S] [--node-timeout-s S]
                          [--max-restarts K]
                          [--] COMMAND ...

One launcher runs per node and starts ``N`` local workers. ``COMMAND`` is an ``atom`` subcommand
(``generate ...``, ``serve ...``), run as ``python -m atom.entrypoints.cli COMMAND ...``; a first
word ending in ``.py`` is a Python script (``python SCRIPT ...``); with ``--no-python`` the
command is run as it is. Multi-node: one launcher per node, the same ``--nnodes``,
``--nproc-per-node``, ``--master-addr`` (node 0's address) and a fixed ``--master-port``, a
distinct ``--node-rank``. ``--master-port 0`` (the single-node default) picks a free port.

Environment of every worker (the rank contract; torchrun sets the starred ones the same way):

====================================  =========================================================
``RANK`` *                            global rank, ``NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``
``WORLD_SIZE`` *                      ``NNODES * LOCAL_WORLD_SIZE`` (= DP size while TP is 1)
``LOCAL_RANK`` *                      rank on this node, ``0 <= LOCAL_RANK < LOCAL_WORLD_SIZE``
``LOCAL_WORLD_SIZE`` *                ``--nproc-per-node``
``NODE_RANK``, ``NNODES``             ``--node-rank``, ``--nnodes`` (torchrun: ``GROUP_RANK``)
``MASTER_ADDR`` *                     host of the rendezvous store: node 0's launcher
``MASTER_PORT`` *                     its port (the actual one when ``--master-port 0``)
``TORCHELASTIC_USE_AGENT_STORE`` *    ``True``: the launcher hosts the store, so every rank,
                                      rank 0 too, connects as a client
                                      (``atom.dp.groups.init_process_groups`` does)
``OMP_NUM_THREADS``                   cores ÷ ``LOCAL_WORLD_SIZE`` (at least 1) unless set
                                      (``atom.config.resolve_num_threads``)
``ATOM_ERROR_FILE``                   per-rank file for the rank's traceback
                                      (:mod:`atom.launch.errors`; torchrun's variable is
                                      ``TORCHELASTIC_ERROR_FILE``)
``ATOM_LAUNCHER_PID``                 the launcher's pid (for a user's tools; atom never asks
                                      who launched it, see below)
``TORCHELASTIC_RESTART_COUNT`` *      with ``--max-restarts``: which start of the group this
                                      is (0 first)
``TORCHELASTIC_MAX_RESTARTS`` *       with ``--max-restarts``: K
``ATOM_FRONT_END_PID_FILE``           with ``--max-restarts``: where rank 0 writes the pid of
                                      the front end it starts (:mod:`atom.launch.restarts`)
====================================  =========================================================

**Under torchrun.** ``torchrun --nproc-per-node 2 -m atom.entrypoints.cli generate ...`` works
too: each process torchrun starts is one rank, with the same contract (torchrun's agent hosts the
store and sets ``TORCHELASTIC_USE_AGENT_STORE=True``). An ``atom`` command therefore never asks
who launched it: ``atom.launch.env.rank_env_present()`` says it is one rank of several,
``RankInfo.from_env()`` reads the contract and ``init_process_groups`` connects to whichever
launcher hosts the store. Worker-side error recording writes to torchrun's error file there. Whatever a
rank starts (rank 0 runs the front end as its child, not inside its busy loop) belongs to that
rank's process group here, and is stopped with it.

**Failures.** Each worker leads its own process group. When a worker exits non-zero or dies of a
signal, the launcher sends SIGTERM to every worker's group, SIGKILL after ``--term-timeout-s``
(default 10), so every process is gone within that plus a second; it reports the rank, the exit
code (and the signal's name, with a hint: gloo SIGABRTs a rank on a collective size mismatch)
and the rank's traceback from its error file, else the tail of its stderr. Each rank's stderr is
copied to ``--log-dir``/``rank<N>.stderr.log`` and to the console with a ``[rankN]`` prefix.
The launcher exits with the first failing rank's exit code (1 when a signal killed it). Ctrl-C,
SIGTERM or SIGHUP to the launcher stops every worker the same way (a second one: SIGKILL at
once) and exits with 128 + the signal number. With several nodes, the first launcher to stop
tells the others through the store and they stop too (a stop signal to one launcher is a
requested stop on every node: each exits with 128 + that signal's number). A launcher killed
with SIGKILL cannot stop its own workers (as with torchrun; they exit when their next
collective fails, or on their parent's death once their loop runs), but node 0's launcher
finds its node **lost** when that node's heartbeat in the store stops for ``--node-timeout-s``
(default 30), and stops every node with a report naming it
(:mod:`atom.launch.rendezvous`).

**Networks.** The rendezvous store listens on every interface of node 0 (torch's ``TCPStore``
binds the wildcard address); everything else binds this node's address on the route to
``--master-addr`` (:mod:`atom.dp.node_address`), gloo included (``GLOO_SOCKET_IFNAME`` is set
to that interface unless it is set already). So give every node the same ``--master-addr``, an
address of node 0 that every node reaches; a loopback one on some nodes and not on others is
refused by every rank at start-up with a message saying so.

**Restarts.** ``--max-restarts K`` (one node; default 0) restarts the whole group after a rank
failure, up to K times, as torchrun does; an ``atom`` command's front end stays up and resumes
its in-flight requests on the restarted ranks (:mod:`atom.launch.restarts`). Without it, or
with no restarts left, a failure stops everything with the report above.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from atom.config import ArgumentParser, oversubscription_warning, resolve_num_threads
from atom.launch import env as launch_env
from atom.launch import restarts
from atom.launch.rendezvous import STORE_POLL_S, LaunchStore, NodeWatch, StopRecord
from atom.launch.supervisor import Outcome, StopSignals, Supervisor, wait_for_other_nodes
from atom.launch.workers import WorkerSpec, start_workers

logger = logging.getLogger(__name__)

CLI_MODULE = "atom.entrypoints.cli"


@dataclass(frozen=True)
class LaunchConfig:
    """What to launch on this node (the launcher's command line, validated)."""

    command: tuple[str, ...]  # an atom subcommand, a .py script, or (no_python) an executable
    nproc_per_node: int = 1  # local workers (ranks) on this node
    nnodes: int = 1  # nodes; each runs its own launcher
    node_rank: int = 0  # this node; node 0 hosts the rendezvous store
    master_addr: str = "127.0.0.1"  # node 0's address, reachable from every node
    master_port: int = 0  # 0: a free port (single node only)
    no_python: bool = False  # run `command` as an executable as it is
    log_dir: str | None = None  # per-rank logs and error files; None: a temporary folder
    term_timeout_s: float = 10.0  # SIGTERM → SIGKILL grace; short enough for a 30 s exit
    rdzv_timeout_s: float = 300.0  # how long launchers wait for each other (torchrun: 300-600)
    node_timeout_s: float = 30.0  # node 0 declares a node lost after its launcher's silence;
    # far above STORE_POLL_S, so a launcher starved of CPU for a while is not taken for dead
    max_restarts: int = 0  # restarts of the whole group after a rank failure (one node only)

    def __post_init__(self):
        if not self.command:
            raise ValueError("no command given: put it after the options, e.g. "
                             "`atom launch --nproc-per-node 2 -- generate --prompt hi`")
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(f"--nproc-per-node {self.nproc_per_node} and --nnodes "
                             f"{self.nnodes} must both be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes "
                             f"{self.nnodes})")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port (0-65535)")
        if self.master_port == 0 and self.nnodes > 1:
            raise ValueError("--master-port 0 leaves the other nodes no port to reach node 0 "
                             "at: give every node the same fixed --master-port")
        if not self.master_addr:
            raise ValueError("--master-addr is empty: give node 0's address")
        if not (self.term_timeout_s > 0 and self.rdzv_timeout_s > 0):
            raise ValueError("--term-timeout-s and --rdzv-timeout-s must be positive seconds")
        if not self.node_timeout_s > 3 * STORE_POLL_S:
            raise ValueError(f"--node-timeout-s {self.node_timeout_s:g} must be more than "
                             f"{3 * STORE_POLL_S:g} s (three heartbeats)")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if self.max_restarts and self.nnodes > 1:
            raise ValueError("--max-restarts needs a single node (--nnodes 1): restarting the "
                             "ranks of several nodes together is not supported yet")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def worker_argv(config: LaunchConfig) -> list[str]:
    """The command line of every worker (see the module docstring)."""
    if config.no_python:
        return list(config.command)
    if config.command[0].endswith(".py"):
        return [sys.executable, *config.command]
    return [sys.executable, "-m", CLI_MODULE, *config.command]


def worker_env(config: LaunchConfig, *, local_rank: int, master_port: int, error_path: str,
               base_env: Mapping[str, str], num_cpus: int | None = None) -> dict[str, str]:
    """The environment of local worker ``local_rank``: ``base_env`` plus the rank contract
    (``num_cpus``: cores to share among the local workers; None = this process's)."""
    env = dict(base_env)
    env.update({
        "RANK": str(config.node_rank * config.nproc_per_node + local_rank),
        "WORLD_SIZE": str(config.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        launch_env.NODE_RANK_ENV: str(config.node_rank),
        "NNODES": str(config.nnodes),
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(master_port),
        launch_env.AGENT_STORE_ENV: "True",
        launch_env.ERROR_FILE_ENV: error_path,
        launch_env.LAUNCHER_PID_ENV: str(os.getpid()),
    })
    # torch sizes its intra-op pool from this at start-up: ranks must not oversubscribe
    env["OMP_NUM_THREADS"] = str(resolve_num_threads(None, num_local_ranks=config.nproc_per_node,
                                                     env=base_env, num_cpus=num_cpus))
    return env


def worker_specs(config: LaunchConfig, *, master_port: int, log_dir: str,
                 restart_count: int = 0, console_fd: int | None = None) -> list[WorkerSpec]:
    """One :class:`WorkerSpec` per local rank of this node: the command, its environment
    (:func:`worker_env` plus the restart variables of start ``restart_count``) and its log
    and error files under ``log_dir``. ``console_fd`` (``--max-restarts`` only): a descriptor
    of the launcher's stderr that rank 0 of the first start gives its front end."""
    argv = tuple(worker_argv(config))
    warning = oversubscription_warning(config.nproc_per_node)
    if warning is not None:
        logger.warning("%s", warning)
    specs = []
    for local_rank in range(config.nproc_per_node):
        rank = config.node_rank * config.nproc_per_node + local_rank
        error_path = os.path.join(log_dir, f"rank{rank}.error.json")
        env = worker_env(config, local_rank=local_rank, master_port=master_port,
                         error_path=error_path, base_env=os.environ)
        env.update(restarts.restart_env(restart_count=restart_count,
                                        max_restarts=config.max_restarts, log_dir=log_dir))
        pass_fds: tuple[int, ...] = ()
        if console_fd is not None and config.max_restarts and restart_count == 0 and rank == 0:
            env[launch_env.FRONT_END_STDERR_FD_ENV] = str(console_fd)
            pass_fds = (console_fd,)
        specs.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=argv, env=env,
                                log_path=os.path.join(log_dir,
                                                      restarts.log_name(rank, restart_count)),
                                error_path=error_path, inherit_stdin=rank == 0,
                                pass_fds=pass_fds))
    return specs


def launch(config: LaunchConfig, *, console: TextIO | None = None) -> int:
    """Run ``config`` on this node until every local worker has exited; return the exit code.

    Main thread only (it installs signal handlers while the workers run). Progress and the
    failure report go to the ``atom.launch.launcher`` logger; worker stderr goes to ``console``
    (default ``sys.stderr``) with a ``[rankN]`` prefix.

    Raises:
        RuntimeError: the rendezvous store cannot be hosted or reached.
        ValueError / TimeoutError: the nodes' launchers disagree or do not all join.
        OSError: a worker cannot be started (the others are killed first).
    """
    console = sys.stderr if console is None else console
    # Until workers exist, SIGINT/SIGTERM keep their default (fatal) effect: nothing to clean.
    store = LaunchStore.open(master_addr=config.master_addr, master_port=config.master_port,
                             node_rank=config.node_rank, nnodes=config.nnodes,
                             timeout_s=config.rdzv_timeout_s)
    if store.multi_node:
        store.join(config.nproc_per_node, timeout_s=config.rdzv_timeout_s)
    own_log_dir = config.log_dir is None
    log_dir = tempfile.mkdtemp(prefix="atom-launch-") if own_log_dir else config.log_dir
    os.makedirs(log_dir, exist_ok=True)
    console_fd = _dup_console(console) if config.max_restarts else None
    specs = worker_specs(config, master_port=store.port, log_dir=log_dir, console_fd=console_fd)
    logger.info("node %d/%d: starting ranks %d-%d of %d (store %s, logs %s): %s",
                config.node_rank, config.nnodes, specs[0].rank, specs[-1].rank,
                config.world_size, store.address, log_dir, shlex.join(specs[0].argv))
    with StopSignals() as signals:
        watch = (NodeWatch(store, node_timeout_s=config.node_timeout_s, now=time.monotonic())
                 if store.multi_node and store.node_rank == 0 else None)
        for restart_count in range(config.max_restarts + 1):
            if restart_count:
                specs = worker_specs(config, master_port=store.port, log_dir=log_dir,
                                     restart_count=restart_count)
            try:
                workers = start_workers(specs, console=console)
            except OSError as e:  # e.g. --no-python with a command that does not exist
                store.publish_stop(StopRecord(node_rank=config.node_rank,
                                              reason=f"node {config.node_rank} could not start "
                                                     f"its ranks: {e}"))
                raise
            outcome = Supervisor(workers, signals=signals, store=store, watch=watch,
                                 term_timeout_s=config.term_timeout_s,
                                 restart_on_failure=restart_count < config.max_restarts).run()
            if not restarts.should_restart(outcome, restart_count=restart_count,
                                           max_restarts=config.max_restarts, log_dir=log_dir):
                break
        restarts.stop_front_end(log_dir, clean=outcome.exit_code == 0,
                                term_timeout_s=config.term_timeout_s)
        if console_fd is not None:
            os.close(console_fd)
        store.mark_done()
        if watch is not None:
            grace = (config.term_timeout_s + 3 * STORE_POLL_S + 5 if outcome.stopping
                     else config.rdzv_timeout_s)
            lost = wait_for_other_nodes(store, signals, timeout_s=grace, watch=watch)
            outcome.lost = outcome.lost or lost
    _report(outcome, config=config, log_dir=log_dir)
    # the logs of a failure stay (the report names the folder); a clean exit or a stop the user
    # asked for (Ctrl-C, SIGTERM, to this node's launcher or another's) leaves nothing behind
    asked = outcome.signal is not None or getattr(outcome.remote, "signal", None) is not None
    stopped_on_request = asked and outcome.failure is None and outcome.lost is None
    if own_log_dir and (outcome.exit_code == 0 or stopped_on_request):
        shutil.rmtree(log_dir, ignore_errors=True)
    return outcome.exit_code


def _dup_console(console: TextIO) -> int | None:
    """A descriptor of ``console`` for the front end to write to; None when it has none (a
    test's in-memory console: the front end then writes to rank 0's stderr)."""
    try:
        return os.dup(console.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _report(outcome: Outcome, *, config: LaunchConfig, log_dir: str) -> None:
    codes = ", ".join(f"rank {r}: {c}" for r, c in sorted(outcome.exit_codes.items()))
    if outcome.failure is not None:
        stopped = "the launcher stopped the other ranks; " if len(outcome.exit_codes) > 1 else ""
        logger.error("%s\n%sexit codes: %s; logs in %s", outcome.failure.describe(), stopped,
                     codes, log_dir)
        first = outcome.remote or outcome.lost
        if first is not None:
            logger.error("another node had stopped first, likely the root cause: %s",
                         first.reason)
    elif outcome.lost is not None:
        logger.error("%s\nstopped every rank of this node (exit codes: %s; logs in %s)",
                     outcome.lost.reason, codes, log_dir)
    elif outcome.remote is not None and outcome.remote.signal is not None:
        logger.warning("stopped because another node was stopped: %s (exit codes: %s)",
                       outcome.remote.reason, codes)
    elif outcome.remote is not None:
        logger.error("stopped because another node stopped: %s\n(this node's exit codes: %s; "
                     "logs in %s)", outcome.remote.reason, codes, log_dir)
    elif outcome.signal is not None:
        logger.warning("stopped by %s (exit codes: %s)", signal.Signals(outcome.signal).name,
                       codes)
    else:
        logger.info("node %d: all %d ranks exited cleanly", config.node_rank,
                    config.nproc_per_node)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The launcher's argument parser (also what ``atom launch`` shows for ``--help``)."""
    d = LaunchConfig(command=("-",))
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=d.nproc_per_node,
                   help="ranks (worker processes) on this node")
    p.add_argument("--nnodes", type=int, default=d.nnodes, help="nodes, one launcher each")
    p.add_argument("--node-rank", "--node_rank", type=int, default=d.node_rank,
                   help="this node's rank; node 0 hosts the rendezvous store")
    p.add_argument("--master-addr", "--master_addr", default=d.master_addr,
                   help="node 0's address, reachable from every node")
    p.add_argument("--master-port", "--master_port", type=int, default=d.master_port,
                   help="the store's port; 0 = a free one (single node only)")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run COMMAND as an executable instead of an atom subcommand")
    p.add_argument("--log-dir", default=None,
                   help="per-rank stderr logs and error files (default: a temporary folder, "
                        "removed after a clean run)")
    p.add_argument("--term-timeout-s", type=float, default=d.term_timeout_s,
                   help="seconds between SIGTERM and SIGKILL when stopping the ranks")
    p.add_argument("--rdzv-timeout-s", type=float, default=d.rdzv_timeout_s,
                   help="seconds the launchers of a multi-node run wait for each other")
    p.add_argument("--node-timeout-s", type=float, default=d.node_timeout_s,
                   help="seconds of silence after which node 0 takes another node for lost")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=d.max_restarts,
                   help="restart every rank after a rank failure, up to this many times "
                        "(one node); an atom command's front end resumes its requests")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="an atom subcommand (generate ...), a script.py, or with --no-python "
                        "any executable; separate it with -- if it starts with a dash")
    return p


def parse_config(argv: Sequence[str] | None = None, *, prog: str | None = None) -> LaunchConfig:
    """Parse the command line into a :class:`LaunchConfig`; exits (code 2, one line) on bad
    input."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return LaunchConfig(command=tuple(command), nproc_per_node=args.nproc_per_node,
                            nnodes=args.nnodes, node_rank=args.node_rank,
                            master_addr=args.master_addr, master_port=args.master_port,
                            no_python=args.no_python, log_dir=args.log_dir,
                            term_timeout_s=args.term_timeout_s,
                            rdzv_timeout_s=args.rdzv_timeout_s,
                            node_timeout_s=args.node_timeout_s,
                            max_restarts=args.max_restarts)
    except ValueError as e:
        parser.error(str(e))
        raise AssertionError("unreachable") from e  # parser.error exits


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Entry point of ``python -m atom.launch`` and ``atom launch``; returns the exit code."""
    config = parse_config(argv, prog=prog)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[atom.launch] %(message)s")
    try:
        return launch(config)
    except (RuntimeError, ValueError, TimeoutError, OSError) as e:
        logger.error("error: %s", e)
        return 1

