"""KV events: vLLM 0.32's wire byte for byte (the fixtures), legacy decoding, the publisher's
frames, replay protocol and drop policy, over real ZMQ sockets on loopback (OS-chosen ports)."""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time

import msgspec
import pytest
import zmq

from atom.config import EngineConfig
from atom.kv_events import (END_SEQ_BYTES, MEDIUM_GPU, AllBlocksCleared, BlockRemoved,
                            BlockStored, KVEventBatch, KVEventDecodeError, KVEventPublisher,
                            KVEventsConfig, decode_batch, from_wire_hash, offset_endpoint,
                            removed_event, stored_event, to_wire_hash)

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "kv_events"
LOOPBACK = "tcp://127.0.0.1:0"
DEADLINE_S = 10.0


def events_config(endpoint: str = LOOPBACK, replay_endpoint: str | None = None,
                  **settings) -> KVEventsConfig:
    """Publisher settings as an engine builds them, from EngineConfig's ``kv_events_*`` fields
    (``topic=...``, ``buffer_size=...``: the field names without the prefix)."""
    return EngineConfig(kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay_endpoint,
                        **{f"kv_events_{k}": v for k, v in settings.items()}).resolved_kv_events()


def wait_until(condition, *, poll=None, timeout_s: float = DEADLINE_S) -> None:
    """Call ``poll(seconds)`` (or wait briefly) until ``condition()`` holds; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        if poll is not None:
            poll(0.02)
        else:
            threading.Event().wait(0.002)


def wait_sent(pub: KVEventPublisher, num_batches: int) -> None:
    wait_until(lambda: pub.stats()["num_published_batches"] >= num_batches)


def stored(hashes, parent=None, *, session_id=None, medium=MEDIUM_GPU, block_size=16):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(range(block_size * len(hashes))), block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None, session_id=session_id)


# ----- the wire: fixtures encoded by vLLM 0.32 -----

README_BATCHES = {
    "stored_two_blocks": KVEventBatch(1764567890.25, [stored([1234567890123, -42])], 0),
    "stored_with_parent_and_removed": KVEventBatch(1764567891.5, [
        BlockStored(block_hashes=[7], parent_block_hash=1234567890123,
                    token_ids=list(range(100, 116)), block_size=16, lora_id=None, medium="CPU",
                    lora_name=None, session_id="conv-9"),
        BlockRemoved(block_hashes=[1234567890123, -42], medium="GPU")], 1),
    "cleared": KVEventBatch(1764567892.0, [AllBlocksCleared()], 3),
    "bytes_hash_no_rank": KVEventBatch(1.0, [
        BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32,
                    token_ids=[5] * 16, block_size=16, lora_id=None, medium=None,
                    lora_name=None)]),
}


@pytest.mark.parametrize("name", sorted(README_BATCHES))
def test_fixture_decodes_and_both_encodings_reproduce_its_bytes(name):
    payload = (FIXTURES / f"{name}.msgpack").read_bytes()
    assert len(payload) == json.loads((FIXTURES / "README.fixtures.json").read_text())[name]["len"]
    batch, num_unreadable = decode_batch(payload)
    assert num_unreadable == 0
    assert batch == README_BATCHES[name]
    encoder = msgspec.msgpack.Encoder()
    assert encoder.encode(batch) == payload
    assert encoder.encode(README_BATCHES[name]) == payload


def test_fixture_set_is_complete():
    assert {p.stem for p in FIXTURES.glob("*.msgpack")} == set(README_BATCHES)


def test_wire_hash_is_the_signed_int64_with_the_same_bits():
    for unsigned, signed in [(0, 0), (42, 42), (2**63 - 1, 2**63 - 1), (2**63, -2**63),
                             (2**64 - 1, -1), (0xDEADBEEFCAFEF00D, 0xDEADBEEFCAFEF00D - 2**64)]:
        assert to_wire_hash(unsigned) == signed
        assert from_wire_hash(signed) == unsigned
    event = stored_event([2**64 - 1, 5], 2**63, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert event.block_hashes == [-1, 5] and event.parent_block_hash == -2**63
    assert (event.medium, event.lora_id, event.lora_name) == ("GPU", None, None)
    assert removed_event([2**64 - 2]) == BlockRemoved(block_hashes=[-2], medium="GPU")
    # on the wire the hash is a msgpack int64 (0xd3), which i64 consumers accept
    payload = msgspec.msgpack.encode(KVEventBatch(1.0, [removed_event([2**63 + 1])], 0))
    assert b"\xd3" + (2**63 + 1).to_bytes(8, "big") in payload
    assert msgspec.msgpack.decode(payload)[1][0]["block_hashes"] == [-(2**63) + 1]


# ----- decoding: legacy arrays, unknown events, garbage -----

def test_legacy_array_shaped_events_decode():
    tokens = list(range(32))
    payload = msgspec.msgpack.encode([2.5, [
        ["BlockStored", [11, -12], None, tokens, 16, None, "GPU", None],
        ["BlockStored", [13], -12, tokens[:16], 16, None],  # oldest shape: no medium, lora_name
        ["BlockRemoved", [11], "GPU"],
        ["AllBlocksCleared"],
    ], 2])
    batch, num_unreadable = decode_batch(payload)
    assert num_unreadable == 0
    assert batch == KVEventBatch(2.5, [
        stored([11, -12]),
        BlockStored(block_hashes=[13], parent_block_hash=-12, token_ids=tokens[:16],
                    block_size=16, lora_id=None, medium=None, lora_name=None),
        BlockRemoved(block_hashes=[11], medium="GPU"), AllBlocksCleared()], 2)
    # the oldest batches had no rank either
    assert decode_batch(msgspec.msgpack.encode([3, [["AllBlocksCleared"]]]))[0] == \
        KVEventBatch(3.0, [AllBlocksCleared()])


def test_unknown_and_misshapen_events_are_counted_not_dropped_silently():
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    payload = msgspec.msgpack.encode([1.0, [
        good, {"type": "BlockAccessed", "block_hashes": [1]},  # a type we do not know
        {"type": "BlockRemoved", "block_hashes": "nope", "medium": "GPU"},  # wrong field type
        ["BlockStored", [1]],  # legacy array, too short
        ["BlockRemoved", [1], "GPU", None, None, None, "extra"],  # legacy array, too long
        7,
    ], 0])
    batch, num_unreadable = decode_batch(payload)
    assert batch.events == [BlockRemoved(block_hashes=[1], medium="GPU")]
    assert num_unreadable == 5


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0]),
                                     msgspec.msgpack.encode(["x", []]),
                                     msgspec.msgpack.encode([1.0, [], "rank"])])
def test_garbage_payloads_raise_decode_error(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


# ----- endpoints and config -----

def test_offset_endpoint():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint("tcp://[::1]:5557", 2) == "tcp://[::1]:5559"
    assert offset_endpoint("tcp://127.0.0.1:0", 5) == "tcp://127.0.0.1:*"
    assert offset_endpoint("tcp://127.0.0.1:*", 5) == "tcp://127.0.0.1:*"
    assert offset_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    for bad in ["udp://x:1", "tcp://127.0.0.1", "tcp://127.0.0.1:http", "127.0.0.1:5557"]:
        with pytest.raises(ValueError):
            offset_endpoint(bad, 1)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="kv_events_buffer_size"):
        events_config(buffer_size=0)
    with pytest.raises(ValueError, match="needs a port"):
        events_config(replay_endpoint="tcp://127.0.0.1")
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint=LOOPBACK)


def test_engine_config_is_the_one_home_of_the_settings():
    assert EngineConfig().resolved_kv_events() is None  # off by default
    config = EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557").resolved_kv_events()
    assert (config.endpoint, config.replay_endpoint, config.topic, config.buffer_size,
            config.max_queue_size, config.hwm) == ("tcp://127.0.0.1:5557", None, "", 10_000,
                                                    10_000, 100_000)
    # cache_aware routing over DP ranks needs the events: private loopback, OS-chosen ports
    private = EngineConfig(data_parallel_size=2, dp_load_balance="cache_aware").resolved_kv_events()
    assert private.endpoint == private.replay_endpoint == "tcp://127.0.0.1:0"
    assert EngineConfig(dp_load_balance="cache_aware").resolved_kv_events() is None  # one rank


def test_tcp_port_is_offset_by_dp_rank():
    with socket.socket() as probe:  # a free port (closed at once, unlike a ZMQ socket)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # rank 2 of base port - 2 binds it
    with KVEventPublisher(events_config(f"tcp://127.0.0.1:{port - 2}"), dp_rank=2) as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        assert pub.replay_endpoint is None


def test_ipc_endpoints_get_a_rank_suffix(tmp_path):
    config = events_config(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    with KVEventPublisher(config, dp_rank=1) as pub:
        assert pub.endpoint == f"ipc://{tmp_path}/pub_dp1"
        assert pub.replay_endpoint == f"ipc://{tmp_path}/replay_dp1"
        dealer = _dealer(pub.replay_endpoint)
        pub.publish([AllBlocksCleared()], ts=1.0)
        wait_sent(pub, 1)
        assert [seq for seq, _ in _replay(dealer, 0)] == [0]
        dealer.close(linger=0)


# ----- the publisher: PUB frames -----

def _publisher(*, dp_rank: int = 0, **config) -> KVEventPublisher:
    """A publisher on OS-chosen loopback ports, with replay."""
    return KVEventPublisher(events_config(LOOPBACK, LOOPBACK, **config), dp_rank=dp_rank)


def test_pub_frames_are_topic_seq_payload_with_gap_free_seqs_and_the_rank():
    with KVEventPublisher(events_config(topic="kv"), dp_rank=1) as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        received: list[list[bytes]] = []

        def probe(timeout_s):  # PUB drops until the subscription arrives: publish until one lands
            pub.publish([removed_event([len(received)])])
            if sub.poll(timeout_s * 1000):
                received.append(sub.recv_multipart())

        wait_until(lambda: received, poll=probe)
        for i in range(5):
            pub.publish([removed_event([100 + i])], ts=float(i))
        while len(received) < 6:
            assert sub.poll(DEADLINE_S * 1000), "batch not received"
            received.append(sub.recv_multipart())
        assert all(len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
                   for frames in received)
        seqs = [int.from_bytes(frames[1], "big") for frames in received]
        assert seqs == list(range(seqs[0], seqs[0] + 6))
        batches = [decode_batch(frames[2])[0] for frames in received[1:]]
        assert [b.ts for b in batches] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert all(b.data_parallel_rank == 1 for b in batches)
        assert batches[0].events == [BlockRemoved(block_hashes=[100], medium="GPU")]
        sub.close(linger=0)


def test_empty_event_lists_are_not_published():
    with _publisher() as pub:
        pub.publish([])
        pub.publish([AllBlocksCleared()], ts=7.0)
        wait_sent(pub, 1)
        pub.publish([])
        dealer = _dealer(pub.replay_endpoint)
        assert [seq for seq, _ in _replay(dealer, 0)] == [0]
        assert pub.stats()["num_published_batches"] == 1
        dealer.close(linger=0)


# ----- the replay protocol -----

def _dealer(endpoint: str) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    return dealer


def _replay(dealer: zmq.Socket, start: int, *, topic: bytes = b"") -> list[tuple[int, bytes]]:
    """Send one replay request; return the (seq, payload) answers before the end marker."""
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    answers = []
    while True:
        assert dealer.poll(DEADLINE_S * 1000), "no replay answer"
        frames = dealer.recv_multipart()
        assert len(frames) == 4 and frames[0] == b""
        if frames[2] == END_SEQ_BYTES:
            assert frames[1] == b"" and frames[3] == b""
            return answers
        assert frames[1] == topic
        answers.append((int.from_bytes(frames[2], "big"), frames[3]))


def test_replay_answers_every_buffered_batch_from_start_then_the_end_marker():
    with _publisher(topic="t") as pub:
        for i in range(5):
            pub.publish([removed_event([i])], ts=float(i))
        wait_sent(pub, 5)
        dealer = _dealer(pub.replay_endpoint)
        answers = _replay(dealer, 2, topic=b"t")
        assert [seq for seq, _ in answers] == [2, 3, 4]
        assert [decode_batch(p)[0].ts for _, p in answers] == [2.0, 3.0, 4.0]
        assert _replay(dealer, 0, topic=b"t")[0][0] == 0
        assert _replay(dealer, 99, topic=b"t") == []  # nothing that new: only the end marker
        assert pub.stats()["num_replay_requests"] == 3
        assert pub.stats()["num_replayed_batches"] == 8
        dealer.close(linger=0)


def test_malformed_replay_requests_are_ignored():
    with _publisher() as pub:
        pub.publish([AllBlocksCleared()], ts=1.0)
        wait_sent(pub, 1)
        dealer = _dealer(pub.replay_endpoint)
        dealer.send_multipart((b"", b"\x00\x01"))  # seq not 8 bytes
        dealer.send_multipart((b"", (0).to_bytes(8, "big"), b"extra"))  # 4 frames at the ROUTER
        dealer.send_multipart((b"x", (0).to_bytes(8, "big")))  # no empty delimiter
        # the next valid request is answered first: nothing came back for the three above
        assert [seq for seq, _ in _replay(dealer, 0)] == [0]
        assert pub.stats()["num_invalid_replay_requests"] == 3
        assert pub.stats()["num_replay_requests"] == 1
        dealer.close(linger=0)


def test_a_req_socket_request_is_answered():
    with _publisher() as pub:
        pub.publish([AllBlocksCleared()], ts=1.0)
        wait_sent(pub, 1)
        req = zmq.Context.instance().socket(zmq.REQ)
        req.connect(pub.replay_endpoint)
        req.send((0).to_bytes(8, "big"))
        assert req.poll(DEADLINE_S * 1000)
        topic, seq, payload = req.recv_multipart()  # a REQ takes the first answer only
        assert (topic, int.from_bytes(seq, "big")) == (b"", 0)
        assert decode_batch(payload)[0] == KVEventBatch(1.0, [AllBlocksCleared()], 0)
        req.close(linger=0)


def test_replay_buffer_keeps_the_newest_buffer_size_batches():
    with _publisher(buffer_size=3) as pub:
        for i in range(5):
            pub.publish([removed_event([i])], ts=float(i))
        wait_sent(pub, 5)
        dealer = _dealer(pub.replay_endpoint)
        assert [seq for seq, _ in _replay(dealer, 0)] == [2, 3, 4]
        assert pub.stats()["num_buffered_batches"] == 3
        dealer.close(linger=0)


def test_replays_longer_than_zmq_default_hwm_arrive_whole_each_time():
    # ZMQ's default HWM is 1,000 messages and reads are acknowledged in steps: a bounded ROUTER
    # would cut the second long replay short
    with _publisher(buffer_size=3000) as pub:
        for i in range(2500):
            pub.publish([removed_event([i])], ts=float(i))
        wait_sent(pub, 2500)
        dealer = _dealer(pub.replay_endpoint)
        for _ in range(3):
            assert [seq for seq, _ in _replay(dealer, 0)] == list(range(2500))
        dealer.close(linger=0)


# ----- the drop policy: publish never waits for the thread -----

class StalledPublisher(KVEventPublisher):
    """Its thread blocks in the first send until ``release`` is set."""

    def __init__(self, *args, **kwargs):
        self.in_send = threading.Event()
        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def _send(self, batch):
        self.in_send.set()
        assert self.release.wait(DEADLINE_S), "test never released the publisher thread"
        super()._send(batch)


def test_full_queue_drops_the_oldest_batches_and_counts_them():
    config = events_config(LOOPBACK, LOOPBACK, max_queue_size=4)
    pub = StalledPublisher(config, dp_rank=0)
    try:
        pub.publish([removed_event([0])], ts=0.0)
        assert pub.in_send.wait(DEADLINE_S)  # the thread holds batch 0 and is stuck
        for i in range(1, 11):  # 10 more while stuck: returns at once, keeps the newest 4
            pub.publish([removed_event([i])], ts=float(i))
        stats = pub.stats()
        assert stats["num_dropped_batches"] == 6 and stats["num_queued_batches"] == 4
        assert stats["num_published_batches"] == 0
        pub.release.set()
        wait_sent(pub, 5)
        dealer = _dealer(pub.replay_endpoint)
        answers = _replay(dealer, 0)
        # seqs stay gap-free; the batches that went out are the first and the newest four
        assert [seq for seq, _ in answers] == [0, 1, 2, 3, 4]
        assert [decode_batch(p)[0].ts for _, p in answers] == [0.0, 7.0, 8.0, 9.0, 10.0]
        dealer.close(linger=0)
    finally:
        pub.release.set()
        pub.close()


def test_close_sends_what_is_queued_and_publish_after_close_raises():
    pub = _publisher()
    for i in range(3):
        pub.publish([removed_event([i])])
    pub.close()
    assert pub.stats()["num_published_batches"] == 3 and pub.stats()["num_queued_batches"] == 0
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        pub.publish([AllBlocksCleared()])
