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
