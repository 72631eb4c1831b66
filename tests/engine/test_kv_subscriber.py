"""KV event subscriber: per-rank index rebuilt over real ZMQ sockets (loopback, OS-chosen ports),
gaps healed by replay or counted as lost, unreadable messages counted, and an end-to-end check
against the real BlockManager with evictions."""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections import defaultdict

import msgspec
import pytest
import zmq

from atom.core.block_manager import BlockManager
from atom.kv_events import (AllBlocksCleared, BlockRemoved, GroupFields, KVEventBatch,
                            KVEventPublisher, removed_event, stored_event, to_wire_hash)
from atom.engine.kv_subscriber import (KVCacheIndex, KVEventSubscriber, PublisherEndpoints,
                                connectable_endpoint, wire_block_hashes)
from atom.sampling_params import SamplingParams
from atom.core.sequence import Sequence
from tests.test_kv_events import LOOPBACK, events_config, wait_sent, wait_until

PROBE_HASH = 2**64 - 7  # removed by the connection probes; never stored


class RecordingSubscriber(KVEventSubscriber):
    """Records the live seqs per rank; ``drop(rank, seq)`` True loses that live frame."""

    def __init__(self, *args, drop=None, **kwargs):
        self.live_seqs: dict[int, list[int]] = defaultdict(list)
        self.drop = drop or (lambda rank, seq: False)
        super().__init__(*args, **kwargs)

    def _on_live_message(self, state, frames):
        if len(frames) == 3 and len(frames[1]) == 8:
            rank, seq = state.publisher.dp_rank, int.from_bytes(frames[1], "big")
            if self.drop(rank, seq):
                return
            self.live_seqs[rank].append(seq)
        super()._on_live_message(state, frames)


def make_publishers(num_ranks: int, *, replay: bool = True, **config) -> list[KVEventPublisher]:
    config = events_config(LOOPBACK, LOOPBACK if replay else None, **config)
    return [KVEventPublisher(config, dp_rank=rank) for rank in range(num_ranks)]


def endpoints(pubs: list[KVEventPublisher]) -> list[PublisherEndpoints]:
    return [PublisherEndpoints(p.dp_rank, p.endpoint, p.replay_endpoint) for p in pubs]


def connect_live(sub: RecordingSubscriber, pubs: list[KVEventPublisher]) -> None:
    """Publish probes on fresh publishers until every rank's SUB gets live frames, then wait
    until the subscriber applied every probe (so seqs after this are the test's own)."""
    num_probes = []
    for pub in pubs:
        num_probes.append(0)

        def probe(timeout_s, pub=pub):
            pub.publish([removed_event([PROBE_HASH])])
            num_probes[-1] += 1
            sub.poll(timeout_s)
        wait_until(lambda pub=pub: sub.live_seqs[pub.dp_rank], poll=probe)
    wait_caught_up(sub, pubs, num_probes)


def wait_caught_up(sub: KVEventSubscriber, pubs: list[KVEventPublisher], totals: list[int]) -> None:
    """Wait until each publisher sent ``totals[i]`` batches, the subscriber applied them and
    no replay is in flight."""
    for pub, total in zip(pubs, totals):
        wait_sent(pub, total)
    wait_until(lambda: all(sub.last_seq(p.dp_rank) == total - 1 for p, total in zip(pubs, totals))
               and sub.stats()["num_replays_in_flight"] == 0, poll=sub.poll)


def counters_since(sub: KVEventSubscriber, before: dict[str, int]) -> dict[str, int]:
    """The subscriber's counters minus ``before`` (the connection probes may have had gaps)."""
    return {name: value - before.get(name, 0) for name, value in sub.stats().items()}


def wire(hashes) -> set[int]:
    return {to_wire_hash(h) for h in hashes}


@pytest.fixture
def pubs2():
    pubs = make_publishers(2)
    yield pubs
    for pub in pubs:
        pub.close()


# ----- index and hashes -----

def test_index_applies_events_per_rank_and_matches_prefixes():
    index = KVCacheIndex([0, 1])
    index.apply(0, [stored_event([1, 2, 3], None, list(range(12)), 4)])
    index.apply(1, [stored_event([1], None, list(range(4)), 4), removed_event([7])])
    assert index.longest_prefix_match(wire([1, 2, 3, 4])) == {0: 3, 1: 1}
    index.apply(0, [removed_event([2])])
    assert index.longest_prefix_match(wire([1, 2, 3])) == {0: 1, 1: 1}  # stops at the hole
    assert index.block_hashes(0) == wire([1, 3])
    index.apply(0, [AllBlocksCleared()])
    assert index.block_hashes(0) == frozenset() and index.block_hashes(1) == wire([1])


def test_hybrid_events_name_their_group_and_the_index_keeps_groups_apart():
    """A hybrid pool's events say the group the vLLM 0.32 way; one hash stored in both groups
    and removed from the sliding one stays in the full one; the match needs the window's
    sliding blocks before the hit (window 5, blocks of 4)."""
    full, sliding = GroupFields(0, None), GroupFields(1, 5)
    stored = stored_event([1], None, [0, 1, 2, 3], 4, sliding)
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == (
        1, "sliding_window", 5)
    assert stored_event([1], None, [0] * 4, 4, full).kv_cache_spec_kind == "full_attention"
    assert removed_event([1], sliding).group_idx == 1
    index = KVCacheIndex([0])
    prompt = [to_wire_hash(h) for h in (1, 2, 3, 4, 5)]  # a prompt's chained hashes, in order
    index.apply(0, [stored_event([1, 2, 3, 4], None, list(range(16)), 4, full),
                    stored_event([1, 2, 3, 4], None, list(range(16)), 4, sliding)])
    assert index.longest_prefix_match(prompt) == {0: 4}
    index.apply(0, [removed_event([1, 2], sliding)])  # the window released them
    assert index.block_hashes(0) == wire([1, 2, 3, 4])
    assert index.longest_prefix_match(prompt) == {0: 4}  # needs blocks 2, 3
    index.apply(0, [removed_event([4], sliding)])
    assert index.longest_prefix_match(prompt) == {0: 3}  # 2 needs 1: gone
    index.apply(0, [removed_event([3], full)])  # the full chain stops at 2 blocks, whose
    # window (keys from token 4) needs sliding block 1, gone; 1 block needs block 0, gone
    assert index.longest_prefix_match(prompt) == {0: 0}


@pytest.mark.parametrize("seed", range(4))
def test_the_index_counts_the_block_managers_own_hybrid_hits(seed):
    """Over a random hybrid workload (tests/core/test_scheduler.py's), the index the events
    rebuild gives every probe prompt the hit the block manager itself would give it."""
    from tests.core.test_scheduler import Driver, make_scheduler, make_seq, prompt

    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=24, max_num_seqs=3, max_num_batched_tokens=8,
                           max_model_len=48, group_windows=(None, 6))
    bm, index, driver = sched.block_manager, KVCacheIndex([0]), Driver(sched)
    bases = [prompt(36, 1000 * k) for k in range(2)]
    num_hits = 0
    for i in range(60):
        if rng.random() < 0.3:
            sched.add(make_seq(rng.choice(bases)[:rng.randint(4, 30)] + [7], f"q{i}",
                               max_tokens=rng.randint(1, 6)))
        if sched.has_unfinished():
            driver.step()
        index.apply(0, bm.take_events())
        for base in bases:
            probe = make_seq(base[:rng.randint(2, 36)], "probe")
            num_blocks = (len(probe.token_ids) - 1) // bm.block_size
            expected = bm.find_cached(probe)[0]
            hashes = [to_wire_hash(h) for h in bm.block_hashes(probe, num_blocks)]
            assert index.longest_prefix_match(hashes) == {0: expected}, (i, len(probe.token_ids))
            num_hits += expected > 0
    assert num_hits > 0


def test_wire_block_hashes_match_the_block_manager():
    bm = BlockManager(16, 4)
    tokens = list(range(50, 64))  # 3 full blocks and 2 tokens
    seq = Sequence("r", list(tokens), SamplingParams())
    assert wire_block_hashes(tokens, 4) == [to_wire_hash(h) for h in bm.block_hashes(seq, 3)]
    assert wire_block_hashes(tokens[:3], 4) == []


# ----- round trip over two ranks -----

def test_two_ranks_round_trip_rebuilds_each_rank_set(pubs2):
    with RecordingSubscriber(endpoints(pubs2)) as sub:
        connect_live(sub, pubs2)
        before = sub.stats()
        num_probes = [p.stats()["num_published_batches"] for p in pubs2]
        pubs2[0].publish([stored_event([1, 2], None, list(range(8)), 4)])
        pubs2[1].publish([stored_event([2**63 + 5], None, list(range(4)), 4)])
        pubs2[0].publish([removed_event([1]), stored_event([3], 2, list(range(4)), 4)])
        pubs2[1].publish([AllBlocksCleared()])
        pubs2[1].publish([stored_event([9], None, list(range(4)), 4)])
        wait_caught_up(sub, pubs2, [num_probes[0] + 2, num_probes[1] + 3])
        assert sub.index.block_hashes(0) == wire([2, 3])
        assert sub.index.block_hashes(1) == wire([9])
        # the new batches came live, in order, with no gap
        assert sub.live_seqs[0][-2:] == [num_probes[0], num_probes[0] + 1]
        assert sub.live_seqs[1][-3:] == [num_probes[1] + i for i in range(3)]
        assert counters_since(sub, before)["num_gaps_detected"] == 0
        assert sub.stats()["num_decode_failures"] == 0


def test_late_subscriber_catches_up_by_replay(pubs2):
    for i in range(20):
        pubs2[i % 2].publish([stored_event([i], None, [i] * 4, 4)])
    pubs2[1].publish([removed_event([1, 3])])
    with KVEventSubscriber(endpoints(pubs2)) as sub:  # catch_up: replay from seq 0
        wait_caught_up(sub, pubs2, [10, 11])
        assert sub.index.block_hashes(0) == wire(range(0, 20, 2))
        assert sub.index.block_hashes(1) == wire(range(5, 20, 2))
        stats = sub.stats()
        assert stats["num_replayed_batches"] == 21 and stats["num_gaps_detected"] == 0


# ----- gaps -----

def publish_losing_frames(pubs, *, lost_offsets, num_batches: int):
    """Connect a subscriber, then publish ``num_batches`` BlockStored (hashes 100, 101, ...) on
    rank 0 while its SUB loses the live frames at ``lost_offsets``. Returns the hashes the
    index holds for rank 0 and the counters this part changed."""
    lost: set[int] = set()
    with RecordingSubscriber(endpoints(pubs), drop=lambda r, s: r == 0 and s in lost) as sub:
        connect_live(sub, pubs)
        before = sub.stats()
        base = pubs[0].stats()["num_published_batches"]
        lost.update(base + i for i in lost_offsets)
        for i in range(num_batches):
            pubs[0].publish([stored_event([100 + i], None, [i] * 4, 4)])
        wait_caught_up(sub, pubs[:1], [base + num_batches])
        assert not lost & set(sub.live_seqs[0])  # really dropped
        return sub.index.block_hashes(0), counters_since(sub, before)


def test_dropped_live_frames_are_healed_by_replay(pubs2):
    held, stats = publish_losing_frames(pubs2, lost_offsets=[2, 3, 4], num_batches=8)
    assert held == wire(range(100, 108))
    assert stats["num_gaps_detected"] == 1 and stats["num_gaps_healed"] == 1
    assert stats["num_gaps_unhealed"] == 0 and stats["num_lost_batches"] == 0
    assert stats["num_pending_batches"] == 0


def test_gap_older_than_the_replay_buffer_is_counted_as_lost():
    pubs = make_publishers(1, buffer_size=2)
    try:
        held, stats = publish_losing_frames(pubs, lost_offsets=range(4), num_batches=5)
    finally:
        pubs[0].close()
    # live: only the 5th arrives; the replay it asks for starts at the 4th (a buffer of 2
    # holds the 4th and 5th), so the first three are lost
    assert held == wire([103, 104])
    assert stats["num_gaps_detected"] == 1 and stats["num_gaps_unhealed"] == 1
    assert stats["num_gaps_healed"] == 0 and stats["num_lost_batches"] == 3


def test_without_replay_a_gap_is_lost_and_counted():
    pubs = make_publishers(1, replay=False)
    try:
        held, stats = publish_losing_frames(pubs, lost_offsets=[1], num_batches=3)
    finally:
        pubs[0].close()
    assert held == wire([100, 102])
    assert stats["num_gaps_detected"] == 1 and stats["num_gaps_unhealed"] == 1
    assert stats["num_lost_batches"] == 1 and stats["num_replay_requests"] == 0


def test_an_unanswered_replay_times_out_and_the_gap_is_lost():
    ctx = zmq.Context.instance()
    pub, silent_router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(LOOPBACK)
    silent_router.bind(LOOPBACK)  # takes replay requests, never answers
    seq = itertools.count()

    def send(hashes) -> None:
        batch = KVEventBatch(1.0, [stored_event(hashes, None, [0] * 4, 4)], 0)
        pub.send_multipart((b"", next(seq).to_bytes(8, "big"), msgspec.msgpack.encode(batch)))

    publisher = PublisherEndpoints(0, pub.getsockopt_string(zmq.LAST_ENDPOINT),
                                   silent_router.getsockopt_string(zmq.LAST_ENDPOINT))
    with RecordingSubscriber([publisher], catch_up=False, replay_timeout_s=0.2) as sub:
        def probe(timeout_s):
            send([PROBE_HASH])
            sub.poll(timeout_s)
        wait_until(lambda: sub.live_seqs[0] and not sub.stats()["num_replays_in_flight"],
                   poll=probe)
        before = sub.stats()
        next(seq)  # one seq never sent
        send([400])
        wait_until(lambda: counters_since(sub, before)["num_replay_timeouts"] == 1, poll=sub.poll)
        stats = counters_since(sub, before)
        assert stats["num_gaps_detected"] == 1 and stats["num_gaps_unhealed"] == 1
        assert stats["num_lost_batches"] == 1 and stats["num_replay_requests"] == 1
        assert sub.index.block_hashes(0) >= wire([400])
    pub.close(linger=0)
    silent_router.close(linger=0)


# ----- unreadable messages, legacy payloads -----

def test_unreadable_messages_are_counted_and_logged_and_legacy_events_apply(caplog):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(LOOPBACK)
    seq = itertools.count()
    legacy = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [to_wire_hash(2**64 - 1)], None, [1] * 4, 4, None, "GPU", None]]])

    def send(payload: bytes) -> None:
        pub.send_multipart((b"", next(seq).to_bytes(8, "big"), payload))

    with RecordingSubscriber([PublisherEndpoints(0, pub.getsockopt_string(zmq.LAST_ENDPOINT))]) as sub:
        def probe(timeout_s):
            send(msgspec.msgpack.encode(KVEventBatch(1.0, [removed_event([PROBE_HASH])], 0)))
            sub.poll(timeout_s)
        wait_until(lambda: sub.live_seqs[0], poll=probe)
        caplog.set_level(logging.WARNING, logger="atom.engine.kv_subscriber")
        before = sub.stats()
        send(b"\xc1garbage")  # not msgpack
        send(msgspec.msgpack.encode({"not": "a batch"}))
        send(msgspec.msgpack.encode([2.0, [{"type": "BlockAccessed", "block_hashes": [1]},
                                           {"type": "BlockStored", "block_hashes": [5]}]]))
        pub.send_multipart((b"", b"short"))  # 2 frames, no seq
        send(legacy)
        num_sent = next(seq)
        wait_until(lambda: sub.last_seq(0) == num_sent - 1, poll=sub.poll)
        wait_until(lambda: counters_since(sub, before)["num_decode_failures"] == 5, poll=sub.poll)
        assert sub.index.block_hashes(0) == wire([2**64 - 1])  # the legacy event applied
        assert counters_since(sub, before)["num_gaps_detected"] == 0  # unreadable ones took a seq
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and "unreadable" in r.getMessage()]
        assert len(warnings) == 4 and any("c167617262616765" in w for w in warnings)
    pub.close(linger=0)


# ----- end to end with the real block manager -----

def run_workload(bm: BlockManager, pub: KVEventPublisher, rng: random.Random) -> tuple[int, int]:
    """Sequences with shared prefixes through a small pool; one publish per step. Returns the
    number of BlockRemoved events (evictions) and of non-empty batches published."""
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    running: list[Sequence] = []
    num_removed = num_batches = 0
    for step in range(60):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        seq = Sequence(f"r{step}", tokens, SamplingParams())
        if bm.admission_cost(seq)[0] <= bm.num_free_blocks:
            bm.allocate(seq)
            running.append(seq)
        for s in running:
            s.num_computed_tokens = len(s.token_ids)
            bm.cache_computed_blocks(s)
        while running and (len(running) > 2 or rng.random() < 0.3):
            bm.free(running.pop(0))
        if step == 30:
            for s in running:
                bm.free(s)
            running.clear()
            assert bm.reset_prefix_cache()
        bm.check_invariants()
        events = bm.take_events()
        num_removed += sum(isinstance(e, BlockRemoved) for e in events)
        pub.publish(events)
        num_batches += bool(events)
    return num_removed, num_batches


def test_end_to_end_index_equals_each_block_manager_hash_set(pubs2):
    bms = [BlockManager(10, 4), BlockManager(10, 4)]
    with RecordingSubscriber(endpoints(pubs2)) as sub:
        connect_live(sub, pubs2)
        totals = []
        for rank, (bm, pub) in enumerate(zip(bms, pubs2)):
            base = pub.stats()["num_published_batches"]
            num_removed, num_batches = run_workload(bm, pub, random.Random(rank))
            assert num_removed > 0  # evictions happened
            totals.append(base + num_batches)
        wait_caught_up(sub, pubs2, totals)
        for rank, bm in enumerate(bms):
            assert sub.index.block_hashes(rank) == wire(bm.hash_to_block)
        assert sub.stats()["num_decode_failures"] == 0


def test_background_thread_mode(pubs2):
    sub = KVEventSubscriber(endpoints(pubs2))
    sub.start()
    try:
        with pytest.raises(RuntimeError, match="background thread"):
            sub.poll()
        def publish_again(timeout_s):  # until the SUB is connected, PUB drops: publish again
            pubs2[1].publish([stored_event([42], None, [0] * 4, 4)])
            threading.Event().wait(timeout_s)
        wait_until(lambda: sub.index.block_hashes(1) == wire([42]), poll=publish_again)
    finally:
        sub.close()


def test_for_ranks_offsets_ports_and_rejects_os_chosen_ports():
    sub = KVEventSubscriber.for_ranks("tcp://127.0.0.1:25557", dp_size=2,
                                      replay_endpoint="tcp://127.0.0.1:25567", catch_up=False)
    try:
        assert sub.publishers == [
            PublisherEndpoints(0, "tcp://127.0.0.1:25557", "tcp://127.0.0.1:25567"),
            PublisherEndpoints(1, "tcp://127.0.0.1:25558", "tcp://127.0.0.1:25568")]
    finally:
        sub.close()
    with pytest.raises(ValueError, match="OS-chosen"):
        KVEventSubscriber.for_ranks(LOOPBACK, dp_size=2)
    with pytest.raises(ValueError, match="distinct"):
        KVEventSubscriber([PublisherEndpoints(0, LOOPBACK), PublisherEndpoints(0, LOOPBACK)])


def test_connectable_endpoint_turns_wildcard_hosts_into_loopback():
    assert connectable_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert connectable_endpoint("tcp://[::]:5557") == "tcp://[::1]:5557"
    for unchanged in ("tcp://10.0.0.7:5557", "ipc:///tmp/kv_dp1", "tcp://127.0.0.1:41234"):
        assert connectable_endpoint(unchanged) == unchanged
