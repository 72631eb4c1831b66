"""The TCP transport of the P/D KV connector: the worker side of :mod:`atom.core.kv_connector`.

A consumer **pulls**: the producer binds one ZMQ ROUTER socket (``--kv-transfer-host`` /
``--kv-transfer-port``); each consumer holds one DEALER socket per producer it pulls from.
Every message is a msgspec msgpack frame (never pickle); KV bytes travel as raw frames after it::

    consumer                                   producer
    Handshake(layout)                 ──>      compares with its own layout
                                      <──      HandshakeReply(layout, error)
    Pull(request_id, block_ids)       ──>      reads K and V of those blocks, every layer
                                      <──      PullReply(checksums) + one frame per layer
                                               (layer l: its spec's shape, e.g.
                                               [2, num_blocks, block_size, H_kv, D])
    Release(request_id, completed)    ──>      frees the kept blocks now

A hybrid model's KV cache groups (:func:`atom.kv_cache_spec.kv_cache_groups`; gpt-oss's full
and sliding layers) pull different blocks per group: ``Pull.block_ids`` are group 0's and
``Pull.group_block_ids`` the other groups' (one list each; absent for one group, so its bytes
are those of a model without groups); the layer frames come group by group, each group's
layers in order, a layer's frame holding its own group's blocks (the groups share cache
tensors, block ids never overlap).

The layouts (:class:`~atom.core.kv_connector.KVLayout`: architecture, dtype, block size, and
every layer's :class:`~atom.kv_cache_spec.KVCacheSpec`, hence the KV cache groups) must be
equal, else both sides refuse with a message naming both layouts; every frame
carries an xxhash64 checksum, checked before a byte reaches the KV cache. The consumer confirms
(``Release(completed=True)``) as soon as it holds the bytes, and releases (``completed=False``)
when the request was aborted; a producer frees blocks nobody confirmed after
``kv_transfer_keep_timeout_s`` (a consumer that died), and a consumer fails a pull the producer
does not answer within ``kv_transfer_timeout_s`` (a producer that died).

Threads: each side runs one thread of its own for its socket, so a transfer never waits for a
step. The producer's thread reads the kept blocks from the KV cache (nobody writes a finished
request's blocks); the consumer's thread only receives bytes: they are copied into the KV cache
by :meth:`TCPKVConnector.get_finished` on the engine thread, so an aborted pull frees its
blocks at once without racing a write.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field

import msgspec
import torch
import xxhash
import zmq

from atom.core.kv_connector import (KVConnectorMetadata, KVConnectorOutput, KVLayout, LoadSpec,
                                    transfer_endpoint)
from atom.kv_cache_spec import kv_cache_groups

logger = logging.getLogger(__name__)

_POLL_MS = 100  # socket threads wake this often to check deadlines and shutdown
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Handshake(msgspec.Struct, tag="handshake", frozen=True):
    layout: KVLayout


class HandshakeReply(msgspec.Struct, tag="handshake_reply", frozen=True):
    layout: KVLayout
    error: str | None = None


class Pull(msgspec.Struct, tag="pull", frozen=True, omit_defaults=True):
    """Send the KV of ``block_ids`` (a subset of those kept for ``request_id``, in order;
    ``group_block_ids``: a hybrid model's other KV cache groups', module docstring)."""

    request_id: str
    block_ids: list[int]
    group_block_ids: list[list[int]] = []


class PullReply(msgspec.Struct, tag="pull_reply", frozen=True):
    """The answer to a :class:`Pull`: an error, or one xxhash64 per layer frame that follows."""

    request_id: str
    error: str | None = None
    checksums: list[int] = []


class Release(msgspec.Struct, tag="release", frozen=True):
    """The consumer is done with ``request_id``'s kept blocks (``completed``: it got them)."""

    request_id: str
    completed: bool


def _pull(remote_id: str, spec: LoadSpec) -> Pull:
    return Pull(remote_id, spec.remote_block_ids, spec.remote_group_block_ids)


TransferMessage = Handshake | HandshakeReply | Pull | PullReply | Release
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferMessage)


def layout_mismatch(producer: str, producer_layout: KVLayout, consumer_layout: KVLayout) -> str:
    return (f"KV layout mismatch: the producer at {producer} has {producer_layout.describe()}; "
            f"this consumer has {consumer_layout.describe()}: start both with the same model, "
            f"--dtype and --block-size")


@dataclass
class _Kept:
    block_ids: list[int]  # group 0's
    deadline_s: float
    group_block_ids: list[list[int]] = field(default_factory=list)  # the other groups'

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + sum(map(len, self.group_block_ids))


@dataclass
class _Conn:
    """A consumer's DEALER socket to one producer and its handshake state."""

    endpoint: str
    sock: zmq.Socket
    error: str | None = None
    ready: bool = False
    queued: list[str] = field(default_factory=list)  # remote request ids waiting for the handshake


@dataclass
class _Pending:
    spec: LoadSpec
    conn: _Conn
    start_s: float
    deadline_s: float


class TCPKVConnector:
    """The worker side of the KV connector over TCP (module docstring).

    Args:
        role: ``"producer"`` (binds and serves kept blocks) or ``"consumer"`` (pulls).
        kv_caches: the model runner's KV cache, one ``[2, num_blocks, block_size, H_kv, D]``
            tensor per layer (read by the producer's thread, written on the engine thread).
        layout: this engine's :class:`~atom.core.kv_connector.KVLayout`.
        host, port: producer: where to bind (port 0: OS-chosen; :attr:`port` is the bound one).
        keep_timeout_s: producer: seconds kept blocks wait for a consumer.
        pull_timeout_s: consumer: seconds a pull waits for the producer's reply.

    Raises:
        RuntimeError: the producer cannot bind ``host:port``.
    """

    def __init__(self, role: str, kv_caches: list[torch.Tensor], layout: KVLayout, *,
                 host: str = "127.0.0.1", port: int = 0, keep_timeout_s: float = 60.0,
                 pull_timeout_s: float = 30.0):
        self.role, self.kv_caches, self.layout = role, kv_caches, layout
        # per KV cache group, its layers' cache tensors (the frame order of a pull)
        self._group_caches = [[kv_caches[i] for i in group.layer_ids]
                              for group in kv_cache_groups(layout.layers)]
        self.host, self.port = host, port
        self.keep_timeout_s, self.pull_timeout_s = keep_timeout_s, pull_timeout_s
        self.stats = {"kv_transfers": 0, "kv_transfer_bytes": 0, "kv_transfer_seconds": 0.0,
                      "kv_transfer_failures": 0, "kv_transfer_timeouts": 0}
        self._ctx = zmq.Context()
        self._closed = threading.Event()
        self._event = threading.Event()  # a result is ready (wait())
        self._lock = threading.Lock()  # producer: _kept and _finished_sending
        self._kept: dict[str, _Kept] = {}
        self._finished_sending: set[str] = set()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # consumer thread -> engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # engine thread -> consumer thread
        self._cancelled: set[str] = set()  # engine thread: cancelled, not yet acknowledged
        self._immediate: list[str] = []  # loads with no block to pull (all cached locally)
        if role == "producer":
            sock = self._ctx.socket(zmq.ROUTER)
            sock.linger = 0
            try:
                if port == 0:
                    self.port = sock.bind_to_random_port(f"tcp://{host}")
                else:
                    sock.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                sock.close()
                self._ctx.destroy(linger=0)
                raise RuntimeError(f"cannot bind the KV transfer socket tcp://{host}:{port}: "
                                   f"{exc}: pick another --kv-transfer-port") from exc
            target, args = self._serve, (sock,)
        else:
            self._wake_addr = f"inproc://kv-transfer-wake-{id(self)}"
            self._wake = self._ctx.socket(zmq.PAIR)
            self._wake.bind(self._wake_addr)
            target, args = self._pull_loop, ()
        self._thread = threading.Thread(target=target, args=args, name=f"atom-kv-{role}",
                                        daemon=True)
        self._thread.start()
        logger.info("KV connector (%s) up%s: %s", role,
                    f" on tcp://{host}:{self.port}" if role == "producer" else "",
                    layout.describe())

    # ----- engine thread -----

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Register kept blocks, start pulls, drop cancelled pulls (never blocks)."""
        now = time.monotonic()
        if metadata.keeps:
            with self._lock:
                for keep in metadata.keeps:
                    self._kept[keep.request_id] = _Kept(keep.block_ids, now + self.keep_timeout_s,
                                                        keep.group_block_ids)
        for spec in metadata.loads:
            if not spec.num_blocks:
                self._immediate.append(spec.request_id)
            else:
                self._commands.put(("load", spec, now))
        for request_id in metadata.cancels:
            self._cancelled.add(request_id)
            self._commands.put(("cancel", request_id, now))
        if metadata.loads or metadata.cancels:
            self._wake.send(b"")

    def get_finished(self) -> KVConnectorOutput:
        """Kept requests that may be freed; pulls done (their KV copied into the local blocks
        here, on the engine thread) or failed."""
        out = KVConnectorOutput()
        if self.role == "producer":
            self._expire_kept()
            with self._lock:
                out.finished_sending, self._finished_sending = self._finished_sending, set()
            return out
        out.finished_recving.update(self._immediate)
        self._immediate = []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out
            kind, request_id = item[0], item[1]
            if kind == "cancelled":
                self._cancelled.discard(request_id)
            elif request_id in self._cancelled:
                continue  # aborted: its blocks may already belong to another request
            elif kind == "failed":
                out.failed_recving[request_id] = item[2]
            else:
                self._copy_into_cache(item[2], item[3])
                out.finished_recving.add(request_id)

    def has_pending_output(self) -> bool:
        """:meth:`get_finished` would report something (or a keep deadline passed)."""
        if self.role == "consumer":
            return bool(self._immediate) or not self._done.empty()
        with self._lock:
            if self._finished_sending:
                return True
            now = time.monotonic()
            return any(k.deadline_s <= now for k in self._kept.values())

    def wait(self, timeout_s: float) -> None:
        """Block until a pull finishes or ``timeout_s`` passes."""
        if self._event.wait(timeout_s):
            self._event.clear()

    def num_kept_blocks(self) -> int:
        with self._lock:
            return sum(k.num_blocks for k in self._kept.values())

    def get_stats(self) -> dict[str, int | float]:
        """Transfers, bytes, seconds (pull time, consumer), failures, timeouts; kept blocks."""
        return {**self.stats, "kv_kept_blocks": self.num_kept_blocks()}

    def close(self) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.role == "consumer":
            self._wake.send(b"")
        self._thread.join(5.0)
        self._ctx.destroy(linger=0)

    def _frame_targets(self, group_block_ids: list[list[int]]):
        """(cache tensor, block ids) of each layer frame of a pull, in frame order: group by
        group, each group's layers in order (``group_block_ids``: each group's blocks)."""
        return [(cache, block_ids) for caches, block_ids in zip(self._group_caches, group_block_ids)
                for cache in caches]

    def _copy_into_cache(self, spec: LoadSpec, frames: list) -> None:
        dtype = _DTYPES[self.layout.dtype]
        with warnings.catch_warnings():  # zmq frames are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            targets = self._frame_targets([spec.local_block_ids, *spec.local_group_block_ids])
            for (cache, block_ids), frame in zip(targets, frames):
                if not block_ids:
                    continue
                src = torch.frombuffer(frame, dtype=torch.uint8).view(dtype).view(
                    (cache.shape[0], len(block_ids), *cache.shape[2:]))
                cache.index_copy_(1, torch.tensor(block_ids, dtype=torch.int64), src)

    def _expire_kept(self) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, k in self._kept.items() if k.deadline_s <= now]:
                del self._kept[request_id]
                self._finished_sending.add(request_id)
                self.stats["kv_transfer_timeouts"] += 1
                logger.warning("no consumer pulled request %s's KV within %g s: freeing its "
                               "blocks", request_id, self.keep_timeout_s)

    # ----- producer thread -----

    def _serve(self, sock: zmq.Socket) -> None:
        good_peers: set[bytes] = set()  # identities whose handshake matched
        while not self._closed.is_set():
            if not sock.poll(_POLL_MS):
                continue
            while sock.poll(0):
                identity, payload, *_ = sock.recv_multipart()
                try:
                    message = _decoder.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.error("dropped an unreadable KV transfer message: %s", exc)
                    continue
                self._serve_one(sock, identity, message, good_peers)
        sock.close(linger=0)

    def _serve_one(self, sock: zmq.Socket, identity: bytes, message, good_peers: set[bytes]) -> None:
        if isinstance(message, Handshake):
            error = None
            if message.layout != self.layout:
                error = layout_mismatch(f"tcp://{self.host}:{self.port}", self.layout, message.layout)
                logger.error("refused a consumer: %s", error)
            else:
                good_peers.add(identity)
            sock.send_multipart([identity, _encoder.encode(HandshakeReply(self.layout, error))])
        elif isinstance(message, Pull):
            reply, frames = self._read_blocks(message) if identity in good_peers else (
                PullReply(message.request_id, error="pull before a successful layout handshake"), [])
            sock.send_multipart([identity, _encoder.encode(reply), *frames], copy=False)
        elif isinstance(message, Release):
            with self._lock:
                kept = self._kept.pop(message.request_id, None)
                if kept is not None:
                    self._finished_sending.add(message.request_id)
                    self.stats["kv_transfers"] += message.completed
        else:
            logger.error("unexpected KV transfer message %s", type(message).__name__)

    def _read_blocks(self, pull: Pull) -> tuple[PullReply, list]:
        with self._lock:
            kept = self._kept.get(pull.request_id)
        if kept is None:
            return PullReply(pull.request_id, error=(
                f"the producer holds no KV for request {pull.request_id!r}: its keep timeout "
                f"({self.keep_timeout_s:g} s) passed or it was released")), []
        pulled = [pull.block_ids, *pull.group_block_ids]
        held = [kept.block_ids, *kept.group_block_ids]
        if len(pulled) != len(self._group_caches) or not all(
                set(p) <= set(h) for p, h in zip(pulled, held)):
            one = len(self._group_caches) == 1  # one group: the message it always was
            return PullReply(pull.request_id, error=(
                f"blocks {pull.block_ids if one else pulled} "
                f"{'' if one else '(per KV cache group) '}are not among request "
                f"{pull.request_id!r}'s kept blocks {kept.block_ids if one else held}")), []
        frames = [cache.index_select(1, torch.tensor(block_ids, dtype=torch.int64))
                  .view(torch.uint8).numpy() for cache, block_ids in self._frame_targets(pulled)]
        self.stats["kv_transfer_bytes"] += sum(f.nbytes for f in frames)
        return PullReply(pull.request_id, checksums=[xxhash.xxh64(f).intdigest() for f in frames]), frames

    # ----- consumer thread -----

    def _pull_loop(self) -> None:
        wake = self._ctx.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        conns: dict[str, _Conn] = {}
        pending: dict[str, _Pending] = {}  # by remote request id
        while not self._closed.is_set():
            events = dict(poller.poll(_POLL_MS))
            if wake in events:
                while wake.poll(0):
                    wake.recv()
            self._run_commands(conns, pending, poller)
            for conn in list(conns.values()):
                if conn.sock in events:
                    while conn.sock.poll(0):
                        self._on_reply(conn, conn.sock.recv_multipart(copy=False), pending)
            self._expire_pulls(conns, pending, poller)
        for conn in conns.values():
            conn.sock.close(linger=0)
        wake.close(linger=0)

    def _run_commands(self, conns: dict[str, _Conn], pending: dict[str, _Pending],
                      poller: zmq.Poller) -> None:
        while True:
            try:
                kind, arg, now = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "cancel":
                for remote_id, p in list(pending.items()):
                    if p.spec.request_id == arg:
                        del pending[remote_id]
                        p.conn.sock.send(_encoder.encode(Release(remote_id, completed=False)))
                self._finish(("cancelled", arg))
                continue
            spec: LoadSpec = arg
            try:  # checked at admission too: this thread must outlive any one bad request
                endpoint = transfer_endpoint(spec.params.remote_host, spec.params.remote_port)
                conn = conns.get(endpoint)
                if conn is None:
                    conn = conns[endpoint] = self._connect(endpoint, poller)
            except (ValueError, zmq.ZMQError) as exc:
                self._fail(spec, f"cannot connect to the producer at {spec.params.remote_host}:"
                                 f"{spec.params.remote_port}: {exc}")
                continue
            remote_id = spec.params.remote_request_id
            pending[remote_id] = _Pending(spec, conn, now, now + self.pull_timeout_s)
            if conn.error is not None:
                self._fail(pending.pop(remote_id).spec, conn.error)
            elif conn.ready:
                conn.sock.send(_encoder.encode(_pull(remote_id, spec)))
            else:
                conn.queued.append(remote_id)

    def _connect(self, endpoint: str, poller: zmq.Poller) -> _Conn:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.ipv6 = True  # an IPv6 producer address (IPv4 ones work as before)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        poller.register(sock, zmq.POLLIN)
        sock.send(_encoder.encode(Handshake(self.layout)))
        return _Conn(endpoint, sock)

    def _on_reply(self, conn: _Conn, frames: list, pending: dict[str, _Pending]) -> None:
        try:
            message = _decoder.decode(frames[0].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropped an unreadable KV transfer reply from %s: %s", conn.endpoint, exc)
            return
        if isinstance(message, HandshakeReply):
            if message.error is None and message.layout != self.layout:
                conn.error = layout_mismatch(conn.endpoint, message.layout, self.layout)
            else:
                conn.error = message.error
            conn.ready = conn.error is None
            for remote_id in conn.queued:
                p = pending.get(remote_id)
                if p is None:
                    continue
                if conn.error is not None:
                    self._fail(pending.pop(remote_id).spec, conn.error)
                else:
                    conn.sock.send(_encoder.encode(_pull(remote_id, p.spec)))
            conn.queued = []
        elif isinstance(message, PullReply):
            p = pending.pop(message.request_id, None)
            if p is None:
                return  # cancelled (its Release is sent) or failed on a timeout
            error = message.error or self._check_frames(message, frames[1:], p.spec)
            if error is not None:
                self._fail(p.spec, f"pulling the KV from {conn.endpoint} failed: {error}")
                return
            conn.sock.send(_encoder.encode(Release(message.request_id, completed=True)))
            self.stats["kv_transfers"] += 1
            self.stats["kv_transfer_bytes"] += sum(len(f.buffer) for f in frames[1:])
            self.stats["kv_transfer_seconds"] += time.monotonic() - p.start_s
            self._finish(("loaded", p.spec.request_id, p.spec, [f.buffer for f in frames[1:]]))

    def _check_frames(self, reply: PullReply, frames: list, spec: LoadSpec) -> str | None:
        """Why the layer frames of ``reply`` cannot go into ``spec``'s local blocks, or None."""
        layout = self.layout
        if len(frames) != layout.num_layers or len(reply.checksums) != layout.num_layers:
            return f"got {len(frames)} layer frames, expected {layout.num_layers}"
        itemsize = torch.empty((), dtype=_DTYPES[layout.dtype]).element_size()
        # (layer, blocks) of each frame, in frame order
        expected = [(i, len(ids)) for group, ids in zip(
            kv_cache_groups(layout.layers), (spec.local_block_ids, *spec.local_group_block_ids))
            for i in group.layer_ids]
        for (layer, num_blocks), frame, checksum in zip(expected, frames, reply.checksums):
            num_bytes = (num_blocks * layout.block_size * layout.layers[layer].values_per_token()
                         * itemsize)
            if len(frame.buffer) != num_bytes:
                return f"layer {layer}: {len(frame.buffer)} bytes, expected {num_bytes}"
            if xxhash.xxh64(frame.buffer).intdigest() != checksum:
                return f"layer {layer}: checksum mismatch (corrupted in transit)"
        return None

    def _expire_pulls(self, conns: dict[str, _Conn], pending: dict[str, _Pending],
                      poller: zmq.Poller) -> None:
        now = time.monotonic()
        dead = {p.conn.endpoint for p in pending.values() if p.deadline_s <= now}
        for endpoint in dead:  # a producer that does not answer: a fresh socket next time
            conn = conns.pop(endpoint)
            for remote_id in [r for r, p in pending.items() if p.conn is conn]:
                self.stats["kv_transfer_timeouts"] += 1
                self._fail(pending.pop(remote_id).spec, (
                    f"no reply from the producer at {endpoint} within {self.pull_timeout_s:g} s "
                    f"(kv_transfer_timeout_s): it died or is unreachable"))
            poller.unregister(conn.sock)
            conn.sock.close(linger=0)

    def _fail(self, spec: LoadSpec, error: str) -> None:
        self.stats["kv_transfer_failures"] += 1
        logger.error("request %s: %s", spec.request_id, error)
        self._finish(("failed", spec.request_id, error))

    def _finish(self, item: tuple) -> None:
        self._done.put(item)
        self._event.set()

