"""The server's AsyncEngine on a real in-process engine: a utility call whose caller timed out
(a slow ``/metrics`` or ``/health`` scrape under load) is skipped, and the engine thread keeps
serving (it used to die of the cancelled future's InvalidStateError, taking the server down)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from atom.config import EngineConfig
from atom.engine.llm_engine import LLMEngine
from atom.entrypoints.openai.async_engine import AsyncEngine

RELEASE_TIMEOUT_S = 60.0  # liveness only


def test_a_call_whose_caller_timed_out_is_skipped_and_the_engine_lives_on():
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=16,
                                                max_model_len=256)))
    running, release = threading.Event(), threading.Event()

    def blocking(_engine) -> int:  # holds the engine thread until the test lets it go
        running.set()
        release.wait(RELEASE_TIMEOUT_S)
        return 1

    async def scenario() -> None:
        blocker = asyncio.ensure_future(engine.call(blocking))
        await asyncio.to_thread(running.wait, RELEASE_TIMEOUT_S)
        with pytest.raises(TimeoutError):  # queued behind the blocker: cancelled on timeout
            await engine.call(lambda e: e.get_stats(), timeout_s=0.05)
        release.set()
        assert await blocker == 1
        stats = await engine.call(lambda e: e.get_stats(), timeout_s=RELEASE_TIMEOUT_S)
        assert stats["num_total_blocks"] == 16

    try:
        asyncio.run(scenario())
        assert engine.dead_error is None
    finally:
        release.set()
        engine.shutdown()


def test_fail_open_requests_ends_open_streams_while_the_engine_thread_is_busy():
    """A launched front end whose ranks are being stopped: open streams end at once with the
    reason, even while the engine thread is held inside a call (a step waiting for ranks that
    are going away), and later requests are refused with it."""
    from atom.engine.core_client import EngineDeadError
    from atom.sampling_params import SamplingParams

    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=16,
                                                max_model_len=256)))
    running, release = threading.Event(), threading.Event()

    def blocking(_engine) -> None:
        running.set()
        release.wait(RELEASE_TIMEOUT_S)

    async def scenario() -> None:
        blocker = asyncio.ensure_future(engine.call(blocking))
        await asyncio.to_thread(running.wait, RELEASE_TIMEOUT_S)
        stream = engine.generate("r0", [1, 2, 3], SamplingParams(max_tokens=4))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request is submitted; the engine thread cannot see it
        engine.fail_open_requests("the ranks are stopping")
        with pytest.raises(EngineDeadError, match="the ranks are stopping"):
            await asyncio.wait_for(first, RELEASE_TIMEOUT_S)
        with pytest.raises(EngineDeadError, match="the ranks are stopping"):
            await engine.generate("r1", [1], SamplingParams(max_tokens=1)).__anext__()
        release.set()
        await blocker

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        engine.shutdown()
    assert "the ranks are stopping" in str(engine.dead_error)
