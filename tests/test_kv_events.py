"""KV events: vLLM 0.32's wire byte for byte (the fixtures) and legacy decoding."""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest

from atom.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored,
                            KVEventBatch, KVEventDecodeError, decode_batch, from_wire_hash,
                            removed_event, stored_event, to_wire_hash)

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "kv_events"


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
