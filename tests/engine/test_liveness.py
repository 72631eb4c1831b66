"""Liveness without a model: the heartbeat monitor's arithmetic, a real heartbeat thread on real
sockets, and the ZMQ client's rank-failure handling against fake cores (threads speaking the
wire protocol): a silent rank is declared hung within the timeout and killed, an exited one
dead, the failure sticks until recover() starts the successor group, and a deployment that
cannot go on raises EngineDeadError with every rank killed. The DP client's router releases
every charged request exactly once on a recovery.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
import zmq

from atom.config import EngineConfig
from atom.dp.dp_client import DPEngineCoreClient
from atom.engine.core_client import MPClient
from atom.engine.liveness import (
    DEAD,
    HUNG,
    EngineDeadError,
    HeartbeatMonitor,
    HeartbeatThread,
    RankFailedError,
    RankFailure,
    heartbeat_interval_s,
    pid_running,
)
from atom.messages import (
    EngineCoreRequest,
    EngineRuntime,
    Heartbeat,
    ReadyMessage,
    Shutdown,
    UtilityCall,
    UtilityResult,
    decode_input,
    decode_output,
    encode,
)
from atom.sampling_params import SamplingParams

HANG_TIMEOUT_S = 2.0
DEADLINE_S = 20.0  # liveness: a failure surfaces within this
RUNTIME = EngineRuntime(num_kv_blocks=8, max_model_len=64, vocab_size=100, eos_token_ids=(2,),
                        kv_cache_bytes=1, dtype="float32")


def test_heartbeat_interval_and_monitor():
    assert heartbeat_interval_s(60.0) == 1.0 and heartbeat_interval_s(2.0) == 0.4
    monitor = HeartbeatMonitor(hang_timeout_s=5.0)
    monitor.reset(2, now_s=100.0)
    assert monitor.hung(104.9) == []
    monitor.beat(Heartbeat(dp_rank=0, tick=7), now_s=104.0)
    monitor.beat(Heartbeat(dp_rank=9, tick=1), now_s=104.0)  # not a rank: ignored
    (hung,) = monitor.hung(105.0)
    assert (hung.dp_rank, hung.kind, hung.last_tick) == (1, HUNG, None)
    assert "no heartbeat for 5.0 s" in hung.reason
    assert monitor.silence_s(106.0) == [2.0, 6.0] and monitor.last_ticks == [7, None]


def test_rank_failed_error_names_the_ranks_in_order():
    error = RankFailedError([RankFailure(1, HUNG, "silent"), RankFailure(0, DEAD, "exit 1")])
    assert error.dp_ranks == [0, 1] and isinstance(error, EngineDeadError)
    assert str(error) == "dp rank 0 is dead: exit 1; dp rank 1 is hung: silent"


def test_pid_running():
    assert pid_running(os.getpid())
    assert not pid_running(2**22 + 12345)  # beyond pid_max


def test_heartbeat_thread_beats_with_the_tick_until_closed():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc://{tempfile.mkdtemp()}/beats"
    pull.bind(addr)
    ticks = iter(range(100))
    thread = HeartbeatThread(ctx, addr, dp_rank=3, interval_s=0.05, tick=lambda: next(ticks))
    beats = [decode_output(pull.recv()) for _ in range(3)]
    thread.close()
    assert [(b.dp_rank, b.tick) for b in beats] == [(3, 0), (3, 1), (3, 2)]
    pull.close(linger=0)
    ctx.destroy(linger=0)


class FakeCore:
    """A thread that answers like an engine core: ready, heartbeats, get_stats, Shutdown."""

    def __init__(self, dp_rank: int, input_addr: str, output_addr: str):
        self.dp_rank, self.requests = dp_rank, []
        self.beating, self.alive = threading.Event(), True
        self.beating.set()
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.connect(input_addr)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.connect(output_addr)
        self._output.send(encode(ReadyMessage(dp_rank=dp_rank, runtime=RUNTIME, pid=os.getpid())))
        self._beats = HeartbeatThread(self._ctx, output_addr, dp_rank=dp_rank,
                                      interval_s=heartbeat_interval_s(HANG_TIMEOUT_S),
                                      tick=lambda: len(self.requests))
        threading.Thread(target=self._serve, daemon=True).start()

    def hang(self) -> None:
        self._beats.close()

    def _serve(self) -> None:
        while self.alive:
            if not self._input.poll(50):
                continue
            message = decode_input(self._input.recv())
            if isinstance(message, EngineCoreRequest):
                self.requests.append(message)
            elif isinstance(message, UtilityCall):
                self._output.send(encode(UtilityResult(dp_rank=self.dp_rank,
                                                       call_id=message.call_id, result={})))
            elif isinstance(message, Shutdown):
                self.stop()
        self._ctx.destroy(linger=0)  # this thread owns the sockets

    def stop(self) -> None:
        self._beats.close()  # first: the serving thread then destroys the context
        self.alive = False


class FakeRanks:
    """RankProcesses over :class:`FakeCore` threads; records kills; ``successor`` gives a
    fresh set (``replace``) unless ``can_continue`` is off."""

    def __init__(self, generation: int = 0, can_continue: bool = True,
                 slots: list[int] | None = None):
        self.generation, self.can_continue = generation, can_continue
        self._dir = tempfile.mkdtemp()
        self.cores: list[FakeCore] = []
        self.killed: list[int] = []
        self.exited_ranks: list[int] = []
        self.slots = slots or []

    def address(self, name):
        return f"ipc://{self._dir}/{name}"

    def start(self, config, *, input_addrs, output_addr, extra_eos_token_ids):
        self.slots = list(range(config.data_parallel_size))
        self.cores = [FakeCore(r, a, output_addr) for r, a in enumerate(input_addrs)]

    def is_alive(self):
        return not self.exited_ranks

    def exited(self):
        return [(r, f"fake rank {r} exited") for r in self.exited_ranks]

    def dead_message(self):
        return None

    def kill(self, dp_ranks):
        self.killed += dp_ranks
        for r in dp_ranks:
            self.cores[r].stop()

    def successor(self, error, *, policy):
        return FakeRanks(self.generation + 1, slots=self.slots) if self.can_continue else None

    def on_ready(self, pids):
        self.pids = pids

    def abandon(self):
        for core in self.cores:
            core.stop()

    def stop(self):
        self.abandon()

    def cleanup(self):
        pass


CONFIG = EngineConfig(data_parallel_size=2, engine_hang_timeout_s=HANG_TIMEOUT_S,
                      on_rank_failure="replace")


def _wait_failure(client) -> RankFailedError:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            client.get_outputs(timeout_s=0.2)
        except RankFailedError as error:
            return error
    raise AssertionError("no failure surfaced")


def test_silent_rank_is_hung_killed_and_sticks_until_recover():
    ranks = FakeRanks()
    client = MPClient(CONFIG, ranks=ranks)
    try:
        assert client.membership()["dp_size"] == 2 and client.pids == [os.getpid()] * 2
        ranks.cores[1].hang()
        error = _wait_failure(client)
        assert [(f.dp_rank, f.kind) for f in error.failures] == [(1, HUNG)]
        assert ranks.killed == [1] and not client.is_alive()
        with pytest.raises(RankFailedError):  # it sticks, whatever the call
            client.call_utility_per_rank("get_stats")
        client.recover(error)
        assert client.generation == 1 and client.is_alive() and client.ranks is not ranks
        assert client.call_utility_per_rank("get_stats") == [{}, {}]
        stats = client.front_end_stats()
        assert (stats["rank_failures_hung"], stats["rank_recoveries"], stats["dp_size"]) == \
            (1, 1, 2)
        assert client.membership()["rank_failures"][0]["kind"] == HUNG
    finally:
        client.shutdown()


def test_exited_rank_is_dead_and_no_successor_means_engine_dead_with_every_rank_killed():
    ranks = FakeRanks(can_continue=False)
    client = MPClient(CONFIG, ranks=ranks)
    try:
        ranks.exited_ranks = [0]
        error = _wait_failure(client)
        assert [(f.dp_rank, f.kind) for f in error.failures] == [(0, DEAD)]
        with pytest.raises(EngineDeadError, match="dp rank 0 is dead.*stays down"):
            client.recover(error)
        assert ranks.killed == [0, 1]
    finally:
        client.shutdown()


def test_dp_client_recovery_releases_every_charged_request_once():
    ranks = FakeRanks()
    client = DPEngineCoreClient(CONFIG, ranks=ranks)
    try:
        for i in range(3):
            client.add_request(EngineCoreRequest(f"r{i}", [1, 2], SamplingParams(), 0.0))
        assert client.router.loads == [2, 1]
        ranks.cores[0].hang()
        error = _wait_failure(client)
        client.recover(error)
        assert client.router.loads == [0, 0] and client.router.rank_of("r0") is None
        assert (client.wave_id, client.group_idle) == (0, True)
        client.add_request(EngineCoreRequest("r0", [1, 2], SamplingParams(), 0.0))  # again
        assert client.router.loads == [1, 0]
        deadline = time.monotonic() + DEADLINE_S
        while [len(c.requests) for c in client.ranks.cores] != [1, 0]:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # polling the fake core's thread until the request arrived
    finally:
        client.shutdown()


def test_a_forward_longer_than_the_hang_timeout_is_not_a_hang():
    """The heartbeat thread beats through a forward (torch and atom's kernels release the GIL):
    a real engine-core process running one prefill forward twice as long as the shortest
    hang timeout is never declared hung. The prompt is sized on this machine from a short
    request, and the long request's TTFT shows its forward did outlast the timeout."""
    from atom import LLM

    config = dict(engine_hang_timeout_s=HANG_TIMEOUT_S, num_threads=1, dtype="float32",
                  max_model_len=4096, max_num_batched_tokens=4096, num_kv_blocks=260,
                  block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM(**config) as llm:
        llm.generate([list(range(100, 164))], params)  # warm-up
        start = time.perf_counter()
        llm.generate([list(range(100, 356))], params)
        per_token_s = (time.perf_counter() - start) / 256
        num_tokens = min(4000, int(2 * HANG_TIMEOUT_S / per_token_s))
        [out] = llm.generate([[100 + i % 9000 for i in range(num_tokens)]], params)
        assert out.outputs[0].finish_reason == "length", out.outputs[0].error
        assert out.metrics.ttft_s > HANG_TIMEOUT_S, (num_tokens, out.metrics.ttft_s)
        assert llm.get_stats()["rank_failures_hung"] == 0
