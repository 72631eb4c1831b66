"""KV cache events on vLLM 0.32's wire, and the per-rank publisher with replay.

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

Transport (:class:`KVEventPublisher`, one per DP rank):

- PUB socket, three frames per batch: ``topic``, ``seq`` (8 bytes big-endian), ``payload``.
  ``seq`` starts at 0 and goes up by one per batch sent, with no gaps (assigned when the
  background thread sends the batch).
- ROUTER replay socket (optional): a request is exactly ``(identity, b"", start seq as 8
  big-endian bytes)`` (a REQ sending one frame, or a DEALER sending ``b""`` then the seq);
  anything else is ignored (counted, logged). The answer, to that identity: ``(b"", topic, seq,
  payload)`` for every buffered batch with ``seq >= start``, then the end marker ``(b"", b"",
  seq = -1 as 8 signed big-endian bytes, b"")``.
- Endpoints: the TCP port is offset by the DP rank (port 0 or ``*``: the OS chooses, no
  offset); ``ipc://`` and ``inproc://`` names get a ``_dp{rank}`` suffix for ranks > 0 (vLLM's
  rule for inproc). The publisher always binds (vLLM connects when the host is not a
  wildcard); the endpoint's host decides the interface (an engine binds only what
  ``--kv-events-endpoint`` names, or loopback when cache_aware routing turns events on itself).
- The ROUTER has no send high-water mark, so a replay is never cut short (a ROUTER drops what
  exceeds its HWM silently); the cost is memory for answers a client requested and does not
  read, at most one buffer's payloads per request.

Drop policy: :meth:`KVEventPublisher.publish` never blocks the engine step. It appends the batch
to a bounded queue read by a background thread; when the queue is full the *oldest* queued
batch is dropped and ``num_dropped_batches`` counts it. A dropped batch never got a seq, so
subscribers cannot see the loss: the publisher's counter is the signal. A slow subscriber is
handled by ZMQ: PUB drops at its high-water mark (never blocks); the subscriber sees the seq gap
and heals it by replay while the batch is still in the replay buffer.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the engine's primary KV pool (vLLM uses it on every platform)
MEDIUM_CPU = "CPU"  # a CPU offload tier
MEDIUM_STORAGE = "STORAGE"

END_SEQ_BYTES = (-1).to_bytes(8, "big", signed=True)  # the replay end marker's seq frame

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


#: ``kv_cache_spec_kind`` of a full-attention and of a sliding-window KV cache group (vLLM's
#: ``KVCacheSpecKind`` values)
SPEC_KIND_FULL = "full_attention"
SPEC_KIND_SLIDING = "sliding_window"


@dataclass(frozen=True)
class GroupFields:
    """How a hybrid model's events name the KV cache group of their blocks (vLLM 0.32's
    ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``). A model with one
    group names none (``None`` instead of this), as before groups existed."""

    group_idx: int
    window: int | None  # the group's sliding window in tokens; None: full attention


def stored_event(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                 block_size: int, group: GroupFields | None = None) -> BlockStored:
    """A ``BlockStored`` of atom's KV pool from block-manager (unsigned) hashes; ``group``:
    the KV cache group of a hybrid model's blocks."""
    return BlockStored(
        block_hashes=[to_wire_hash(h) for h in block_hashes],
        parent_block_hash=None if parent_block_hash is None else to_wire_hash(parent_block_hash),
        token_ids=token_ids, block_size=block_size, lora_id=None, medium=MEDIUM_GPU,
        lora_name=None, group_idx=None if group is None else group.group_idx,
        kv_cache_spec_kind=None if group is None else (
            SPEC_KIND_FULL if group.window is None else SPEC_KIND_SLIDING),
        kv_cache_spec_sliding_window=None if group is None else group.window)


def removed_event(block_hashes: list[int], group: GroupFields | None = None) -> BlockRemoved:
    """A ``BlockRemoved`` of atom's KV pool from block-manager (unsigned) hashes; ``group``:
    the KV cache group of a hybrid model's blocks."""
    return BlockRemoved(block_hashes=[to_wire_hash(h) for h in block_hashes], medium=MEDIUM_GPU,
                        group_idx=None if group is None else group.group_idx)


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


# ----- endpoints -----

def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """``endpoint`` for DP rank ``dp_rank``: TCP port + rank (port 0 or ``*`` unchanged: the OS
    chooses); ``ipc://``/``inproc://`` names get ``_dp{rank}`` for ranks > 0.

    Raises:
        ValueError: another transport, or a TCP endpoint without a port.
    """
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if dp_rank == 0 else f"{endpoint}_dp{dp_rank}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV events endpoint {endpoint!r}: use tcp://host:port, ipc:// or inproc://")
    base, sep, port = endpoint.rpartition(":")
    if not sep or base == "tcp" or not (port == "*" or port.isdigit()):
        raise ValueError(f"KV events endpoint {endpoint!r} needs a port (tcp://host:port; 0 or * "
                         "lets the OS choose)")
    if port in ("*", "0"):
        return f"{base}:*"
    return f"{base}:{int(port) + dp_rank}"


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how one engine publishes KV events (vLLM's ``--kv-events-*`` settings).

    No defaults here: an engine's settings are :class:`atom.config.EngineConfig`'s
    ``kv_events_*`` fields (documented and defaulted there, the CLI generated from them), and
    :meth:`atom.config.EngineConfig.resolved_kv_events` builds this from them.

    Attributes:
        endpoint: PUB endpoint before the per-rank offset (the host picks the interface:
            ``tcp://127.0.0.1:5557`` stays on this host, ``tcp://*:5557`` leaves it).
        replay_endpoint: ROUTER replay endpoint before the offset; None: no replay.
        topic: first frame of every PUB message (subscribers filter on its prefix).
        buffer_size: batches kept for replay.
        max_queue_size: batches waiting for the publisher thread before the oldest is dropped;
            a live thread keeps this near 0, the bound only matters when it stalls.
        hwm: PUB send high-water mark in messages per subscriber.

    Raises:
        ValueError: a malformed endpoint, or a size below 1.
    """

    endpoint: str
    replay_endpoint: str | None
    topic: str | bytes
    buffer_size: int
    max_queue_size: int
    hwm: int

    def __post_init__(self) -> None:
        for name in ("buffer_size", "max_queue_size", "hwm"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_{name}={getattr(self, name)} must be >= 1")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None:
                offset_endpoint(endpoint, 0)  # raises ValueError on a malformed endpoint


def _topic_bytes(topic: str | bytes) -> bytes:
    return topic.encode() if isinstance(topic, str) else bytes(topic)


# ----- the publisher -----

class KVEventPublisher:
    """Publishes one DP rank's KV event batches: PUB frames, a replay buffer, a ROUTER.

    Owns the sockets (bound in the constructor, then used only by its background thread), the
    queue between :meth:`publish` and that thread, the replay buffer and the seq counter.
    Guarantees: :meth:`publish` never blocks on I/O; seqs on the wire are 0, 1, 2, ... with no
    gaps; every batch carries ``data_parallel_rank``.

    Args:
        config: endpoints, topic, sizes.
        dp_rank: this engine's DP rank (offsets the ports, stamps every batch).

    Attributes:
        endpoint: the bound PUB endpoint, port resolved (``tcp://127.0.0.1:41234``).
        replay_endpoint: the bound ROUTER endpoint, or None without replay.

    Raises:
        ValueError: ``dp_rank`` < 0.
        zmq.ZMQError: an endpoint cannot be bound (port in use, bad address).
    """

    def __init__(self, config: KVEventsConfig, *, dp_rank: int = 0) -> None:
        if dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
        self.dp_rank = dp_rank
        self._topic = _topic_bytes(config.topic)
        self._max_queue_size = config.max_queue_size
        self._queue: collections.deque[KVEventBatch] = collections.deque()
        self._replay_buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_size)
        self._lock = threading.Lock()  # guards _queue, _closing and num_dropped_batches
        self._closing = False
        self._next_seq = 0
        self.num_published_batches = 0
        self.num_dropped_batches = 0
        self.num_encode_failures = 0
        self.num_replay_requests = 0
        self.num_invalid_replay_requests = 0
        self.num_replayed_batches = 0
        self._pub, self._replay = self._bind(config, dp_rank)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
        # publish() wakes the thread by writing a byte here (non-blocking): the thread waits on
        # this pipe and the ROUTER together, so it sleeps when idle and wakes at once
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}", daemon=True)
        self._thread.start()
        logger.info("[dp%d] KV events on %s (replay %s)", dp_rank, self.endpoint, self.replay_endpoint)

    @staticmethod
    def _bind(config: KVEventsConfig, dp_rank: int) -> tuple[zmq.Socket, zmq.Socket | None]:
        """The bound PUB socket and ROUTER (None without replay); nothing stays bound on error."""
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            pub.bind(offset_endpoint(config.endpoint, dp_rank))
            if config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                # no send HWM: a ROUTER silently drops what exceeds it (module docstring)
                replay.setsockopt(zmq.SNDHWM, 0)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(offset_endpoint(config.replay_endpoint, dp_rank))
        except zmq.ZMQError:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            raise
        return pub, replay

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> None:
        """Queue one step's events as one batch (nothing when ``events`` is empty, as in vLLM).

        Never blocks on I/O: the background thread encodes and sends. When ``max_queue_size``
        batches are already waiting, the oldest is dropped (``num_dropped_batches``).

        Args:
            events: this step's events; the publisher keeps the list (do not mutate it after).
            ts: batch time in seconds since the epoch (default: now).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if not events:
            return
        batch = KVEventBatch(time.time() if ts is None else float(ts), events, self.dp_rank)
        with self._lock:
            if self._closing:
                raise RuntimeError("KVEventPublisher.publish after close()")
            if len(self._queue) >= self._max_queue_size:
                self._queue.popleft()
                self.num_dropped_batches += 1
            was_empty = not self._queue
            self._queue.append(batch)
        if was_empty:
            self._wake()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the thread (waiting at most ``timeout_s``), close the
        sockets. Idempotent. A thread that does not stop in time is logged and left (daemon)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("[dp%d] KV events thread did not stop within %.1f s", self.dp_rank, timeout_s)
            return
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stats(self) -> dict[str, int]:
        """Counters (batches unless named otherwise)."""
        return {
            "num_published_batches": self.num_published_batches,
            "num_dropped_batches": self.num_dropped_batches,
            "num_queued_batches": len(self._queue),
            "num_buffered_batches": len(self._replay_buffer),
            "num_encode_failures": self.num_encode_failures,
            "num_replay_requests": self.num_replay_requests,
            "num_invalid_replay_requests": self.num_invalid_replay_requests,
            "num_replayed_batches": self.num_replayed_batches,
        }

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the background thread -----

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will wake

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            closing = self._closing  # read before draining: nothing is queued after it is set
            self._send_queued()
            if self._replay is not None and self._replay in ready:
                self._serve_replay_requests()
            if closing:
                return

    def _send_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                batch = self._queue.popleft()
            self._send(batch)

    def _send(self, batch: KVEventBatch) -> None:
        try:
            payload = self._encoder.encode(batch)
        except (msgspec.EncodeError, OverflowError, TypeError) as exc:
            self.num_encode_failures += 1
            logger.error("[dp%d] KV event batch not encodable, dropped: %s", self.dp_rank, exc)
            return
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._replay_buffer.append((seq, payload))
        self.num_published_batches += 1

    def _serve_replay_requests(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.num_invalid_replay_requests += 1
                logger.warning("[dp%d] ignored a KV events replay request of %d frames (%r)",
                               self.dp_rank, len(frames), [f[:16] for f in frames[1:4]])
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.num_replay_requests += 1
            for seq, payload in self._replay_buffer:
                if seq >= start:
                    self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"),
                                                 payload))
                    self.num_replayed_batches += 1
            self._replay.send_multipart((identity, b"", b"", END_SEQ_BYTES, b""))
