"""An ``atom`` command run as one rank of a deployment that ``atom launch`` or torchrun started.

Every process the launcher starts runs the same command line (``atom generate ...``,
``atom serve ...``) with the rank contract in its environment (:mod:`atom.launch.launcher`).
Each one is a DP rank: it runs the DP engine-core loop (:func:`atom.dp.dp_core_proc.run_rank`)
in its main thread and nothing else. The command's own work, the front end, runs once, in a
child process of rank 0 (so it never sits inside rank 0's busy loop)::

    launcher ─┬─ rank 0: DP engine core ──┬── child: the front end (same command line,
              │                            │   ATOM_FRONT_END_FD set) binds its ZMQ sockets
              │                            │   on this node's address and writes them on a pipe
              │   publishes them in the rendezvous store (atom.launch.endpoints)
              ├─ rank 1: DP engine core: looks them up, connects
              └─ ...  (other nodes alike)

Start-up: rank 0 starts the front end first (it loads the tokenizer while the ranks load the
weights), every rank joins the process groups, rank 0 publishes the front end's endpoints,
every rank looks them up, connects and sends its ready message to the front end.

Shutdown: the front end finishes its command and sends Shutdown to every rank; the ranks stop
together (one last control sync) and exit 0; rank 0 then exits with the front end's exit code.
If the front end dies without that (a crash, a signal), rank 0 exits with an error and the
launcher stops every rank; if a rank dies, the launcher stops them all: rank 0 then signals the
front end (:data:`atom.engine.core_proc.RANKS_STOPPING_SIGNAL`), whose open requests end at once with an error
(streams: an error event and ``[DONE]``), and the front end exits with rank 0's process group.
The front end also watches the ranks on its node itself and fails its requests naming the
rank when it sees one exit first.

Restarts (``atom launch --max-restarts K``, one node): rank 0 of the first start runs the
front end in a session of its own and writes its pid to ``ATOM_FRONT_END_PID_FILE``; when a
rank fails the launcher stops and restarts the ranks, the front end stays, the restarted
ranks (``TORCHELASTIC_RESTART_COUNT`` > 0) find its endpoints in the launcher's store, and the
front end resumes its in-flight requests on them (docs/ARCHITECTURE.md, "Rank failures"). The
launcher stops the front end when it gives up or the run ends.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time

from atom.config import EngineConfig

logger = logging.getLogger(__name__)

# Set in the front end's environment by rank 0: the pipe (fd) to write its endpoints to.
FRONT_END_FD_ENV = "ATOM_FRONT_END_FD"
_FRONT_END_EXIT_S = 2.0  # after that signal, how long rank 0 waits for it to exit by itself
_OUTPUT_KEY = "dp/front_end/output"


def _input_key(dp_rank: int) -> str:
    return f"dp/front_end/input/{dp_rank}"


def is_front_end() -> bool:
    """True in the front-end child that rank 0 of a launched deployment started."""
    return os.environ.get(FRONT_END_FD_ENV, "") != ""


def launched_data_parallel_size(requested: int) -> int:
    """The DP size of a launched deployment: ``WORLD_SIZE`` (tensor parallel size is 1).

    Raises:
        ValueError: ``requested`` (``--data-parallel-size``) is neither 1 (the default) nor
            ``WORLD_SIZE``.
    """
    from atom.dp.groups import RankInfo

    world = RankInfo.from_env().dp_size
    if requested not in (1, world):
        raise ValueError(f"--data-parallel-size {requested} disagrees with the launcher's "
                         f"WORLD_SIZE={world}: leave it out (the launcher sets the ranks)")
    return world


def launched_client(config: EngineConfig, extra_eos_token_ids: tuple[int, ...]):
    """The front end's DP client: bind on this node, tell rank 0 the endpoints, wait for the
    ranks' ready messages.

    Raises:
        RuntimeError: rank 0 exited before every rank was ready.
        ValueError: cache_aware routing over more than one node (this front end subscribes to
            the ranks' KV events by the endpoints they bound, which name their own node).
    """
    from atom.dp.dp_client import DPEngineCoreClient, LaunchedRanks
    from atom.dp.groups import RankInfo
    from atom.dp.node_address import route_source_address

    info = RankInfo.from_env()
    if config.dp_load_balance == "cache_aware" and info.local_world_size != info.dp_size:
        raise ValueError("dp_load_balance=cache_aware is not supported across nodes yet: run "
                         "one node, or pick least_requests / round_robin")
    fd = int(os.environ[FRONT_END_FD_ENV])

    def announce(output_addr: str, input_addrs: list[str]) -> None:
        with os.fdopen(fd, "w") as pipe:
            pipe.write(json.dumps({"output": output_addr, "inputs": input_addrs}) + "\n")

    # this node's address as the other nodes reach it (127.0.0.1 for a loopback master)
    ranks = LaunchedRanks(route_source_address(info.master_addr, info.master_port), announce,
                          max_restarts=info.max_restarts, num_local_ranks=info.local_world_size)
    return DPEngineCoreClient(config, extra_eos_token_ids=extra_eos_token_ids, ranks=ranks)


def run_launched_rank(argv: list[str], config: EngineConfig) -> int:
    """Run this process as one DP rank of a launched deployment (module docstring).

    Args:
        argv: the ``atom`` command line (without the program name); rank 0 starts the front
            end with it.
        config: the command's engine options, ``data_parallel_size`` = ``WORLD_SIZE``.
    Returns:
        The exit code: rank 0 returns the front end's, the others 0; 0 after SIGTERM.
    Raises:
        RuntimeError: the front end exited before it announced its endpoints, or without
            shutting the ranks down. Start-up and loop errors of the rank itself propagate
            (the launcher reports them).
    """
    from atom.dp.dp_core_proc import run_rank as run_dp_rank
    from atom.dp.groups import RankInfo
    from atom.engine.llm_engine import tokenizer_eos_token_ids
    from atom.engine.preflight import check_model_files
    from atom.engine.core_proc import ShutdownRequested, install_signal_handlers
    from atom.launch.endpoints import lookup_endpoint, publish_endpoint
    from atom.worker.model_files import load_tokenizer

    install_signal_handlers()  # the launcher decides; SIGTERM stops us
    info = RankInfo.from_env()
    timeout_s = config.dp_group_timeout_s
    master = dict(master_addr=info.master_addr)  # endpoints must be reachable from every node
    # a restarted group (--max-restarts) finds the front end of its first start still running
    starts_front_end = info.rank == 0 and info.restart_count == 0
    front_end, announcements = _start_front_end(argv) if starts_front_end else (None, None)
    try:
        check_model_files(config)  # the front end checks too; this rank loads the tokenizer
        extra_eos = () if config.skip_tokenizer_init else tokenizer_eos_token_ids(
            load_tokenizer(config.model))

        def endpoints(groups) -> tuple[str, str]:
            if front_end is not None:
                announced = _read_announcement(announcements, front_end, timeout_s=timeout_s)
                publish_endpoint(groups.store, _OUTPUT_KEY, announced["output"], **master)
                for rank, address in enumerate(announced["inputs"]):
                    publish_endpoint(groups.store, _input_key(rank), address, **master)
            return (lookup_endpoint(groups.store, _input_key(info.dp_rank), timeout_s=timeout_s,
                                    **master),
                    lookup_endpoint(groups.store, _OUTPUT_KEY, timeout_s=timeout_s, **master))

        run_dp_rank(config, extra_eos_token_ids=extra_eos, endpoints=endpoints,
                    front_end=front_end)
        # the ranks stopped together: the launcher's SIGTERM that may still come (another
        # node's launcher signals a moment after node 0's) must not make this clean exit a
        # death by signal (SIG_IGN, unlike a Python handler, lasts through interpreter exit)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ShutdownRequested:  # the launcher is stopping every rank (its process group too)
        logger.info("[rank %d] SIGTERM: shutting down", info.rank)
        if front_end is not None and front_end.poll() is None and not info.max_restarts:
            _stop_front_end(front_end)
        return 0
    except BaseException:
        # with restarts the front end outlives the group (a peer's death fails this rank's
        # collectives first): the launcher decides its end
        if front_end is not None and front_end.poll() is None and not info.max_restarts:
            front_end.kill()
        raise
    finally:
        if announcements is not None:
            announcements.close()
    if front_end is None:
        return 0
    try:
        rc = front_end.wait(timeout=30.0)
    except subprocess.TimeoutExpired:
        front_end.kill()
        raise RuntimeError("the front end did not exit within 30 s of the ranks' shutdown")
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's 128 + N


def _stop_front_end(front_end: subprocess.Popen) -> None:
    """The launcher is stopping every rank: the front end has failed its open requests
    (:data:`~atom.engine.core_proc.RANKS_STOPPING_SIGNAL`, sent on the first SIGTERM) and, with the
    launcher's SIGTERM to this rank's process group, exits; else (a launcher that signals only
    this process) it gets SIGTERM here."""
    try:
        front_end.wait(timeout=_FRONT_END_EXIT_S)
    except subprocess.TimeoutExpired:
        front_end.terminate()


def _start_front_end(argv: list[str]):
    """Start the front end (``python -m atom.entrypoints.cli ARGV``) with a pipe to announce
    its endpoints on; stdin, stdout and stderr are this rank's. Under ``atom launch
    --max-restarts`` (``ATOM_FRONT_END_PID_FILE`` set) it runs in a session of its own, so that
    stopping this rank's process group for a restart leaves it running, its pid goes to that
    file for the launcher, which stops it at the end, and its stderr is the launcher's own
    (``ATOM_FRONT_END_STDERR_FD``), which outlives this rank's."""
    from atom.launch.env import FRONT_END_PID_FILE_ENV, FRONT_END_STDERR_FD_ENV

    read_fd, write_fd = os.pipe()
    env = {**os.environ, FRONT_END_FD_ENV: str(write_fd)}
    pid_file = os.environ.get(FRONT_END_PID_FILE_ENV, "")
    stderr_fd = env.pop(FRONT_END_STDERR_FD_ENV, "")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "atom.entrypoints.cli", *argv], env=env,
                                pass_fds=(write_fd,), start_new_session=bool(pid_file),
                                stderr=int(stderr_fd) if stderr_fd else None)
    finally:
        os.close(write_fd)
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(f"{proc.pid}\n")
    return proc, os.fdopen(read_fd, "r")


def _read_announcement(pipe, front_end: subprocess.Popen, *, timeout_s: float) -> dict:
    """The front end's ``{"output": addr, "inputs": [addr per rank]}``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([pipe], [], [], 0.5)
        if ready:
            line = pipe.readline()
            if line:
                return json.loads(line)
            raise RuntimeError(f"the front end (pid {front_end.pid}) exited or closed its pipe "
                               f"before announcing its endpoints (exit code {front_end.wait()}); "
                               f"its error is above in rank 0's stderr")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the front end announced no endpoints within {timeout_s:.0f} s")
