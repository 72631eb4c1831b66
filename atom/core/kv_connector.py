"""The KV connector of prefill/decode disaggregation: its interface and its scheduler side.

Two engines share one request: a **producer** (``--kv-role producer``) prefills it and keeps
its KV blocks; a **consumer** (``--kv-role consumer``) pulls those blocks into blocks of its
own and decodes. The vocabulary and the split are vLLM's ``KVConnectorBase_V1`` (vLLM #15960),
adapted to this scheduler:

scheduler side (:class:`KVConnectorScheduler`, torch-free, called by the scheduler only):

- :meth:`~KVConnectorScheduler.get_num_new_matched_tokens`: how many prompt tokens beyond the
  local prefix-cache hits a consumer request can load from the producer;
- :meth:`~KVConnectorScheduler.update_state_after_alloc`: the request got its blocks: record
  which local blocks the remote ones go into (the request then waits in
  ``WAITING_FOR_REMOTE_KVS``, outside the running batch);
- :meth:`~KVConnectorScheduler.request_finished`: a producer request finished: whether to keep
  (delay-free) its blocks, and the transfer params the consumer needs;
- :meth:`~KVConnectorScheduler.build_connector_meta`: what changed since the last call (loads
  to start, blocks kept, loads cancelled), handed to the worker side as one
  :class:`KVConnectorMetadata`.

worker side (:class:`KVConnectorWorker`, the transport; :class:`atom.worker.tcp_kv_connector.TCPKVConnector`):
``register_kv_caches``, ``start_load_kv(metadata)``, ``get_finished()`` →
:class:`KVConnectorOutput` (loads done or failed, kept blocks that may be freed), ``wait``.

A request without ``kv_transfer_params`` never reaches any of these calls, so the local path
costs one ``is None`` test per admission and per finish.

Block arithmetic of a consumer request (block size 4, prompt of 10 tokens, 1 block cached
locally; the producer's first token ``f`` is appended as output token 0)::

    token_ids          p0 p1 p2 p3 | p4 p5 p6 p7 | p8 p9 f
    local blocks       [  cached   ,   pulled    ,  pulled   ]   (allocate: 11 tokens)
    remote_block_ids   [    r0     ,     r1      ,    r2     ]
    load               r1 -> local[1], r2 -> local[2]; num_computed_tokens = 10 afterwards

The next step decodes ``f`` (its KV goes to slot 10 of local block 2) and samples token 1.

**KV cache groups** (a hybrid model, :func:`atom.kv_cache_spec.kv_cache_groups`: gpt-oss's
full and sliding-window layers): the pull covers every group, each with its own blocks. The
full group (group 0) moves as above; a sliding group of window ``W`` moves only the blocks the
consumer's first query (position ``remote_num_tokens``) can see, from
:func:`~atom.kv_cache_spec.first_block_in_window` on, and the consumer holds no block before
that (window 4 above: token 10's query sees keys 7 to 10, so ``r1`` and ``r2`` move, into
the sliding table ``[None, local, local]``). The
params name them per group (``remote_group_block_ids``); the two engines must group alike,
which the layout handshake checks (equal layer specs) and :meth:`KVConnectorScheduler.check_request`
checks first from the params.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from atom.core.sequence import FinishReason, Sequence
from atom.kv_cache_spec import (KVCacheSpec, describe_groups, describe_layers,
                                first_block_in_window)
from atom.messages import KVTransferParams


class KVLayout(msgspec.Struct, frozen=True):
    """The shape of one engine's KV cache, compared at the transfer handshake: blocks copied
    between engines that differ in any field would be garbage.

    Attributes:
        architecture: the model's architecture (``config.json``'s ``architectures[0]``).
        dtype: the KV cache dtype name (``"float32"``, ``"bfloat16"``).
        block_size: tokens per block.
        layers: each attention layer's :class:`~atom.kv_cache_spec.KVCacheSpec` (one tensor of
            ``spec.shape(blocks, block_size)`` each: K and V per head, or a latent vector).
    """

    architecture: str
    dtype: str
    block_size: int
    layers: tuple[KVCacheSpec, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        groups = describe_groups(self.layers, itemsize=_ITEMSIZE.get(self.dtype, 0))
        return (f"{self.architecture}, dtype={self.dtype}, block_size={self.block_size}, "
                f"{self.num_layers} layers ({describe_layers(self.layers)})"
                + ("" if not groups else f", {groups}"))


_ITEMSIZE = {"float32": 4, "bfloat16": 2}


_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def transfer_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of a producer's KV transfer address: ``tcp://HOST:PORT`` (an IPv6
    address in brackets).

    Raises:
        ValueError: ``host`` is neither an IP address nor a hostname (RFC 1123 labels, at most
            253 characters), or ``port`` is not 1 to 65535; the message says which.
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"remote_port {port} is not a TCP port (1 to 65535)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if len(host) > 253 or not _HOSTNAME.fullmatch(host):
            raise ValueError(f"remote_host {host!r} is neither an IP address nor a hostname: "
                             f"send the producer's kv_transfer_params unchanged") from None
        return f"tcp://{host}:{port}"
    return f"tcp://[{address}]:{port}" if address.version == 6 else f"tcp://{address}:{port}"


@dataclass(frozen=True)
class LoadSpec:
    """One pull a consumer starts: the producer's ``remote_block_ids`` into ``local_block_ids``
    (same length, in order) for ``request_id`` (the consumer's engine request id); a hybrid
    model's KV cache groups after the first likewise, one list per group."""

    request_id: str
    params: KVTransferParams
    remote_block_ids: list[int]
    local_block_ids: list[int]
    remote_group_block_ids: list[list[int]] = field(default_factory=list)
    local_group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids) + sum(map(len, self.local_group_block_ids))


@dataclass(frozen=True)
class KeepSpec:
    """Blocks a producer keeps for a consumer: ``block_ids`` of request ``request_id``
    (group 0's), and a hybrid model's other groups' in ``group_block_ids``."""

    request_id: str
    block_ids: list[int]
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class KVConnectorMetadata:
    """Scheduler side → worker side, once per change (vLLM's ``KVConnectorMetadata``).

    Attributes:
        loads: pulls to start (consumer).
        keeps: finished prefills whose blocks are kept (producer).
        cancels: consumer request ids whose pull was aborted: drop the result, tell the producer.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    keeps: list[KeepSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.keeps or self.cancels)


@dataclass
class KVConnectorOutput:
    """Worker side → scheduler side (vLLM's ``KVConnectorOutput``).

    Attributes:
        finished_sending: producer request ids whose kept blocks may be freed now (the
            consumer confirmed or released them, or the keep timeout passed).
        finished_recving: consumer request ids whose KV is now in their local blocks.
        failed_recving: consumer request id → why its pull failed (the request fails).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)


class KVConnectorWorker(Protocol):
    """The transport half (one per engine core; an RDMA one would slot in here)."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin the loads, register the keeps, drop the cancelled loads (never blocks)."""

    def get_finished(self) -> KVConnectorOutput:
        """What completed since the last call; finished loads are in the KV cache on return."""

    def has_pending_output(self) -> bool:
        """:meth:`get_finished` has something to report (an idle core steps to collect it)."""

    def wait(self, timeout_s: float) -> None:
        """Block until something completes, at most ``timeout_s`` seconds."""


class KVConnectorScheduler:
    """The scheduler's half of the connector: which requests load, which blocks are kept.

    Owns the pending metadata only; the scheduler owns the sequences and their blocks.

    Args:
        role: ``"producer"`` or ``"consumer"``.
        block_size: tokens per KV block.
        host, port: the producer's KV transfer address (what consumers are told).
        group_windows: each KV cache group's sliding window in tokens (None: full attention),
            as the block manager's; one full group for a model without sliding layers.
    """

    def __init__(self, role: str, *, block_size: int, host: str | None = None,
                 port: int | None = None, group_windows: tuple[int | None, ...] = (None,)):
        self.role = role
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.host, self.port = host, port
        self._meta = KVConnectorMetadata()

    def check_request(self, params: KVTransferParams, *, num_prompt_tokens: int,
                      n: int) -> str | None:
        """Why a request with ``params`` cannot run on this engine, or None."""
        if n != 1:
            return f"kv_transfer_params needs n=1 (got n={n})"
        if params.do_remote_decode == params.do_remote_prefill:
            return "kv_transfer_params must set exactly one of do_remote_decode / do_remote_prefill"
        if params.do_remote_decode and self.role != "producer":
            return f"do_remote_decode needs an engine started with --kv-role producer (this is {self.role})"
        if params.do_remote_prefill:
            if self.role != "consumer":
                return (f"do_remote_prefill needs an engine started with --kv-role consumer "
                        f"(this is {self.role})")
            if params.remote_host is None or params.remote_port is None or params.first_token_id is None:
                return "do_remote_prefill needs remote_host, remote_port and first_token_id"
            try:
                transfer_endpoint(params.remote_host, params.remote_port)
            except ValueError as exc:
                return str(exc)
            if params.remote_num_tokens != num_prompt_tokens:
                return (f"the producer computed {params.remote_num_tokens} tokens but this prompt "
                        f"has {num_prompt_tokens}: send the same prompt to both")
            num_blocks = -(-num_prompt_tokens // self.block_size)
            if len(params.remote_block_ids) != num_blocks:
                return (f"remote_block_ids has {len(params.remote_block_ids)} blocks, the prompt "
                        f"needs {num_blocks} of {self.block_size} tokens: the two engines' "
                        f"--block-size differ")
            return self._check_group_blocks(params)
        return None

    def _window_blocks(self, num_tokens: int) -> list[tuple[int, int]]:
        """Per KV cache group after the first, (first, end) block indices of a prompt of
        ``num_tokens`` tokens that the first query after it sees."""
        end = -(-num_tokens // self.block_size)
        return [(first_block_in_window(w, num_tokens, block_size=self.block_size), end)
                for w in self.group_windows[1:]]

    def _check_group_blocks(self, params: KVTransferParams) -> str | None:
        got = [len(ids) for ids in params.remote_group_block_ids]
        want = [end - first for first, end in self._window_blocks(params.remote_num_tokens)]
        if got == want:
            return None
        windows = ", ".join("full" if w is None else f"window {w}" for w in self.group_windows)
        return (f"the producer sent blocks of {1 + len(got)} KV cache group(s) ({got} blocks "
                f"after the first group's), this consumer has {len(self.group_windows)} ({windows}; "
                f"{want} blocks expected): the two engines group their layers differently, "
                f"start both with the same model and --block-size")

    # ----- consumer -----

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens to load from the producer beyond the ``num_computed_tokens`` found in
        the local prefix cache, whether the load is asynchronous: always True here)."""
        params = seq.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return 0, False
        return max(0, params.remote_num_tokens - num_computed_tokens), True

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """``seq`` has blocks for all its tokens: record the load of its last
        ``num_external_tokens`` prompt tokens (whole blocks from the first uncached one)."""
        params = seq.kv_transfer_params
        assert params is not None and params.do_remote_prefill
        end = -(-params.remote_num_tokens // self.block_size)
        start = (params.remote_num_tokens - num_external_tokens) // self.block_size  # cached: whole blocks
        # a sliding group: the producer sent blocks first..end; those before start are cached
        # here too (the hybrid hit rule keeps the window before a hit)
        remote_groups, local_groups = [], []
        for (first, _), remote, table in zip(self._window_blocks(params.remote_num_tokens),
                                             params.remote_group_block_ids, seq.group_block_tables):
            begin = max(first, start)
            remote_groups.append(list(remote[begin - first:]))
            local_groups.append(list(table[begin:end]))
            assert None not in local_groups[-1], (seq.seq_id, table)
        self._meta.loads.append(LoadSpec(seq.request_id, params, list(params.remote_block_ids[start:end]),
                                         list(seq.block_table[start:end]), remote_groups,
                                         local_groups))

    def request_cancelled(self, seq: Sequence) -> None:
        """A loading ``seq`` was aborted: its pull must be dropped (blocks are freed now)."""
        self._meta.loads = [x for x in self._meta.loads if x.request_id != seq.request_id]
        self._meta.cancels.append(seq.request_id)

    # ----- producer -----

    def request_finished(self, seq: Sequence, reason: FinishReason) -> tuple[bool, KVTransferParams | None]:
        """(keep ``seq``'s blocks until the worker reports it sent, the params a consumer
        needs). Kept only for a prefill that ended on its length (``max_tokens=1``) with a
        token: an EOS, stop, abort or error leaves nothing to decode (vLLM's rule)."""
        params = seq.kv_transfer_params
        if (params is None or not params.do_remote_decode or reason is not FinishReason.LENGTH
                or seq.num_output_tokens == 0 or not seq.block_table):
            return False, None
        num_tokens = seq.num_prompt_tokens
        block_ids = list(seq.block_table[: -(-num_tokens // self.block_size)])
        # a sliding group: only the blocks the consumer's first query sees (module docstring)
        group_block_ids = [list(table[first:end]) for (first, end), table
                           in zip(self._window_blocks(num_tokens), seq.group_block_tables)]
        assert all(None not in ids for ids in group_block_ids), seq.group_block_tables
        self._meta.keeps.append(KeepSpec(seq.request_id, block_ids, group_block_ids))
        return True, KVTransferParams(
            do_remote_prefill=True, remote_host=self.host, remote_port=self.port,
            remote_request_id=seq.request_id, remote_block_ids=block_ids,
            remote_num_tokens=num_tokens, first_token_id=seq.token_ids[num_tokens],
            remote_group_block_ids=group_block_ids)

    def build_connector_meta(self) -> KVConnectorMetadata:
        """The changes since the last call (and forget them)."""
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta
