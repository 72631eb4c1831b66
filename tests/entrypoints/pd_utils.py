"""Helpers of the in-process P/D tests (test_pd_latent.py, test_pd_hybrid.py)."""

from __future__ import annotations

import time


def run_engines(engines, requests, *, check=None) -> dict:
    """Add ``requests`` ((engine, id, prompt, params, kv_transfer_params)) and step every
    engine until all are done (``check(engine)`` after each of its steps, when given);
    returns the finished outputs by id."""
    for engine, request_id, prompt, params, kv in requests:
        engine.add_request(request_id, prompt, params, kv_transfer_params=kv)
    finished = {}
    deadline = time.monotonic() + 60.0  # liveness only
    while len(finished) < len(requests):
        assert time.monotonic() < deadline, finished
        for engine in engines:
            if engine.has_unfinished_requests():
                finished.update((o.request_id, o) for o in engine.step() if o.finished)
                if check is not None:
                    check(engine)
    return finished
