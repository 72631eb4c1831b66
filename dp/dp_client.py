"""DPEngineCoreClient: the engine-core client of a DP deployment — routing and waves.

Everything else (sockets, ready handshake, send and poll loops, utility calls, liveness,
shutdown, the processes) is :class:`atom.engine.core_client.MPClient`'s, which this
subclasses; its ranks run ``python -m atom.dp.dp_core_proc`` (spawned), or a launcher started
them (:class:`LaunchedRanks`).

Routing: requests go to the rank :class:`atom.dp.router.DPRouter` picks (``data_parallel_rank``
pins one; ``session_id`` names the request's conversation, for ``cache_aware``); aborts and
stop-string finishes go to the rank that owns the request. A request's load is charged at
dispatch and released exactly once, when its last choice finishes (a stop string, or the
core's finish, an error included) or it is aborted (a client's abort or disconnect).

``cache_aware``: once the ranks are ready the client subscribes to every rank's KV events (the
endpoints each rank reported in its ready message; :class:`atom.engine.kv_subscriber.KVEventSubscriber`)
and the router reads the subscriber's index. The client polls the subscriber, without waiting,
before every routing decision and on every ``get_outputs``; no thread of its own.

Waves (docs/ARCHITECTURE.md, "Idle and waves"): the client tracks the current wave and whether it
believes the group idle. Every request carries the current wave id; dispatching while idle sends
the request, then ``StartWave(current)`` to every rank; ``wave_complete=w`` from rank 0 marks the
group idle with current wave ``w + 1``; a :class:`~atom.messages.WaveWakeup` (a rank woke on a
request the client sent while it thought the group was stepping) makes it send ``StartWave`` to
every rank. A tick-clocked request (``arrival_tick`` set: a replay) sent while idle defers that
``StartWave`` to the next :meth:`~DPEngineCoreClient.get_outputs`, so every request of a
replay reaches its rank before the wave's first tick (``atom.dp.dp_core_proc``).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
from collections.abc import Callable

import msgspec

from atom.config import EngineConfig
from atom.dp.router import CacheAwareSettings, DPRouter
from atom.engine.core_client import MPClient
from atom.engine.liveness import pid_running
from atom.engine.spawned_ranks import RankProcesses
from atom.engine.kv_subscriber import KVEventSubscriber, PublisherEndpoints, connectable_endpoint, \
    wire_block_hashes
from atom.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    StartWave,
    WaveWakeup,
    encode,
)

logger = logging.getLogger(__name__)


class DPEngineCoreClient(MPClient):
    """Starts (or joins) ``config.data_parallel_size`` DP engine cores; routes and runs waves.

    Args: as :class:`~atom.engine.core_client.MPClient` (``ranks``: default spawned on
    this node; :class:`LaunchedRanks` under a launcher).

    Attributes:
        router: the :class:`~atom.dp.router.DPRouter` (loads, sessions, decision counters).
        kv_subscriber: the KV event subscriber over every rank (``cache_aware``; else None).

    Raises:
        RuntimeError: (besides MPClient's) cache_aware, but a rank published no KV events.
    """

    ENTRY_MODULE = "atom.dp.dp_core_proc"

    def __init__(self, config: EngineConfig, **kwargs):
        cache_aware = config.dp_load_balance == "cache_aware"
        self.router = DPRouter(config.dp_load_balance, config.data_parallel_size,
                               cache_aware=CacheAwareSettings.from_config(config)
                               if cache_aware else None)
        self.kv_subscriber: KVEventSubscriber | None = None
        self._unfinished: dict[str, set[int]] = {}  # request id → unfinished choice indices
        self.wave_id = 0
        self.group_idle = True
        self._start_wave_deferred = False  # a replay's StartWave, sent by get_outputs
        self.num_wave_wakeups = 0
        super().__init__(config, **kwargs)

    def _on_group_ready(self) -> None:
        """cache_aware: subscribe to every rank's KV events (each group's own endpoints)."""
        if self.config.dp_load_balance == "cache_aware":
            self.kv_subscriber = self._subscribe(self.kv_event_publishers)
            self.router.index = self.kv_subscriber.index

    def _on_group_lost(self) -> None:
        """The group was lost: every charged request is released (once), the waves restart,
        the KV event subscriber closes (the next group publishes elsewhere)."""
        num_released = self.router.reset(self.num_ranks)
        logger.info("router reset for %d rank(s): %d in-flight request(s) released",
                    self.num_ranks, num_released)
        self._unfinished.clear()
        self.wave_id, self.group_idle = 0, True
        if self.kv_subscriber is not None:
            self.kv_subscriber.close()
            self.kv_subscriber = self.router.index = None

    def _subscribe(self, publishers: list[PublisherEndpoints]) -> KVEventSubscriber:
        ranks = {p.dp_rank for p in publishers}
        missing = sorted(set(range(self.num_ranks)) - ranks)
        if missing:
            raise RuntimeError(f"dp_load_balance=cache_aware needs every rank's KV events, but "
                               f"dp rank(s) {missing} published none")
        return KVEventSubscriber(
            [PublisherEndpoints(p.dp_rank, connectable_endpoint(p.endpoint),
                                None if p.replay_endpoint is None
                                else connectable_endpoint(p.replay_endpoint))
             for p in publishers],
            topic=self.config.kv_events_topic, rcvhwm=self.config.kv_events_hwm)

    # ----- routing -----

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None, *,
                    session_id: str | None = None) -> int:
        """Route and send a request (``data_parallel_rank`` pins the rank; ``session_id``:
        cache_aware keeps a session on its rank); returns the rank it went to.

        Raises:
            ValueError: a bad rank hint, or a request id already running.
            OverflowError, msgspec.EncodeError: a value msgpack cannot hold (nothing is sent).
            EngineDeadError: a rank process is gone.
        """
        # encoded once, before routing: a value msgpack cannot hold fails here, nothing charged
        frame = encode(msgspec.structs.replace(request, wave_id=self.wave_id))
        block_hashes: list[int] = []
        if self.kv_subscriber is not None and data_parallel_rank is None:
            self.kv_subscriber.poll()  # the freshest index for this decision
            block_hashes = wire_block_hashes(request.prompt_token_ids, self.config.block_size)
        rank = self.router.dispatch(request.request_id, data_parallel_rank,
                                    session_id=session_id, block_hashes=block_hashes)
        self._unfinished[request.request_id] = set(range(request.sampling_params.n))
        # the request first: the rank it wakes then has it in its first tick (no empty wave)
        self._send_frame(rank, frame)
        if self.group_idle and request.arrival_tick is not None:
            self._start_wave_deferred = True  # after the replay's other requests
        elif self.group_idle:
            self._start_wave()
        return rank

    def _start_wave(self) -> None:
        self._broadcast(StartWave(self.wave_id))
        self.group_idle = False
        self._start_wave_deferred = False

    def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = collections.defaultdict(list)
        for request_id in request_ids:
            self._unfinished.pop(request_id, None)
            rank = self.router.release(request_id)
            if rank is not None:
                by_rank[rank].append(request_id)
        for rank, ids in by_rank.items():
            self._send(rank, AbortRequests(ids))

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
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

    # ----- stats, outputs, lifecycle -----

    def get_rank_stats(self, *, timeout_s: float | None = None) -> list[dict]:
        """Each rank's stats plus this router's counters for the rank (``dp_router_load``,
        ``dp_router_decisions_<reason>``)."""
        return [{**core, **router} for core, router in zip(
            super().get_rank_stats(timeout_s=timeout_s), self.router.rank_stats())]

    def front_end_stats(self) -> dict:
        """MPClient's, and the KV event subscriber's counters as ``kv_subscriber_<name>``
        (cache_aware)."""
        stats = super().front_end_stats()
        if self.kv_subscriber is not None:
            stats.update({f"kv_subscriber_{k}": v for k, v in self.kv_subscriber.stats().items()})
        return stats

    def get_outputs(self, timeout_s: float | None = None):
        if self._start_wave_deferred:
            self._start_wave()
        if self.kv_subscriber is not None:
            self.kv_subscriber.poll()  # keep the index fresh while the engine runs
        return super().get_outputs(timeout_s)

    def shutdown(self) -> None:
        if self.kv_subscriber is not None:
            self.kv_subscriber.close()
        super().shutdown()

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        for out in message.outputs:
            if out.finish_reason is not None:
                self._seq_finished(out.request_id, out.index)
        super()._on_outputs(message)
        if message.wave_complete is not None and message.wave_complete + 1 > self.wave_id:
            self.wave_id = message.wave_complete + 1
            self.group_idle = True
        # else: a wake-up for a later wave came first; the group is stepping again

    def _on_other(self, message: msgspec.Struct) -> None:
        if not isinstance(message, WaveWakeup):
            super()._on_other(message)
            return
        self.num_wave_wakeups += 1
        if message.wave_id < self.wave_id:
            return  # a wave already started and ended since: nothing to wake
        self.wave_id = message.wave_id
        self.group_idle = False
        self._broadcast(StartWave(message.wave_id))


class LaunchedRanks(RankProcesses):
    """The ranks of a deployment a launcher started (``atom launch``, torchrun), seen from the
    front end that rank 0 runs as its child (:mod:`atom.entrypoints.launched`).

    Args:
        host: an address of this machine that every rank can reach (node 0's, i.e. the
            resolved ``MASTER_ADDR``); the client binds TCP ports on it.
        announce: called once with ``(output_addr, input_addrs)`` after binding; it must get
            them to the ranks (rank 0 publishes them in the rendezvous store).
        max_restarts: the launcher's ``--max-restarts`` (``TORCHELASTIC_MAX_RESTARTS``).

    Without restarts the front end watches its parent, rank 0, and the pids of the other
    ranks on its node (``num_local_ranks``: ranks ``0 .. num_local_ranks - 1``; those on other
    nodes it cannot watch). When any rank dies, the launcher stops every rank, and rank 0's
    process group with it (this front end included); when rank 0 dies, its collectives fail on
    the other ranks too.

    With restarts (``atom launch --max-restarts K``, one node): this front end lives in a
    session of its own and outlives the group. It watches every rank's pid (from the ready
    messages; all on this node), kills a hung rank so that the launcher sees it exit, and
    after a failure waits for the restarted group on the same sockets: :meth:`successor` is
    ``self`` while restarts are left.
    """

    def __init__(self, host: str, announce: Callable[[str, list[str]], None], *,
                 max_restarts: int = 0, num_local_ranks: int):
        self._host = host
        self._num_local_ranks = num_local_ranks
        self._announce: Callable[[str, list[str]], None] | None = announce
        self._parent_pid = os.getppid()
        self.max_restarts = max_restarts
        self.num_restarts = 0
        self.slots: list[int] = []
        self.pids: list[int] = []  # set by the client from the ready messages

    def address(self, name: str) -> str:
        return f"tcp://{self._host}:*"

    def start(self, config: EngineConfig, *, input_addrs: list[str], output_addr: str,
              extra_eos_token_ids: tuple[int, ...]) -> None:
        self.slots = list(range(config.data_parallel_size))
        if self._announce is not None:  # once: a restarted group finds them in the store
            self._announce(output_addr, list(input_addrs))
            self._announce = None

    def is_alive(self) -> bool:
        return not self.exited()

    def exited(self) -> list[tuple[int, str]]:
        if self.max_restarts == 0 and os.getppid() != self._parent_pid:
            return [(0, f"rank 0 (pid {self._parent_pid}), the parent of this front end, has "
                        f"exited; its error is in the launcher's report")]
        return [(rank, f"process {pid} (dp rank {rank}) exited; its error is in the "
                       f"launcher's report")
                for rank, pid in enumerate(self.pids[:self._num_local_ranks])
                if not pid_running(pid)]

    def kill(self, dp_ranks: list[int]) -> None:
        """With restarts: SIGKILL these (hung) ranks, so the launcher restarts the group."""
        if self.max_restarts == 0:
            return
        for rank in dp_ranks:
            if rank < len(self.pids) and pid_running(self.pids[rank]):
                os.kill(self.pids[rank], signal.SIGKILL)

    def successor(self, error, *, policy: str) -> LaunchedRanks | None:
        """``self`` while the launcher has restarts left (it restarts the whole group, as
        torchrun does; ``policy`` is not this front end's to apply), else None."""
        if self.num_restarts >= self.max_restarts:
            return None
        self.num_restarts += 1
        return self

    def on_ready(self, pids: list[int]) -> None:
        self.pids = list(pids)

    def abandon(self) -> None:
        """Wait (bounded) until every process of the lost group is gone: the launcher stops
        them before it starts the next group."""
        deadline = time.monotonic() + _ABANDON_TIMEOUT_S
        while any(pid_running(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling processes that are not our children (no wait() on them)
        self.pids = []

    def stop(self) -> None:
        """Nothing to signal: the ranks stop on the Shutdown messages (sent with linger)."""

    def cleanup(self) -> None:
        pass


_ABANDON_TIMEOUT_S = 60.0  # above the launcher's SIGTERM → SIGKILL grace (--term-timeout-s)
