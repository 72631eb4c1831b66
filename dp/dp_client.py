"""DPEngineCoreClient: the front end's handle on the N DP EngineCore processes of a deployment.

    front end                                  DP rank i (python -m atom.dp.engine_core_proc)
    PUSH  input_addr[i]   ── CoreInput ───>    PULL
    PULL  output_addr     <── CoreOutput ──    PUSH   (one socket shared by every rank)

Who starts the ranks is the ``ranks`` argument's business:

- :class:`SpawnedRanks` (default): the client picks a free ``MASTER_PORT``, starts one process
  per rank on this node with the rank contract (RANK=i, WORLD_SIZE=N, LOCAL_RANK=i,
  LOCAL_WORLD_SIZE=N, MASTER_ADDR=127.0.0.1, MASTER_PORT; torch/OMP threads = cores ÷ N unless
  ``num_threads`` is set), over ``ipc://`` sockets, and watches those processes;
- :class:`LaunchedRanks`: a launcher (``atom launch``, torchrun) started the ranks, possibly on
  several nodes, and this front end is rank 0's child: the client binds TCP sockets on a host
  every rank reaches, hands the addresses to ``announce`` (rank 0 publishes them in the
  rendezvous store) and watches its parent, rank 0.

Either way the client then waits for N ready messages.

Same interface as :class:`atom.engine_core_client.EngineCoreClient` (``add_request``,
``abort``, ``finish``, ``get_outputs``, ``call_utility``, ``get_stats``, ``is_alive``,
``shutdown``), so :class:`atom.engine.LLMEngine` drives it unchanged; ``add_request`` also takes
a ``data_parallel_rank`` hint. Requests are routed by :class:`atom.dp.router.DPRouter`.

Waves (DESIGN.md, "Idle and waves"): the client tracks the current wave and whether it
believes the group idle. Every request carries the current wave id; dispatching while idle
sends the request, then ``StartWave(current)`` to every rank; ``wave_complete=w`` from rank 0 marks the group idle with current wave ``w + 1``; a
:class:`~atom.messages.WaveWakeup` (a rank woke on a request the client sent while it thought
the group was stepping) makes it send ``StartWave`` to every rank.

Liveness as in the single-rank client: every wait polls in short slices and checks every
process, so a dead rank raises :class:`~atom.engine_core_client.EngineDeadError`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
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
from collections.abc import Callable

import msgspec
import zmq

from atom.config import EngineConfig
from atom.dp.router import DPRouter
from atom.engine_core import EngineRuntime
from atom.engine_core_client import (
    _POLL_SLICE_S,
    _SHUTDOWN_GRACE_S,
    _STDERR_TAIL_LINES,
    EngineDeadError,
    _bind,
    _forward_stderr,
    drain_outputs,
)
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
    UtilityCall,
    UtilityResult,
    WaveWakeup,
    decode_output,
    encode,
)

logger = logging.getLogger(__name__)

# get_stats keys that are not summed across ranks (the summed view takes the max)
_NOT_SUMMED = frozenset(("dp_rank", "tick", "wave_id", "collective_count", "collective_hash",
                         "idle", "num_total_blocks", "prefill_delayer_hold_rate",
                         "prefill_delayer_max_consecutive_holds", "num_waves_completed",
                         "num_steps", "num_prefill_steps", "num_mixed_prefill_steps",
                         "num_tbo_steps"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DPEngineCoreClient:
    """Starts ``config.data_parallel_size`` DP engine-core processes and talks to them.

    Args:
        config: engine options (``data_parallel_size``, ``dp_load_balance``, ...).
        extra_eos_token_ids: EOS ids the front end knows besides the model config's.
        startup_timeout_s: how long to wait for every rank's ready message.

    Raises:
        RuntimeError: a rank exited during start-up or sent no ready message in time.
    """

    def __init__(self, config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...] = (),
                 startup_timeout_s: float = 600.0,
                 ranks: SpawnedRanks | LaunchedRanks | None = None):
        n = config.data_parallel_size
        self.num_ranks = n
        self.router = DPRouter(config.dp_load_balance, n)
        self.ranks = SpawnedRanks() if ranks is None else ranks
        self.config = config
        self._ctx = zmq.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self.output_addr = _bind(self._output, self.ranks.address("output"))
        self._inputs = [self._ctx.socket(zmq.PUSH) for _ in range(n)]
        self.input_addrs = [_bind(s, self.ranks.address(f"input{i}"))
                            for i, s in enumerate(self._inputs)]
        self._outputs: collections.deque[list[SeqOutput]] = collections.deque()
        self._utility_results: dict[tuple[int, int], UtilityResult] = {}
        self._call_ids = itertools.count()
        self._unfinished: dict[str, set[int]] = {}  # request id → unfinished choice indices
        self.wave_id = 0
        self.group_idle = True
        self.num_wave_wakeups = 0
        self._closed = False
        try:
            self.ranks.start(config, input_addrs=self.input_addrs, output_addr=self.output_addr,
                             extra_eos_token_ids=extra_eos_token_ids)
            self.runtime = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ----- requests -----

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None) -> None:
        """Route and send a request (``data_parallel_rank`` pins the rank).

        Raises:
            ValueError: a bad rank hint, or a request id already running.
            EngineDeadError: a rank process is gone.
        """
        data = encode(request)  # fail before routing if it cannot be encoded
        del data
        rank = self.router.dispatch(request.request_id, data_parallel_rank)
        self._unfinished[request.request_id] = set(range(request.sampling_params.n))
        # the request first: the rank it wakes then has it in its first tick (no empty wave)
        self._send(rank, msgspec.structs.replace(request, wave_id=self.wave_id))
        if self.group_idle:
            self._broadcast(StartWave(self.wave_id))
            self.group_idle = False

    def abort(self, request_ids: list[str]) -> None:
        """Client aborts: each owning rank frees these requests' KV blocks."""
        by_rank: dict[int, list[str]] = collections.defaultdict(list)
        for request_id in request_ids:
            self._unfinished.pop(request_id, None)
            rank = self.router.release(request_id)
            if rank is not None:
                by_rank[rank].append(request_id)
        for rank, ids in by_rank.items():
            self._send(rank, AbortRequests(ids))

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        """Stop strings the front end matched: the owning ranks finish these sequences."""
        by_rank: dict[int, tuple[list, list]] = collections.defaultdict(lambda: ([], []))
        for key, stop in zip(seq_keys, stop_reasons):
            rank = self.router.rank_of(key[0])
            if rank is None:
                continue
            by_rank[rank][0].append(key)
            by_rank[rank][1].append(stop)
            self._seq_finished(key[0], key[1])
        for rank, (keys, stops) in by_rank.items():
            self._send(rank, FinishRequests(keys, stops))

    def _seq_finished(self, request_id: str, index: int) -> None:
        left = self._unfinished.get(request_id)
        if left is None:
            return
        left.discard(index)
        if not left:
            del self._unfinished[request_id]
            self.router.release(request_id)

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        """Sequence outputs of every rank, oldest first (see ``EngineCoreClient.get_outputs``)."""
        return drain_outputs(self._outputs, self._poll, timeout_s)

    # ----- utilities -----

    def call_utility_per_rank(self, method: str) -> list[dict]:
        """Run ``method`` on every rank (after every input sent so far); results in rank order.

        Raises:
            ValueError: the core does not know ``method``.
            EngineDeadError: a rank process exited.
        """
        call_id = next(self._call_ids)
        self._broadcast(UtilityCall(call_id=call_id, method=method))
        keys = [(rank, call_id) for rank in range(self.num_ranks)]
        while not all(k in self._utility_results for k in keys):
            self._poll(_POLL_SLICE_S)
        results = [self._utility_results.pop(k) for k in keys]
        for r in results:
            if r.error is not None:
                raise ValueError(r.error)
        return [dict(r.result or {}) for r in results]

    def call_utility(self, method: str) -> dict:
        """``method`` on every rank; numeric results summed over ranks (counters like the tick
        or the collective hash: the max). Per rank: :meth:`call_utility_per_rank`."""
        per_rank = self.call_utility_per_rank(method)
        merged: dict = {}
        for result in per_rank:
            for key, value in result.items():
                if key not in merged:
                    merged[key] = value
                elif isinstance(value, bool) or key in _NOT_SUMMED:
                    merged[key] = max(merged[key], value)
                else:
                    merged[key] += value
        return merged

    def get_stats(self) -> dict:
        return self.call_utility("get_stats")

    def get_rank_stats(self) -> list[dict]:
        """Each rank's ``get_stats`` (with tick, wave, collective count/hash, delayer counters)."""
        return self.call_utility_per_rank("get_stats")

    # ----- lifecycle -----

    def is_alive(self) -> bool:
        return self.ranks.is_alive()

    def shutdown(self) -> None:
        """Shutdown to every rank (they stop together), then let :attr:`ranks` stop them (the
        spawned ones: SIGTERM, then SIGKILL, ``_SHUTDOWN_GRACE_S`` apart); close the sockets.
        Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        # to every rank still listening (a dead one's socket just drops it); with linger:
        # launched ranks have nothing else telling them to stop than this Shutdown
        for sock in self._inputs:
            try:
                sock.setsockopt(zmq.LINGER, int(_SHUTDOWN_GRACE_S * 1000))
                sock.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.ranks.stop()
        for sock in self._inputs:
            sock.close()
        self._ctx.destroy(linger=0)
        self.ranks.cleanup()

    def __del__(self):  # best effort; LLM.shutdown / atexit are the real paths
        try:
            self.shutdown()
        except Exception:
            pass

    # ----- internals -----

    def _wait_ready(self, timeout_s: float) -> EngineRuntime:
        deadline = time.monotonic() + timeout_s
        ready: dict[int, ReadyMessage] = {}
        while len(ready) < self.num_ranks:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"DP ranks {sorted(set(range(self.num_ranks)) - set(ready))} "
                                   f"sent no ready message within {timeout_s:.0f} s")
            if self._output.poll(int(_POLL_SLICE_S * 1000)):
                message = decode_output(self._output.recv())
                if isinstance(message, ReadyMessage):
                    ready[message.dp_rank] = message
                else:
                    logger.warning("ignored %s before the ready messages", type(message).__name__)
                continue
            dead = self.ranks.dead_message()
            if dead is not None:
                raise RuntimeError(f"DP engine core failed to start: {dead}")
        m = ready[0]
        return EngineRuntime(num_kv_blocks=m.num_kv_blocks, max_model_len=m.max_model_len,
                             vocab_size=m.vocab_size, eos_token_ids=tuple(m.eos_token_ids),
                             kv_cache_bytes=m.kv_cache_bytes, dtype=m.dtype)

    def _broadcast(self, message: CoreInput) -> None:
        for rank in range(self.num_ranks):
            self._send(rank, message)

    def _send(self, rank: int, message: CoreInput) -> None:
        data = encode(message)
        sock = self._inputs[rank]
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                self._raise_if_dead()
                sock.poll(int(_POLL_SLICE_S * 1000), zmq.POLLOUT)

    def _poll(self, timeout_s: float) -> None:
        if not self._output.poll(int(timeout_s * 1000)):
            self._raise_if_dead()
            return
        while self._output.poll(0):
            message = decode_output(self._output.recv())
            if isinstance(message, EngineCoreOutputs):
                if message.outputs:
                    for out in message.outputs:
                        if out.finish_reason is not None:
                            self._seq_finished(out.request_id, out.index)
                    self._outputs.append(message.outputs)
                if message.wave_complete is not None:
                    self._on_wave_complete(message.wave_complete)
            elif isinstance(message, WaveWakeup):
                self._on_wave_wakeup(message)
            elif isinstance(message, UtilityResult):
                self._utility_results[(message.dp_rank, message.call_id)] = message
            else:
                logger.warning("ignored an unexpected %s from DP rank", type(message).__name__)

    def _on_wave_complete(self, wave_id: int) -> None:
        if wave_id + 1 > self.wave_id:
            self.wave_id = wave_id + 1
            self.group_idle = True
        # else: a wake-up for a later wave came first; the group is stepping again

    def _on_wave_wakeup(self, message: WaveWakeup) -> None:
        self.num_wave_wakeups += 1
        if message.wave_id < self.wave_id:
            return  # a wave already started and ended since: nothing to wake
        self.wave_id = message.wave_id
        self.group_idle = False
        self._broadcast(StartWave(message.wave_id))

    def _raise_if_dead(self) -> None:
        dead = self.ranks.dead_message()
        if dead is not None:
            raise EngineDeadError(f"a DP engine core is dead: {dead}")


class SpawnedRanks:
    """The rank processes of a :class:`DPEngineCoreClient` that starts them itself: one
    ``python -m atom.dp.engine_core_proc`` per rank on this node, over ``ipc://`` sockets in a
    fresh temporary folder (removed by :meth:`cleanup`)."""

    def __init__(self):
        self._ipc_dir = tempfile.mkdtemp(prefix="atom-dp-")
        self.procs: list[subprocess.Popen] = []
        self._tails: list[collections.deque] = []
        self._stderr_threads: list[threading.Thread] = []

    def address(self, name: str) -> str:
        """Where the client binds socket ``name``."""
        return f"ipc://{self._ipc_dir}/{name}"

    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        """Start every rank (they connect to the bound sockets and send ready messages)."""
        n = config.data_parallel_size
        num_threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // n)
        config = dataclasses.replace(config, num_threads=num_threads)
        port = _free_port()
        log_level = logging.getLevelName(logging.getLogger("atom").getEffectiveLevel())
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(num_threads)}
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # these ranks host their own store
            proc = subprocess.Popen(
                [sys.executable, "-m", "atom.dp.engine_core_proc",
                 "--config-json", json.dumps(dataclasses.asdict(config)),
                 "--input-addr", input_addrs[rank], "--output-addr", output_addr,
                 "--dp-rank", str(rank),
                 "--extra-eos-token-ids", *map(str, extra_eos_token_ids),
                 "--log-level", log_level],
                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
            self.procs.append(proc)
            tail: collections.deque = collections.deque(maxlen=_STDERR_TAIL_LINES)
            self._tails.append(tail)
            thread = threading.Thread(target=_forward_stderr, daemon=True,
                                      name=f"atom-dp{rank}-stderr", args=(proc.stderr, tail))
            thread.start()
            self._stderr_threads.append(thread)

    def is_alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def dead_message(self) -> str | None:
        """None while every rank runs; else which one exited, how, and its stderr tail."""
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                self._stderr_threads[rank].join(timeout=1.0)
                rc = p.returncode
                how = (f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
                tail = "".join(self._tails[rank]) or "(empty)"
                return f"process {p.pid} (dp rank {rank}) exited, {how}; stderr tail:\n{tail}"
        return None

    def stop(self) -> None:
        """After the Shutdown messages: wait, then SIGTERM, then SIGKILL, each
        ``_SHUTDOWN_GRACE_S`` long, until every rank has exited."""
        for stop in ("wait", "terminate", "kill"):
            live = [p for p in self.procs if p.poll() is None]
            if not live:
                break
            for p in live:
                if stop != "wait":
                    getattr(p, stop)()
            deadline = time.monotonic() + _SHUTDOWN_GRACE_S
            for p in live:
                try:
                    p.wait(timeout=max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for thread in self._stderr_threads:
            thread.join(timeout=1.0)

    def cleanup(self) -> None:
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class LaunchedRanks:
    """The ranks of a deployment a launcher started (``atom launch``, torchrun), seen from the
    front end that rank 0 runs as its child (:mod:`atom.entrypoints.launched`).

    Args:
        host: an address of this machine that every rank can reach (node 0's, i.e. the
            resolved ``MASTER_ADDR``); the client binds TCP ports on it.
        announce: called once with ``(output_addr, input_addrs)`` after binding; it must get
            them to the ranks (rank 0 publishes them in the rendezvous store).

    The front end cannot watch ranks on other nodes; it watches its parent, rank 0. When any
    rank dies, the launcher stops every rank, and rank 0's process group with it (this front
    end included); when rank 0 dies, its collectives fail on the other ranks too.
    """

    def __init__(self, host: str, announce: Callable[[str, list[str]], None]):
        self._host = host
        self._announce = announce
        self._parent_pid = os.getppid()

    def address(self, name: str) -> str:
        return f"tcp://{self._host}:*"

    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        self._announce(output_addr, list(input_addrs))

    def is_alive(self) -> bool:
        return os.getppid() == self._parent_pid

    def dead_message(self) -> str | None:
        if self.is_alive():
            return None
        return (f"rank 0 (pid {self._parent_pid}), the parent of this front end, has exited; "
                f"its error is in the launcher's report")

    def stop(self) -> None:
        """Nothing to signal: the ranks stop on the Shutdown messages (sent with linger)."""

    def cleanup(self) -> None:
        pass
