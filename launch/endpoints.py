"""ZMQ endpoints exchanged through the rendezvous store (never hard-coded: docs/ARCHITECTURE.md, "Rules").

A process that binds a socket publishes the address it actually got (``tcp://host:port`` after
binding port 0, or an ``ipc://`` path) under a key; the processes that connect look it up,
waiting until it appears. The store is the rendezvous ``TCPStore`` every rank already reaches
(``DPGroups.store``: the launcher's store under a launcher), so this
works across nodes with nothing but ``MASTER_ADDR:MASTER_PORT`` known in advance.

**Reachable endpoints only.** Both sides take the deployment's ``MASTER_ADDR``: when it is not
loopback the peers may be on other hosts, so an endpoint on loopback (``tcp://127.x``,
``tcp://localhost``) or a local-only transport (``ipc://``, ``inproc://``) is refused with a
``ValueError`` naming the key, at publish time and again at lookup (a publisher that bypassed the
check, e.g. a node started with a loopback ``--master-addr``, still fails its peers at once
rather than leaving them connected to nothing). With a loopback ``MASTER_ADDR`` every node is
this machine, and any endpoint goes.

Values are UTF-8 bytes, never pickle. Keys live under ``atom/endpoint/`` so they cannot collide
with torch's rendezvous keys (``atom/torch/...``) or the launcher's (``atom/launch/...``).

This lives in ``atom.launch`` (not ``atom.dp``) because it is process wiring, like the store
itself; the EngineCore start-up code in ``atom.entrypoints`` calls it.
"""

from __future__ import annotations

import datetime
import re

import torch.distributed as dist

from atom.dp.node_address import is_loopback

KEY_PREFIX = "atom/endpoint/"
_ADDRESS = re.compile(r"^(tcp|ipc|inproc)://\S+$")
_KEY = re.compile(r"^[A-Za-z0-9_.\-/]+$")
_TCP_HOST = re.compile(r"^tcp://(\[[^\]]*\]|[^:/]+)")


def endpoint_key(key: str) -> str:
    """The store key for endpoint ``key`` (e.g. ``"engine_core/3/input"``).

    Raises:
        ValueError: ``key`` is empty or has characters other than letters, digits, ``_ . - /``.
    """
    if not _KEY.match(key):
        raise ValueError(f"endpoint key {key!r}: use letters, digits and _ . - / only "
                         f"(e.g. 'engine_core/0/input')")
    return KEY_PREFIX + key


def check_reachable(address: str, *, key: str, master_addr: str) -> None:
    """Refuse an endpoint that peers on other hosts cannot reach (module docstring).

    Raises:
        ValueError: ``master_addr`` is not loopback and ``address`` is on loopback or is an
            ``ipc://`` / ``inproc://`` endpoint; the message says what to change.
    """
    if is_loopback(master_addr):
        return
    match = _TCP_HOST.match(address)
    local = match is None or is_loopback(match.group(1).strip("[]"))
    if local:
        raise ValueError(f"endpoint {address!r} for {key!r} is local to one host, but "
                         f"MASTER_ADDR={master_addr} is not loopback, so the ranks that connect "
                         f"to it may be on other hosts: bind the node's address on the route to "
                         f"MASTER_ADDR (atom.dp.node_address.route_source_address), and start "
                         f"every node with the same, reachable --master-addr")


def publish_endpoint(store: dist.Store, key: str, address: str, *, master_addr: str) -> None:
    """Publish ``address`` (a ZMQ endpoint) under ``key``; a later publish replaces it.

    ``master_addr``: the deployment's ``MASTER_ADDR`` (:func:`check_reachable`).

    Raises:
        ValueError: ``address`` is not ``tcp://...``, ``ipc://...`` or ``inproc://...``, or
            ``key`` is malformed (:func:`endpoint_key`), or ``address`` is not reachable from
            other hosts while ``master_addr`` says they may be elsewhere
            (:func:`check_reachable`). Publish the address the socket actually bound
            (``socket.getsockopt(zmq.LAST_ENDPOINT)``), not a wildcard request.
    """
    if not isinstance(address, str) or not _ADDRESS.match(address):
        raise ValueError(f"endpoint {address!r} for {key!r}: expected a ZMQ address such as "
                         f"'tcp://10.0.0.1:5555' or 'ipc:///tmp/atom-0'")
    if address.startswith("tcp://") and re.match(r"^tcp://(\*|0\.0\.0\.0)[:/]", address):
        raise ValueError(f"endpoint {address!r} for {key!r} is a wildcard bind address: publish "
                         f"a host the other processes can reach (e.g. MASTER_ADDR or this "
                         f"node's IP)")
    check_reachable(address, key=key, master_addr=master_addr)
    store.set(endpoint_key(key), address.encode("utf-8"))


def lookup_endpoint(store: dist.Store, key: str, *, timeout_s: float, master_addr: str) -> str:
    """The address published under ``key``, waiting up to ``timeout_s`` for it to appear.

    ``master_addr``: this rank's ``MASTER_ADDR`` (:func:`check_reachable`).

    Raises:
        ValueError: ``timeout_s`` is not positive, ``key`` is malformed, or the published
            address is not reachable from this host while ``master_addr`` is not loopback.
        TimeoutError: nothing was published under ``key`` within ``timeout_s`` (the process
            that owns the socket has not started, failed before binding, or uses another key).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: it must be a positive number of seconds")
    full_key = endpoint_key(key)
    try:
        store.wait([full_key], datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:  # the store's wait timeout (a RuntimeError subclass)
        raise TimeoutError(f"no ZMQ endpoint was published under {full_key!r} within "
                           f"{timeout_s:g}s: has the process that binds it started? ({e})") from e
    address = store.get(full_key).decode("utf-8")
    check_reachable(address, key=key, master_addr=master_addr)
    return address
