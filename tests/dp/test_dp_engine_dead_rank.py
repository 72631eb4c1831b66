"""With ``on_rank_failure="stop"``, a DP rank that dies surfaces as EngineDeadError in the
front end (never a hang), and shutdown still stops the surviving rank. (Recovery from a rank
failure: tests/entrypoints/test_rank_failure*.py.)"""

from __future__ import annotations

import time

import pytest

from atom import LLM, SamplingParams
from atom.engine.core_client import EngineDeadError



def test_killed_rank_raises_engine_dead_error():
    llm = LLM(data_parallel_size=2, dtype="float32", num_kv_blocks=32, max_model_len=256,
              num_threads=1, on_rank_failure="stop")
    procs = list(llm.engine.client.ranks.procs)
    try:
        procs[1].kill()
        procs[1].wait(timeout=30)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="dp rank 1"):
            llm.generate(["Hello"], SamplingParams(max_tokens=4), data_parallel_rank=0)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in procs), "a rank outlived shutdown"
