"""The P/D KV connector without a model: its scheduler side against the real scheduler and
block manager (exact block ids, states, frees), and the TCP transport between two real
connectors over real ZMQ sockets on loopback (bytes, checksums, the layout handshake, the
keep timeout, a producer that is gone)."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.block_manager import BlockManager
from atom.core.kv_connector import (KVConnectorMetadata, KVConnectorScheduler, KVLayout, KeepSpec,
                                    LoadSpec, transfer_endpoint)
from atom.kv_cache_spec import KVCacheSpec
from atom.worker.tcp_kv_connector import TCPKVConnector
from atom.messages import KVTransferParams
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.sequence import FinishReason, Sequence, SequenceStatus

BS = 4


def make_scheduler(role: str, num_blocks: int = 16, *,
                   group_windows: tuple[int | None, ...] = (None,)) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    connector = KVConnectorScheduler(role, block_size=BS, host="127.0.0.1", port=5555,
                                     group_windows=group_windows)
    return Scheduler(config, BlockManager(num_blocks, BS, group_windows=group_windows),
                     eos_token_ids=(2,), connector=connector)


def consumer_seq(prompt: list[int], remote_block_ids: list[int], request_id: str = "c") -> Sequence:
    params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=5555,
                              remote_request_id="p-" + request_id, remote_block_ids=remote_block_ids,
                              remote_num_tokens=len(prompt), first_token_id=77)
    seq = Sequence(request_id, list(prompt), SamplingParams(max_tokens=3, temperature=0))
    seq.kv_transfer_params = params
    seq.token_ids.append(77)  # as Scheduler.attach_kv_transfer_params does
    return seq


def test_local_request_never_touches_the_connector():
    sched = make_scheduler("consumer")
    seq = Sequence("plain", list(range(10, 20)), SamplingParams(max_tokens=1))
    sched.add(seq)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("plain", 10)]
    assert sched.connector.build_connector_meta().is_empty
    sched.update_from_output(out, ModelRunnerOutput.from_tokens({seq.seq_id: 5}))
    assert seq.is_finished and sched.block_manager.num_used_blocks == 0


def test_consumer_waits_for_remote_kv_then_decodes_from_the_first_token():
    sched = make_scheduler("consumer")
    seq = consumer_seq(list(range(10, 20)), [7, 8, 9])  # 10 tokens: 3 blocks
    sched.add(seq)
    out = sched.schedule()
    assert out.is_empty and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert sched.has_unfinished()
    meta = out.kv_connector_metadata  # schedule() hands the worker the loads to start
    assert [(x.request_id, x.remote_block_ids, x.local_block_ids) for x in meta.loads] == [
        ("c", [7, 8, 9], seq.block_table[:3])]
    assert len(seq.block_table) == 3  # 11 tokens (prompt + first token) fit 3 blocks
    from atom.core.kv_connector import KVConnectorOutput

    [output] = sched.update_from_kv_connector_output(KVConnectorOutput(finished_recving={"c"}))
    assert (output.request_id, output.new_token_ids, output.finish_reason) == ("c", [77], None)
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 10
    assert seq.output_token_ids == [77]
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("c", 1)]  # a decode of token 77


def test_consumer_pulls_only_what_its_prefix_cache_lacks():
    sched = make_scheduler("consumer")
    first = Sequence("local", list(range(10, 19)), SamplingParams(max_tokens=1))
    sched.add(first)
    out = sched.schedule()
    # its 2 full blocks are now cached (and free)
    sched.update_from_output(out, ModelRunnerOutput.from_tokens({first.seq_id: 5}))
    seq = consumer_seq(list(range(10, 20)), [7, 8, 9])
    sched.add(seq)
    out = sched.schedule()
    assert seq.num_cached_tokens == 8
    [load] = out.kv_connector_metadata.loads
    assert load.remote_block_ids == [9] and load.local_block_ids == [seq.block_table[2]]


def test_aborted_and_failed_pulls_free_their_blocks():
    from atom.core.kv_connector import KVConnectorOutput

    sched = make_scheduler("consumer")
    a, b = consumer_seq(list(range(10, 20)), [1, 2, 3], "a"), consumer_seq(list(range(30, 35)), [4, 5], "b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.connector.build_connector_meta()
    sched.finish(a, FinishReason.ABORT)
    assert sched.connector.build_connector_meta().cancels == ["a"]
    [output] = sched.update_from_kv_connector_output(KVConnectorOutput(failed_recving={"b": "gone"}))
    assert (output.request_id, output.finish_reason, output.error) == ("b", "error", "gone")
    assert b.finish_reason is FinishReason.ERROR and b.error_message == "gone"
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()
    sched.block_manager.check_invariants()


def test_producer_keeps_blocks_until_sent():
    from atom.core.kv_connector import KVConnectorOutput

    sched = make_scheduler("producer")
    seq = Sequence("p", list(range(10, 20)), SamplingParams(max_tokens=1, temperature=0))
    seq.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput.from_tokens({seq.seq_id: 42}))
    assert seq.finish_reason is FinishReason.LENGTH
    params = seq.kv_transfer_params
    assert params.do_remote_prefill and params.first_token_id == 42 and params.remote_num_tokens == 10
    assert params.remote_block_ids == seq.block_table and params.remote_port == 5555
    assert sched.connector.build_connector_meta().keeps == [KeepSpec("p", params.remote_block_ids)]
    assert sched.block_manager.num_used_blocks == 3 and "p" in sched.kv_kept
    sched.update_from_kv_connector_output(KVConnectorOutput(finished_sending={"p"}))
    assert sched.block_manager.num_used_blocks == 0 and not sched.kv_kept


def test_producer_frees_at_once_when_the_first_token_ends_the_request():
    sched = make_scheduler("producer")
    seq = Sequence("p", list(range(10, 20)), SamplingParams(max_tokens=1, temperature=0))
    seq.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    sched.add(seq)
    # EOS: nothing to decode
    sched.update_from_output(sched.schedule(), ModelRunnerOutput.from_tokens({seq.seq_id: 2}))
    assert seq.finish_reason is FinishReason.STOP and seq.kv_transfer_params is None
    assert sched.block_manager.num_used_blocks == 0 and not sched.kv_kept


def test_hybrid_producer_keeps_and_consumer_loads_only_the_window():
    """Window 4, blocks of 4, a 10-token prompt (kv_connector's docstring diagram): token 10's
    query sees keys 7..10, so the sliding group moves blocks 1 and 2 and the consumer holds
    none before them; every block comes back on both sides."""
    from atom.core.kv_connector import KVConnectorOutput

    producer = make_scheduler("producer", group_windows=(None, 4))
    seq = Sequence("p", list(range(10, 20)), SamplingParams(max_tokens=1, temperature=0))
    seq.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    producer.add(seq)
    producer.update_from_output(producer.schedule(), ModelRunnerOutput.from_tokens({seq.seq_id: 42}))
    params = seq.kv_transfer_params
    sliding = seq.group_block_tables[0]
    assert sliding[0] is None and params.remote_group_block_ids == [sliding[1:3]]
    assert producer.connector.build_connector_meta().keeps == [
        KeepSpec("p", seq.block_table, [sliding[1:3]])]

    consumer = make_scheduler("consumer", group_windows=(None, 4))
    remote = msgspec.structs.replace(params, remote_request_id="p")
    c = Sequence("c", list(range(10, 20)), SamplingParams(max_tokens=3, temperature=0))
    assert consumer.attach_kv_transfer_params([c], remote, vocab_size=100) is None
    consumer.add(c)
    out = consumer.schedule()
    assert c.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    table = c.group_block_tables[0]
    assert table[0] is None and None not in table[1:] and len(table) == 3
    assert consumer.block_manager.num_used_blocks == 3 + 2  # 3 full, 2 sliding
    [load] = out.kv_connector_metadata.loads
    assert (load.remote_block_ids, load.local_block_ids) == (params.remote_block_ids, c.block_table)
    assert (load.remote_group_block_ids, load.local_group_block_ids) == (
        params.remote_group_block_ids, [table[1:3]])
    consumer.update_from_kv_connector_output(KVConnectorOutput(finished_recving={"c"}))
    assert c.num_computed_tokens == 10 and c.group_block_tables[0] == table
    consumer.finish(c, FinishReason.ABORT)
    producer.update_from_kv_connector_output(KVConnectorOutput(finished_sending={"p"}))
    for sched in (producer, consumer):
        assert sched.block_manager.num_used_blocks == 0
        sched.block_manager.check_invariants()
    # a consumer with one group refuses a hybrid producer's params in one line
    error = make_scheduler("consumer").connector.check_request(
        remote, num_prompt_tokens=10, n=1)
    assert "KV cache group" in error and "\n" not in error


def test_check_request_refuses_mismatched_params():
    connector = KVConnectorScheduler("consumer", block_size=BS)
    ok = KVTransferParams(do_remote_prefill=True, remote_host="h", remote_port=1,
                          remote_block_ids=[1, 2], remote_num_tokens=5, first_token_id=3)
    assert connector.check_request(ok, num_prompt_tokens=5, n=1) is None
    assert "same prompt" in connector.check_request(ok, num_prompt_tokens=6, n=1)
    assert "n=1" in connector.check_request(ok, num_prompt_tokens=5, n=2)
    assert "producer" in connector.check_request(KVTransferParams(do_remote_decode=True),
                                                 num_prompt_tokens=5, n=1)
    for host in ("10.0.0.7", "::1", "node-3.cluster.local"):
        params = msgspec.structs.replace(ok, remote_host=host)
        assert connector.check_request(params, num_prompt_tokens=5, n=1) is None, host
    for bad, named in ((dict(remote_host="not a host!!"), "neither an IP address nor a hostname"),
                       (dict(remote_host="-x.org"), "neither"), (dict(remote_host="a" * 254), "neither"),
                       (dict(remote_port=0), "not a TCP port"), (dict(remote_port=70000), "not a TCP")):
        params = msgspec.structs.replace(ok, **bad)
        assert named in connector.check_request(params, num_prompt_tokens=5, n=1), bad


def test_transfer_endpoint_brackets_ipv6():
    assert transfer_endpoint("::1", 5) == "tcp://[::1]:5"
    assert transfer_endpoint("10.0.0.7", 5) == "tcp://10.0.0.7:5"
    assert transfer_endpoint("h", 65535) == "tcp://h:65535"


# ----- the TCP transport, two real connectors -----

# per-layer shapes differ: two K/V layers and a latent one (an MLA layer's cache)
LAYERS = (KVCacheSpec(num_kv_heads=2, head_dim=8), KVCacheSpec(num_kv_heads=2, head_dim=8),
          KVCacheSpec(num_kv_heads=1, head_dim=12, latent=True))
LAYOUT = KVLayout(architecture="TinyForCausalLM", dtype="float32", block_size=BS, layers=LAYERS)


def caches(layout: KVLayout, num_blocks: int, *, seed: int | None) -> list[torch.Tensor]:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[layout.dtype]
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shapes = [spec.shape(num_blocks, layout.block_size) for spec in layout.layers]
    return [torch.randn(shape, generator=gen).to(dtype) if gen else torch.zeros(shape, dtype=dtype)
            for shape in shapes]


def wait_output(connector: TCPKVConnector, done, timeout_s: float = 20.0):
    """get_finished() until ``done(output)``; the outputs seen, merged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = connector.get_finished()
        if done(out):
            return out
        connector.wait(0.05)
    raise AssertionError("the connector reported nothing in time")


def load(request_id: str, port: int, remote: list[int], local: list[int]) -> LoadSpec:
    params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                              remote_request_id="p-" + request_id, remote_block_ids=remote,
                              remote_num_tokens=len(remote) * BS, first_token_id=1)
    return LoadSpec(request_id, params, remote, local)


@pytest.fixture
def producer():
    conn = TCPKVConnector("producer", caches(LAYOUT, 8, seed=0), LAYOUT, keep_timeout_s=30.0)
    yield conn
    conn.close()


def test_pull_copies_every_layer_and_confirms(producer):
    consumer = TCPKVConnector("consumer", caches(LAYOUT, 8, seed=None), LAYOUT)
    try:
        producer.start_load_kv(KVConnectorMetadata(keeps=[KeepSpec("p-c", [5, 1, 6])]))
        assert producer.num_kept_blocks() == 3
        consumer.start_load_kv(KVConnectorMetadata(loads=[load("c", producer.port, [1, 6], [0, 3])]))
        out = wait_output(consumer, lambda o: o.finished_recving or o.failed_recving)
        assert out.finished_recving == {"c"} and not out.failed_recving
        for mine, theirs in zip(consumer.kv_caches, producer.kv_caches):
            assert torch.equal(mine[:, [0, 3]], theirs[:, [1, 6]])
            assert not mine[:, [1, 2, 4, 5, 6, 7]].any()  # nothing else written
        sent = wait_output(producer, lambda o: o.finished_sending)
        assert sent.finished_sending == {"p-c"} and producer.num_kept_blocks() == 0
        # blocks x tokens x (two layers of K, V x heads x dim + one latent of 12) x 4 bytes
        nbytes = 2 * BS * (2 * (2 * 2 * 8) + 12) * 4
        assert consumer.stats["kv_transfer_bytes"] == nbytes == producer.stats["kv_transfer_bytes"]
        assert consumer.stats["kv_transfers"] == 1 == producer.stats["kv_transfers"]
    finally:
        consumer.close()


@pytest.mark.parametrize("theirs, named", [
    (dict(dtype="bfloat16"), ("dtype=float32", "dtype=bfloat16")),
    (dict(architecture="LlamaForCausalLM", layers=(KVCacheSpec(num_kv_heads=2, head_dim=8),) * 3),
     ("layers 0-1: K+V 2 heads x 8; layer 2: latent 12", "layers 0-2: K+V 2 heads x 8")),
    # gpt-oss's windowed layers: the same bytes per token, a different attention
    (dict(layers=(KVCacheSpec(num_kv_heads=2, head_dim=8, sliding_window=128),) + LAYERS[1:]),
     ("layers 0-1: K+V 2 heads x 8;", "layer 0: K+V 2 heads x 8, window 128; layer 1: K+V")),
], ids=["dtype", "per-layer shapes", "sliding window"])
def test_layout_mismatch_is_refused_naming_both_layouts(producer, theirs, named):
    layout = msgspec.structs.replace(LAYOUT, **theirs)
    consumer = TCPKVConnector("consumer", caches(layout, 8, seed=None), layout)
    try:
        producer.start_load_kv(KVConnectorMetadata(keeps=[KeepSpec("p-c", [1])]))
        consumer.start_load_kv(KVConnectorMetadata(loads=[load("c", producer.port, [1], [0])]))
        out = wait_output(consumer, lambda o: o.failed_recving)
        error = out.failed_recving["c"]
        assert "KV layout mismatch" in error
        assert all(part in error for part in named), error
        assert not any(c.any() for c in consumer.kv_caches)
    finally:
        consumer.close()


def test_unknown_request_and_dead_producer_fail_the_pull(producer):
    consumer = TCPKVConnector("consumer", caches(LAYOUT, 8, seed=None), LAYOUT, pull_timeout_s=1.0)
    try:
        consumer.start_load_kv(KVConnectorMetadata(loads=[load("x", producer.port, [1], [0])]))
        out = wait_output(consumer, lambda o: o.failed_recving)
        assert "holds no KV" in out.failed_recving["x"]
        port = producer.port
        producer.close()
        consumer.start_load_kv(KVConnectorMetadata(loads=[load("y", port, [1], [0])]))
        out = wait_output(consumer, lambda o: o.failed_recving)
        assert "no reply from the producer" in out.failed_recving["y"]
        assert consumer.stats["kv_transfer_timeouts"] == 1
    finally:
        consumer.close()


def test_a_pull_the_thread_cannot_connect_fails_alone_and_the_next_one_runs(producer):
    """A load whose address ZMQ refuses (admission checks it; this is the transport's own
    guard) fails that request; the transport thread goes on (it died with the ZMQError, and
    every later pull of the engine waited forever)."""
    consumer = TCPKVConnector("consumer", caches(LAYOUT, 8, seed=None), LAYOUT)
    try:
        good = load("bad", producer.port, [1], [0])
        bad = LoadSpec("bad", msgspec.structs.replace(good.params, remote_host="not a host!!"),
                       [1], [0])
        consumer.start_load_kv(KVConnectorMetadata(loads=[bad]))
        out = wait_output(consumer, lambda o: o.failed_recving)
        assert "cannot connect to the producer at not a host!!" in out.failed_recving["bad"]
        producer.start_load_kv(KVConnectorMetadata(keeps=[KeepSpec("p-c", [1])]))
        consumer.start_load_kv(KVConnectorMetadata(loads=[load("c", producer.port, [1], [0])]))
        out = wait_output(consumer, lambda o: o.finished_recving or o.failed_recving)
        assert out.finished_recving == {"c"}, out
    finally:
        consumer.close()


def test_producer_frees_unpulled_blocks_after_the_keep_timeout():
    conn = TCPKVConnector("producer", caches(LAYOUT, 4, seed=0), LAYOUT, keep_timeout_s=0.2)
    try:
        conn.start_load_kv(KVConnectorMetadata(keeps=[KeepSpec("p", [0, 2])]))
        out = wait_output(conn, lambda o: o.finished_sending)
        assert out.finished_sending == {"p"} and conn.stats["kv_transfer_timeouts"] == 1
        assert conn.num_kept_blocks() == 0
    finally:
        conn.close()


def test_cancelled_pull_reports_nothing_and_releases_the_producer(producer):
    consumer = TCPKVConnector("consumer", caches(LAYOUT, 8, seed=None), LAYOUT)
    try:
        producer.start_load_kv(KVConnectorMetadata(keeps=[KeepSpec("p-c", [1, 2])]))
        consumer.start_load_kv(KVConnectorMetadata(loads=[load("c", producer.port, [1, 2], [0, 1])],
                                                   cancels=["c"]))
        sent = wait_output(producer, lambda o: o.finished_sending)
        assert sent.finished_sending == {"p-c"}
        out = consumer.get_finished()
        assert not out.finished_recving and not out.failed_recving
        assert not any(c.any() for c in consumer.kv_caches)
    finally:
        consumer.close()


def test_models_without_groups_keep_their_wire_bytes():
    """The KV cache groups' fields are left off the wire when empty: a model without sliding
    layers sends the bytes it always sent."""
    from atom.worker.tcp_kv_connector import Pull, _encoder

    assert _encoder.encode(Pull("r", [1, 2])) == msgspec.msgpack.encode(
        {"type": "pull", "request_id": "r", "block_ids": [1, 2]})
    params = KVTransferParams(do_remote_prefill=True, remote_block_ids=[3], remote_num_tokens=4)
    assert b"remote_group_block_ids" not in msgspec.json.encode(params)
    assert b"remote_group_block_ids" not in msgspec.msgpack.encode(params)
