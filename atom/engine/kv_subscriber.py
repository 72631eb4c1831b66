"""KV event subscriber: which block hashes each DP rank holds, rebuilt from the event streams.

Public API for a DP router, in this process or outside the engine (torch-free):
:class:`KVEventSubscriber` connects to N publishers (one per DP rank; the wire is described in
``atom.kv_events``) and keeps a :class:`KVCacheIndex`; :func:`wire_block_hashes` computes a
prompt's block hashes the way atom's block manager does, in wire form, to query the index.

Per rank the subscriber holds one SUB socket (live batches) and, when the publisher has a replay
endpoint, one DEALER (replay). It applies batches strictly in seq order:

- seq == next expected: applied; seq below it: a duplicate (replayed and live), skipped.
- seq above it: a gap. The batch waits, and a replay from the expected seq is requested; when
  the end marker (seq -1) arrives, everything that came is applied in order. A hole older than
  the publisher's replay buffer (its first replayed seq is past the hole), a publisher without a
  replay endpoint, or a replay that does not finish within ``replay_timeout_s`` cannot be
  healed: the missing batches are counted as lost, a WARNING is logged, and the index goes on
  from the next batch it has (it may then hold stale or miss hashes for that rank).
- ``catch_up`` (default): at start the subscriber asks every rank for a replay from seq 0, so a
  router started after the engines still sees their whole (buffered) history, and the slow
  start of a PUB/SUB connection loses nothing that is still buffered.

Nothing unreadable is dropped silently: a frame of the wrong shape, a payload that is not a
batch, or an event of an unknown type or shape counts in ``num_decode_failures`` and logs a
WARNING with the payload's first bytes (the first ten, then every thousandth).

Threading: call :meth:`KVEventSubscriber.poll` from one thread (a router's loop; no thread of
its own), or :meth:`KVEventSubscriber.start` a background thread that polls. The index locks
itself, so its queries are safe from any thread in both modes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import zmq

from atom.core.block_manager import hash_block
from atom.kv_cache_spec import first_block_in_window
from atom.kv_events import (SPEC_KIND_SLIDING, AllBlocksCleared, BlockHash, BlockRemoved,
                            BlockStored, KVCacheEvent, KVEventBatch, KVEventDecodeError,
                            decode_batch, offset_endpoint, to_wire_hash)

logger = logging.getLogger(__name__)

_MAX_REPLAY_ROUNDS = 3  # replays asked for one gap before what is still missing counts as lost
_MAX_MESSAGES_PER_POLL = 10_000  # bounds one poll() call when batches arrive without pause
_NUM_FAILURES_LOGGED = 10  # then every 1000th


def wire_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none),
    as atom's block manager computes them (``hash_block``), in wire form (signed 64-bit)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(to_wire_hash(parent))
    return hashes


def connectable_endpoint(endpoint: str) -> str:
    """A bound endpoint as a peer on the same host connects to it: a wildcard host
    (``tcp://0.0.0.0:P``, ``tcp://[::]:P``, what ``tcp://*:P`` binds) becomes loopback."""
    for wildcard, loopback in (("tcp://0.0.0.0:", "tcp://127.0.0.1:"), ("tcp://[::]:", "tcp://[::1]:")):
        if endpoint.startswith(wildcard):
            return loopback + endpoint[len(wildcard):]
    return endpoint


class KVCacheIndex:
    """Per DP rank, the block hashes its prefix cache holds (all media merged), per KV cache
    group (``group_idx``; an event without one is group 0's, as every event of a model with
    one group).

    A hybrid model's events name each group's kind and window (vLLM 0.32's
    ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``): :meth:`longest_prefix_match`
    counts a hit by the engine's hybrid rule (:mod:`atom.core.block_manager`): the longest
    prefix every full group holds whole and every sliding group holds the window before.

    Owns the sets, mutated only by :meth:`apply`; a lock makes every method safe to call from
    any thread.
    """

    def __init__(self, dp_ranks: Iterable[int]) -> None:
        self._blocks: dict[int, dict[int, set[BlockHash]]] = {rank: {0: set()} for rank in dp_ranks}
        # per rank, sliding group -> (window, block size), from its BlockStored events
        self._windows: dict[int, dict[int, tuple[int, int]]] = {rank: {} for rank in dp_ranks}
        self._lock = threading.Lock()

    @property
    def dp_ranks(self) -> list[int]:
        return list(self._blocks)

    def apply(self, dp_rank: int, events: Iterable[KVCacheEvent]) -> None:
        """Apply one batch's events to ``dp_rank``'s sets (KeyError: a rank not indexed)."""
        with self._lock:
            groups, windows = self._blocks[dp_rank], self._windows[dp_rank]
            for event in events:
                if isinstance(event, BlockStored):
                    group = event.group_idx or 0
                    groups.setdefault(group, set()).update(event.block_hashes)
                    if (event.kv_cache_spec_kind == SPEC_KIND_SLIDING
                            and event.kv_cache_spec_sliding_window is not None):
                        windows[group] = (event.kv_cache_spec_sliding_window, event.block_size)
                elif isinstance(event, BlockRemoved):
                    groups.setdefault(event.group_idx or 0, set()).difference_update(
                        event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    for blocks in groups.values():
                        blocks.clear()

    def block_hashes(self, dp_rank: int, group_idx: int = 0) -> frozenset[BlockHash]:
        """A snapshot of the hashes ``dp_rank`` holds in KV cache group ``group_idx``."""
        with self._lock:
            return frozenset(self._blocks[dp_rank].get(group_idx, ()))

    def longest_prefix_match(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """Per rank, how many leading blocks of ``block_hashes`` (a prompt's chained hashes,
        wire form) it holds: the count stops at the first block a full group lacks, then
        shrinks until every sliding group holds the window before it (class docstring)."""
        with self._lock:
            return {rank: self._match(rank, block_hashes) for rank in self._blocks}

    def _match(self, rank: int, block_hashes: Sequence[BlockHash]) -> int:
        groups, windows = self._blocks[rank], self._windows[rank]
        num_blocks = len(block_hashes)
        for group, blocks in groups.items():
            if group not in windows:  # a full group: the chain up to its first miss
                num_blocks = min(num_blocks, next(
                    (i for i, h in enumerate(block_hashes) if h not in blocks), num_blocks))
        while num_blocks > 0 and not all(
                all(h in groups[g] for h in block_hashes[
                    first_block_in_window(window, num_blocks * size, block_size=size):num_blocks])
                for g, (window, size) in windows.items()):
            num_blocks -= 1
        return num_blocks


@dataclass(frozen=True)
class PublisherEndpoints:
    """Where one rank's publisher is: PUB endpoint and optional ROUTER replay endpoint."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


@dataclass
class _RankState:
    """One publisher's stream: sockets, the next seq to apply, batches waiting for a hole."""

    publisher: PublisherEndpoints
    sub: zmq.Socket
    dealer: zmq.Socket | None
    next_seq: int = 0
    pending: dict[int, KVEventBatch | None] = field(default_factory=dict)  # None: unreadable
    replay_in_flight: bool = False
    replay_got_any: bool = False
    replay_deadline: float = 0.0  # time.monotonic() seconds
    replay_rounds: int = 0  # replays asked for the open gap
    gap_open: bool = False
    gap_lost: bool = False  # some batches of the open gap are lost for good
    warned_rank: bool = False


class KVEventSubscriber:
    """Follows N publishers' KV event streams and rebuilds each rank's cached block hashes.

    Owns the sockets, the per-rank stream state and :attr:`index` (a :class:`KVCacheIndex`),
    which only this subscriber mutates. Counters are plain attributes and :meth:`stats`.

    Args:
        publishers: one entry per rank (its ``dp_rank`` keys the index).
        topic: the SUB subscription (a prefix of the publisher's topic; "" takes all).
        catch_up: ask every rank with a replay endpoint for a replay from seq 0 at start.
        replay_timeout_s: how long a replay may take before the hole it was for is given up.
        rcvhwm: SUB and DEALER receive high-water marks, in messages.

    Raises:
        ValueError: no publishers, or two with the same ``dp_rank``.
    """

    def __init__(self, publishers: Sequence[PublisherEndpoints], *, topic: str | bytes = "",
                 catch_up: bool = True, replay_timeout_s: float = 5.0,
                 rcvhwm: int = 100_000) -> None:
        ranks = [p.dp_rank for p in publishers]
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"KVEventSubscriber needs publishers with distinct dp_ranks, got {ranks}")
        self.publishers = list(publishers)
        self.index = KVCacheIndex(ranks)
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._replay_timeout_s = replay_timeout_s
        self._rcvhwm = rcvhwm
        self._ctx = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._sockets: dict[zmq.Socket, tuple[_RankState, bool]] = {}  # -> (state, is_replay)
        self._states: dict[int, _RankState] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.num_live_batches = 0  # batches received on the SUB sockets
        self.num_replayed_batches = 0  # batches received in replays
        self.num_applied_batches = 0
        self.num_duplicate_batches = 0  # received again (live and replayed), skipped
        self.num_decode_failures = 0  # unreadable messages, payloads and events
        self.num_gaps_detected = 0
        self.num_gaps_healed = 0  # every missing batch came by replay
        self.num_gaps_unhealed = 0  # some were lost for good (num_lost_batches)
        self.num_lost_batches = 0
        self.num_replay_requests = 0
        self.num_replay_timeouts = 0
        for publisher in publishers:
            sub = self._socket(zmq.SUB, publisher.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            dealer = (self._socket(zmq.DEALER, publisher.replay_endpoint)
                      if publisher.replay_endpoint is not None else None)
            state = _RankState(publisher, sub, dealer)
            self._states[publisher.dp_rank] = state
            self._register(state, sub, replay=False)
            if dealer is not None:
                self._register(state, dealer, replay=True)
                if catch_up:
                    self._request_replay(state)

    @classmethod
    def for_ranks(cls, endpoint: str, *, dp_size: int, replay_endpoint: str | None = None,
                  **kwargs) -> KVEventSubscriber:
        """Subscribe to ranks 0..dp_size-1 of one deployment from its un-offset endpoints (the
        ``--kv-events-*`` values; ports are offset by rank as the publishers do). The host must
        be one to connect to, and the ports fixed (0 or ``*``: ValueError)."""
        for ep in (endpoint, replay_endpoint):
            if ep is not None and offset_endpoint(ep, 0).endswith(":*"):
                raise ValueError(f"{ep!r}: OS-chosen ports cannot be derived per rank; pass "
                                 "each publisher's bound endpoint (PublisherEndpoints)")
        publishers = [PublisherEndpoints(
            rank, offset_endpoint(endpoint, rank),
            None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank))
            for rank in range(dp_size)]
        return cls(publishers, **kwargs)

    # ----- public: polling, threads, queries -----

    def poll(self, timeout_s: float = 0.0) -> int:
        """Wait up to ``timeout_s`` for messages, handle all that arrived, and give up replays
        past their deadline. Returns the number of batches applied to the index.

        Raises:
            RuntimeError: the background thread (:meth:`start`) owns the sockets.
        """
        self._check_caller()
        num_applied = self.num_applied_batches
        ready = dict(self._poller.poll(timeout_s * 1000))
        num_messages = 0
        while ready and num_messages < _MAX_MESSAGES_PER_POLL:
            for sock in ready:
                num_messages += self._receive(sock)
            ready = dict(self._poller.poll(0))
        self._expire_replays()
        return self.num_applied_batches - num_applied

    def sync(self, timeout_s: float = 5.0) -> bool:
        """Ask every rank with a replay endpoint for what followed the last applied batch and
        poll until all replays finished. Returns False when ``timeout_s`` ran out first.

        After it returns True the index holds every batch each publisher had sent when it
        served the request (as far as its replay buffer reaches).

        Raises:
            RuntimeError: the background thread (:meth:`start`) owns the sockets.
        """
        self._check_caller()
        for state in self._states.values():
            if state.dealer is not None and not state.replay_in_flight:
                self._request_replay(state)
        deadline = time.monotonic() + timeout_s
        while any(s.replay_in_flight for s in self._states.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(left, 0.1))
        return True

    def start(self) -> None:
        """Poll in a background thread until :meth:`close` (``poll`` may not be called then)."""
        if self._thread is not None:
            raise RuntimeError("KVEventSubscriber already started")
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread (if any; waits at most ``timeout_s``), close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("KV event subscriber thread did not stop within %.1f s", timeout_s)
                return
        for sock in list(self._sockets):
            sock.close(linger=0)
        self._sockets.clear()

    def last_seq(self, dp_rank: int) -> int | None:
        """The seq of the last batch applied (or given up) for ``dp_rank``; None before any."""
        next_seq = self._states[dp_rank].next_seq
        return next_seq - 1 if next_seq else None

    def stats(self) -> dict[str, int]:
        """Counters (batches unless named otherwise), plus two gauges: ``num_pending_batches``
        waiting for a hole before them, ``num_replays_in_flight``."""
        counters = {name: value for name, value in vars(self).items() if name.startswith("num_")}
        counters["num_pending_batches"] = sum(len(s.pending) for s in self._states.values())
        counters["num_replays_in_flight"] = sum(s.replay_in_flight for s in self._states.values())
        return counters

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- sockets -----

    def _check_caller(self) -> None:
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("KVEventSubscriber: poll/sync while its background thread runs")

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def _register(self, state: _RankState, sock: zmq.Socket, *, replay: bool) -> None:
        self._sockets[sock] = (state, replay)
        self._poller.register(sock, zmq.POLLIN)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll(0.1)

    def _receive(self, sock: zmq.Socket) -> int:
        """Handle every message waiting on ``sock``; returns how many."""
        state, replay = self._sockets[sock]
        num_messages = 0
        while num_messages < _MAX_MESSAGES_PER_POLL:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            num_messages += 1
            if replay:
                self._on_replay_message(state, frames)
            else:
                self._on_live_message(state, frames)
        return num_messages

    # ----- the stream: seq order, gaps, replay -----

    def _on_live_message(self, state: _RankState, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count_failure(state, frames[-1], f"a live message of {len(frames)} frames")
            return
        self.num_live_batches += 1
        self._offer(state, int.from_bytes(frames[1], "big"), self._decode(state, frames[2]))
        self._settle(state)

    def _on_replay_message(self, state: _RankState, frames: list[bytes]) -> None:
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            self._count_failure(state, frames[-1], f"a replay message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[2], "big", signed=True)
        if seq == -1:  # the end marker
            if state.replay_in_flight:
                state.replay_in_flight = False
                self._settle(state)
            return
        self.num_replayed_batches += 1
        if not state.replay_got_any:
            state.replay_got_any = True
            if seq > state.next_seq:  # the publisher's buffer starts past the hole
                self._give_up_below(state, seq)
        self._offer(state, seq, self._decode(state, frames[3]))

    def _offer(self, state: _RankState, seq: int, batch: KVEventBatch | None) -> None:
        """Take batch ``seq`` (None: unreadable, already counted) and apply what is in order."""
        if seq < state.next_seq:
            self.num_duplicate_batches += 1
            return
        state.pending[seq] = batch
        self._apply_in_order(state)

    def _apply_in_order(self, state: _RankState) -> None:
        while state.next_seq in state.pending:
            self._apply(state, state.pending.pop(state.next_seq))
            state.next_seq += 1

    def _settle(self, state: _RankState) -> None:
        """With no replay in flight: close a healed gap, or heal a hole at ``next_seq`` by
        replay, or (no replay left) give the hole up."""
        while not state.replay_in_flight:
            if not state.pending:
                if state.gap_open:
                    self._close_gap(state)
                return
            if not state.gap_open:
                state.gap_open = True
                self.num_gaps_detected += 1
                logger.info("[dp%d] KV events gap: expected seq %d, got %d", state.publisher.dp_rank,
                            state.next_seq, min(state.pending))
            if state.dealer is not None and state.replay_rounds < _MAX_REPLAY_ROUNDS:
                state.replay_rounds += 1
                self._request_replay(state)
            else:
                self._give_up_below(state, min(state.pending))

    def _give_up_below(self, state: _RankState, seq: int) -> None:
        """Batches below ``seq`` that have not come are lost: apply the ones that did, in
        order, and go on from ``seq``."""
        waiting = sorted(s for s in state.pending if s < seq)
        num_lost = seq - state.next_seq - len(waiting)
        logger.warning("[dp%d] KV events: %d batches before seq %d cannot be replayed; the index "
                       "of this rank may be stale", state.publisher.dp_rank, num_lost, seq)
        self.num_lost_batches += num_lost
        if not state.gap_open:
            state.gap_open = True
            self.num_gaps_detected += 1
        if not state.gap_lost:
            state.gap_lost = True
            self.num_gaps_unhealed += 1
        for s in waiting:
            self._apply(state, state.pending.pop(s))
        state.next_seq = seq
        self._apply_in_order(state)

    def _close_gap(self, state: _RankState) -> None:
        if not state.gap_lost:  # a lost one was counted when it was given up
            self.num_gaps_healed += 1
        state.gap_open = state.gap_lost = False
        state.replay_rounds = 0

    def _request_replay(self, state: _RankState) -> None:
        assert state.dealer is not None
        try:
            state.dealer.send_multipart((b"", state.next_seq.to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("[dp%d] KV events replay request not sent (DEALER full)",
                           state.publisher.dp_rank)
            return
        self.num_replay_requests += 1
        state.replay_in_flight, state.replay_got_any = True, False
        state.replay_deadline = time.monotonic() + self._replay_timeout_s

    def _expire_replays(self) -> None:
        """Give up replays past their deadline; a fresh DEALER drops any late answer."""
        now = time.monotonic()
        for state in self._states.values():
            if not state.replay_in_flight or now < state.replay_deadline:
                continue
            assert state.dealer is not None
            logger.warning("[dp%d] KV events replay from %s unanswered after %.1f s",
                           state.publisher.dp_rank, state.publisher.replay_endpoint,
                           self._replay_timeout_s)
            self.num_replay_timeouts += 1
            self._poller.unregister(state.dealer)
            del self._sockets[state.dealer]
            state.dealer.close(linger=0)
            state.dealer = self._socket(zmq.DEALER, state.publisher.replay_endpoint)
            self._register(state, state.dealer, replay=True)
            state.replay_in_flight = False
            state.replay_rounds = _MAX_REPLAY_ROUNDS  # no more replays for this gap
            self._settle(state)

    # ----- batches -----

    def _decode(self, state: _RankState, payload: bytes) -> KVEventBatch | None:
        try:
            batch, num_unreadable = decode_batch(payload)
        except KVEventDecodeError as exc:
            self._count_failure(state, payload, str(exc))
            return None
        if num_unreadable:
            self._count_failure(state, payload, f"{num_unreadable} events of an unknown type or "
                                "shape skipped", num_unreadable)
        return batch

    def _count_failure(self, state: _RankState, payload: bytes, what: str, num: int = 1) -> None:
        self.num_decode_failures += num
        if self.num_decode_failures <= _NUM_FAILURES_LOGGED or self.num_decode_failures % 1000 < num:
            logger.warning("[dp%d] unreadable KV event message (%s; %d failures so far), first "
                           "bytes %s", state.publisher.dp_rank, what, self.num_decode_failures,
                           bytes(payload[:32]).hex())

    def _apply(self, state: _RankState, batch: KVEventBatch | None) -> None:
        if batch is None:
            return
        rank = state.publisher.dp_rank
        if batch.data_parallel_rank not in (None, rank) and not state.warned_rank:
            state.warned_rank = True
            logger.warning("[dp%d] batches from %s say data_parallel_rank=%s; indexed as rank %d",
                           rank, state.publisher.endpoint, batch.data_parallel_rank, rank)
        self.index.apply(rank, batch.events)
        self.num_applied_batches += 1
