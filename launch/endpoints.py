"""ZMQ endpoints exchanged through the rendezvous store (never hard-coded: docs/ARCHITECTURE.md, "Rules").

A process that binds a socket publishes the address it actually got (``tcp://host:port`` after
binding port 0, or an ``ipc://`` path) under a key; the processes that connect look it up,
waiting until it appears. The store is the rendezvous ``TCPStore`` every rank already reaches
(``DPGroups.store``: the launcher's store under a launcher), so this
works across nodes with nothing but ``MASTER_ADDR:MASTER_PORT`` known in advance.

Values are UTF-8 bytes, never pickle. Keys live under ``atom/endpoint/`` so they cannot collide
with torch's rendezvous keys (``atom/torch/...``) or the launcher's (``atom/launch/...``).

This lives in ``atom.launch`` (not ``atom.dp``) because it is process wiring, like the store
itself; the EngineCore start-up code in ``atom.entrypoints`` calls it.
"""

from __future__ import annotations

import datetime
import re

import torch.distributed as dist

KEY_PREFIX = "atom/endpoint/"
_ADDRESS = re.compile(r"^(tcp|ipc|inproc)://\S+$")
_KEY = re.compile(r"^[A-Za-z0-9_.\-/]+$")


def endpoint_key(key: str) -> str:
    """The store key for endpoint ``key`` (e.g. ``"engine_core/3/input"``).

    Raises:
        ValueError: ``key`` is empty or has characters other than letters, digits, ``_ . - /``.
    """
    if not _KEY.match(key):
        raise ValueError(f"endpoint key {key!r}: use letters, digits and _ . - / only "
                         f"(e.g. 'engine_core/0/input')")
    return KEY_PREFIX + key


def publish_endpoint(store: dist.Store, key: str, address: str) -> None:
    """Publish ``address`` (a ZMQ endpoint) under ``key``; a later publish replaces it.

    Raises:
        ValueError: ``address`` is not ``tcp://...``, ``ipc://...`` or ``inproc://...``, or
            ``key`` is malformed (:func:`endpoint_key`). Publish the address the socket
            actually bound (``socket.getsockopt(zmq.LAST_ENDPOINT)``), not a wildcard request.
    """
    if not isinstance(address, str) or not _ADDRESS.match(address):
        raise ValueError(f"endpoint {address!r} for {key!r}: expected a ZMQ address such as "
                         f"'tcp://10.0.0.1:5555' or 'ipc:///tmp/atom-0'")
    if address.startswith("tcp://") and re.match(r"^tcp://(\*|0\.0\.0\.0)[:/]", address):
        raise ValueError(f"endpoint {address!r} for {key!r} is a wildcard bind address: publish "
                         f"a host the other processes can reach (e.g. MASTER_ADDR or this "
                         f"node's IP)")
    store.set(endpoint_key(key), address.encode("utf-8"))


def lookup_endpoint(store: dist.Store, key: str, *, timeout_s: float) -> str:
    """The address published under ``key``, waiting up to ``timeout_s`` for it to appear.

    Raises:
        ValueError: ``timeout_s`` is not positive or ``key`` is malformed.
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
    return store.get(full_key).decode("utf-8")
