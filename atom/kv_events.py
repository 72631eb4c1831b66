"""KV cache events on vLLM 0.32's wire: the event and batch structs and their decoder.

Payload (one ZMQ message = one batch), msgpack encoded by msgspec:

- ``KVEventBatch``: an *array* ``[ts, events]`` or ``[ts, events, data_parallel_rank]``
  (``array_like``, ``omit_defaults``); ``ts`` in seconds since the epoch.
- events: *maps* tagged by class name under ``"type"``, defaulted fields left out. Required
  (always on the wire, even when None): ``BlockStored``'s block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name; ``BlockRemoved``'s block_hashes, medium.
  The optional fields are omitted when None. ``AllBlocksCleared`` has no fields.
- Before vLLM #42892 events were positional *arrays* with the tag first
  (``["BlockStored", block_hashes, parent_block_hash, ...]``); :func:`decode_batch` reads both.

Block hashes: the block manager's hashes are unsigned 64-bit xxhash ints; on the wire they are
the signed int64 with the same bits (:func:`to_wire_hash`, the one place that converts): the
contract calls the signed 64-bit range safe for consumers, and some typed consumers read only
i64. Hashes from other engines may be bytes.

Medium: atom's KV pool is the engine's primary KV tier, so it reports ``"GPU"`` even on CPU.
vLLM does the same: its block pool always emits ``MEDIUM_GPU``, on every platform including the
CPU build; ``"CPU"`` and ``"STORAGE"`` name offload tiers (KV connectors).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the engine's primary KV pool (vLLM uses it on every platform)
MEDIUM_CPU = "CPU"  # a CPU offload tier
MEDIUM_STORAGE = "STORAGE"

_UINT64_MASK = (1 << 64) - 1
_INT64_MIN = 1 << 63

BlockHash = int | bytes  # a wire block hash: a signed 64-bit int (ours) or bytes (other engines)


# ----- wire types (vLLM 0.32's field names, order, defaults and struct options) -----

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``[ts, events(, data_parallel_rank)]``."""

    ts: float  # seconds since the epoch
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events: a map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    """Full blocks became reusable prefix-cache entries.

    ``token_ids`` holds the tokens of all the blocks, in order (``block_size`` each);
    ``parent_block_hash`` is the hash of the block before the first one (None: the first block
    of a sequence).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM (lora_name replaces it), kept on the wire
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Prefix-cache entries were evicted."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped."""


class KVEventBatch(EventBatch):
    """A batch of KV cache events (what the publisher sends and :func:`decode_batch` returns)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ----- hashes and event constructors (the block manager's side) -----

def to_wire_hash(block_hash: int) -> int:
    """The wire form of one block-manager hash: the unsigned 64-bit int ``block_hash`` read as a
    signed int64 with the same bits (values >= 2**63 become negative)."""
    return block_hash - (1 << 64) if block_hash >= _INT64_MIN else block_hash


def from_wire_hash(wire_hash: int) -> int:
    """Inverse of :func:`to_wire_hash`: the unsigned 64-bit value of a signed wire hash."""
    return wire_hash & _UINT64_MASK


def stored_event(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                 block_size: int) -> BlockStored:
    """A ``BlockStored`` of atom's KV pool from block-manager (unsigned) hashes."""
    return BlockStored(
        block_hashes=[to_wire_hash(h) for h in block_hashes],
        parent_block_hash=None if parent_block_hash is None else to_wire_hash(parent_block_hash),
        token_ids=token_ids, block_size=block_size, lora_id=None, medium=MEDIUM_GPU,
        lora_name=None)


def removed_event(block_hashes: list[int]) -> BlockRemoved:
    """A ``BlockRemoved`` of atom's KV pool from block-manager (unsigned) hashes."""
    return BlockRemoved(block_hashes=[to_wire_hash(h) for h in block_hashes], medium=MEDIUM_GPU)


# ----- decoding (current and legacy shapes) -----

class KVEventDecodeError(ValueError):
    """A payload is not a KV event batch in either the current or the legacy shape."""


_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
_AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared
# fields vLLM added after the first array-shaped releases; absent in the oldest payloads
_LATE_REQUIRED_FIELDS = ("lora_id", "medium", "lora_name")
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_any_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode one payload into ``(batch, num_unreadable_events)``.

    The current shape decodes in one typed pass. Otherwise the payload is read generically and
    each event on its own, as a tagged map or as a legacy tagged array; events of an unknown
    type or a wrong shape are left out of the batch and counted in ``num_unreadable_events``.

    Raises:
        KVEventDecodeError: not msgpack, or the batch envelope is not ``[ts, events(, rank)]``.
    """
    try:
        return _batch_decoder.decode(payload), 0
    except msgspec.ValidationError:
        pass  # a legacy or partly unknown batch: read it event by event below
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    raw = _any_decoder.decode(payload)
    if (not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list)
            or not isinstance(raw[0], (int, float)) or isinstance(raw[0], bool)):
        raise KVEventDecodeError(f"not a batch [ts, events(, data_parallel_rank)]: {raw!r:.80}")
    rank = raw[2] if len(raw) == 3 else None
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise KVEventDecodeError(f"data_parallel_rank is not an int: {rank!r:.40}")
    events = [_convert_event(e) for e in raw[1]]
    readable = [e for e in events if e is not None]
    return KVEventBatch(float(raw[0]), readable, rank), len(events) - len(readable)


def _convert_event(raw: Any) -> KVCacheEvent | None:
    """One generically decoded event (tagged map, or legacy tagged array) as our struct; None
    when it has an unknown type or a wrong shape."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _EVENT_TYPES:
        fields = _EVENT_TYPES[raw[0]].__struct_fields__
        if len(raw) - 1 > len(fields):
            return None
        mapping = dict(zip(fields, raw[1:]))
        for name in _LATE_REQUIRED_FIELDS:
            if name in fields:
                mapping.setdefault(name, None)
        raw = {"type": raw[0], **mapping}
    if not isinstance(raw, dict):
        return None
    try:
        return msgspec.convert(raw, _AnyEvent, strict=True)
    except msgspec.ValidationError:
        return None
