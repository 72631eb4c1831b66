"""The EngineCore process and its ZMQ client, on real processes and real sockets.

Ready handshake, outputs, abort and front-end finish (both free the KV pool; only aborts count
as aborts), KV events published by the core and rebuilt by a subscriber, two deployments side
by side, a core killed with SIGKILL or failing at start-up, a malformed frame, an idle core
(its KV events thread included) that does not spin; and no pickle anywhere in atom/ or dp/.
"""

from __future__ import annotations

import ast
import logging
import os
import pathlib
import signal
import time

import msgspec
import pytest

from atom import LLM, SamplingParams
from atom.config import EngineConfig
from atom.engine.llm_engine import LLMEngine
from atom.engine.core_client import EngineDeadError, EngineStartError, MPClient
from atom.engine.kv_subscriber import KVEventSubscriber
from atom.messages import EngineCoreRequest, SeqOutput


# KV events on, on OS-chosen loopback ports
CONFIG = EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256,
                      kv_events_endpoint="tcp://127.0.0.1:0",
                      kv_events_replay_endpoint="tcp://127.0.0.1:0")
PROMPT = list(range(100, 120))
DEADLINE_S = 120.0  # generous liveness deadline for a request on a shared 2-core machine
DEAD_DEADLINE_S = 10.0  # a dead core must surface within this
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client():
    client = MPClient(CONFIG)
    yield client
    client.shutdown()


def _request(request_id: str, **params) -> EngineCoreRequest:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params})
    return EngineCoreRequest(request_id, PROMPT, params, time.monotonic())


def _collect(client: MPClient, request_id: str, *, until_finished: bool = True,
             num_tokens: int | None = None) -> list[SeqOutput]:
    """Outputs of one request until it finished (or has ``num_tokens`` tokens)."""
    outputs: list[SeqOutput] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        outputs += [o for o in client.get_outputs(timeout_s=1.0) if o.request_id == request_id]
        if num_tokens is not None and sum(len(o.new_token_ids) for o in outputs) >= num_tokens:
            return outputs
        if until_finished and outputs and outputs[-1].finish_reason is not None:
            return outputs
    raise AssertionError(f"request {request_id} did not progress within {DEADLINE_S} s")


def _assert_pool_free(stats: dict) -> None:
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == CONFIG.num_kv_blocks
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_ready_handshake_reports_the_runtime(client):
    rt = client.runtime
    assert rt.num_kv_blocks == 64 and rt.max_model_len == 256 and rt.vocab_size == 49152
    assert 2 in rt.eos_token_ids and rt.dtype == "float32" and rt.kv_cache_bytes > 0
    assert client.is_alive() and client.input_addrs[0].startswith("ipc://")


def test_outputs_stream_token_by_token_and_match_the_in_process_core(client):
    client.add_request(_request("greedy"))
    outputs = _collect(client, "greedy")
    assert all(len(o.new_token_ids) == 1 for o in outputs) and len(outputs) == 8
    assert [o.finish_reason for o in outputs] == [None] * 7 + ["length"]
    engine = LLMEngine(CONFIG)  # the same core, in this process
    engine.add_request("greedy", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    local = []
    while engine.has_unfinished_requests():
        local += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == local[-1].outputs[0].token_ids
    _assert_pool_free(client.get_stats())


def test_the_core_publishes_kv_events_and_a_subscriber_rebuilds_its_prefix_cache(client):
    (publisher,) = client.kv_event_publishers  # from the ready message: ports resolved
    assert publisher.dp_rank == 0 and publisher.endpoint.startswith("tcp://127.0.0.1:")
    assert publisher.replay_endpoint is not None and not publisher.replay_endpoint.endswith(":0")

    def index_converges(sub: KVEventSubscriber, expected: set[int]) -> None:
        assert sub.sync(timeout_s=DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while set(sub.index.block_hashes(0)) != expected:
            assert time.monotonic() < deadline, "the index never matched the block manager"
            sub.poll(0.05)

    with KVEventSubscriber([publisher]) as sub:
        client.add_request(_request("kv-events"))
        _collect(client, "kv-events")
        (cached,) = client.call_utility_per_rank("get_cached_block_hashes")
        assert len(cached["block_hashes"]) == 1  # 20 prompt + 7 computed output tokens: 1 block
        index_converges(sub, set(cached["block_hashes"]))
        assert client.call_utility("reset_prefix_cache")["reset"]
        index_converges(sub, set())  # AllBlocksCleared went out at once, the core idle
    stats = client.get_stats()
    assert stats["kv_events_published_batches"] >= 2 and stats["kv_events_dropped_batches"] == 0
    assert stats["prefix_cache_hit_rate"] == (
        stats["prefix_cache_hits"] / stats["prefix_cache_queries"])


def test_bad_request_fails_alone_and_unknown_utility_is_an_error(client):
    client.add_request(_request("bad", stop_token_ids=[10**6]))
    (out,) = _collect(client, "bad")
    assert out.finish_reason == "error" and "vocabulary" in out.error and out.new_token_ids == []
    with pytest.raises(ValueError, match="unknown utility"):
        client.call_utility("no_such_method")
    assert client.is_alive()


def test_abort_frees_kv_and_counts_as_an_abort(client):
    before = client.get_stats()
    client.add_request(_request("to-abort", max_tokens=200, ignore_eos=True))
    _collect(client, "to-abort", until_finished=False, num_tokens=2)
    assert client.get_stats()["num_free_blocks"] < CONFIG.num_kv_blocks
    client.abort(["to-abort"])
    stats = client.get_stats()  # answered after the abort: inputs are handled in order
    _assert_pool_free(stats)
    assert stats["num_aborted_seqs"] == before["num_aborted_seqs"] + 1
    assert stats["num_front_end_finished_seqs"] == before["num_front_end_finished_seqs"]


def test_finish_requests_frees_kv_and_is_not_an_abort(client):
    before = client.get_stats()
    client.add_request(_request("to-finish", n=2, temperature=1.0, seed=1, max_tokens=200, ignore_eos=True))
    _collect(client, "to-finish", until_finished=False, num_tokens=2)
    client.finish([("to-finish", 0), ("to-finish", 1)], ["stop here", "stop there"])
    stats = client.get_stats()
    _assert_pool_free(stats)
    assert stats["num_front_end_finished_seqs"] == before["num_front_end_finished_seqs"] + 2
    assert stats["num_aborted_seqs"] == before["num_aborted_seqs"]
    client.finish([("to-finish", 0)], ["again"])  # already finished: ignored
    assert client.get_stats()["num_front_end_finished_seqs"] == stats["num_front_end_finished_seqs"]


def test_malformed_frame_is_dropped_and_the_core_keeps_serving(client):
    client._sockets.inputs[0].send(b"\xc1 not msgpack")  # noqa: SLF001 - a front-end bug, simulated
    client.add_request(_request("after-garbage", max_tokens=2))
    assert _collect(client, "after-garbage")[-1].finish_reason == "length"


def test_request_frame_with_bad_sampling_params_fails_that_request_alone(client):
    # a front-end bug, simulated: parameters the API boundary would have refused reach the core
    raw = msgspec.to_builtins(_request("bad-params", n=2, temperature=1.0))
    raw["sampling_params"]["temperature"] = -1.0
    client._sockets.inputs[0].send(msgspec.msgpack.encode(raw))  # noqa: SLF001
    outputs = _collect(client, "bad-params")
    assert sorted(o.index for o in outputs) == [0, 1]
    assert all(o.finish_reason == "error" and "temperature" in o.error for o in outputs)
    client.add_request(_request("after-bad-params", max_tokens=2))
    assert _collect(client, "after-bad-params")[-1].finish_reason == "length"
    _assert_pool_free(client.get_stats())


def test_idle_core_blocks_instead_of_spinning(client):
    def cpu_s() -> float:
        fields = pathlib.Path(f"/proc/{client.ranks.procs[0].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    client.get_stats()  # idle from here
    start = cpu_s()
    time.sleep(3.0)  # not synchronization: the span over which CPU use is measured
    assert cpu_s() - start < 0.5  # a spinning loop would burn ~3 s of CPU


def test_two_llms_in_one_process_do_not_collide():
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM(dtype="float32", num_kv_blocks=32, max_model_len=256) as a, \
            LLM(dtype="float32", num_kv_blocks=32, max_model_len=256) as b:
        addrs = {*a.engine.client.input_addrs, a.engine.client.output_addr,
                 *b.engine.client.input_addrs, b.engine.client.output_addr}
        assert len(addrs) == 4
        (out_a,), (out_b,) = a.generate("The capital of France is", params), b.generate(
            "The capital of France is", params)
        assert out_a.outputs[0].token_ids == out_b.outputs[0].token_ids
        ipc_dirs = {pathlib.Path(addr.removeprefix("ipc://")).parent for addr in addrs}
    assert not any(d.exists() for d in ipc_dirs)  # shutdown removed them
    assert a.engine is None and b.engine is None


def test_killed_core_raises_engine_dead_error_quickly():
    llm = LLM(dtype="float32", num_kv_blocks=32, max_model_len=256)
    engine = llm.engine
    try:
        engine.add_request("long", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        while not engine.step():
            pass
        os.kill(engine.client.ranks.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            while True:  # outputs already in flight come first, then the error
                engine.step()
        assert time.monotonic() - start < DEAD_DEADLINE_S
        with pytest.raises(EngineDeadError):
            llm.get_stats()
        with pytest.raises(EngineDeadError):
            engine.client.abort(["long"])
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < DEAD_DEADLINE_S


def test_core_failing_at_start_up_says_why_in_one_line(tmp_path, capfd):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(EngineStartError) as info:
        MPClient(EngineConfig(model=str(missing), num_kv_blocks=8))
    assert str(info.value).startswith(f"the engine core failed to start: model '{missing}' "
                                      f"not found: pass a path")
    assert len(str(info.value).splitlines()) == 1  # no stderr tail, no traceback
    assert "Traceback" not in capfd.readouterr().err  # the core's stderr is forwarded to ours
    atom_logger = logging.getLogger("atom")
    level = atom_logger.level
    atom_logger.setLevel(logging.DEBUG)  # the cores log at the front end's level
    try:
        with pytest.raises(EngineStartError):
            MPClient(EngineConfig(model=str(missing), num_kv_blocks=8))
    finally:
        atom_logger.setLevel(level)
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err and "FileNotFoundError: model" in err


# ----- no pickle -----

_PICKLERS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill"}
_OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                       "scatter_object_list", "send_object_list", "recv_object_list"}


def test_no_pickle_in_atom_or_dp():
    offenders = []
    for folder in ("atom", "dp"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                elif isinstance(node, ast.Attribute):
                    names = [node.attr] if node.attr in _OBJECT_COLLECTIVES else []
                    if isinstance(node.value, ast.Name) and node.value.id in _PICKLERS:
                        names.append(node.value.id)
                hits = [n for n in names if n in _PICKLERS | _OBJECT_COLLECTIVES]
                if hits:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {hits}")
    assert not offenders, "pickle (or a pickling collective) is used:\n" + "\n".join(offenders)
