"""atom: a data-parallel LLM serving engine (one EngineCore per rank, cross-rank prefill alignment).

``from atom import LLM, SamplingParams`` is the offline API (vLLM-shaped).
"""

import os

# Torch's OpenMP threads spin for a bounded time at a barrier, then sleep (libgomp reads this when
# torch is first imported, so it is set before any import of torch; EngineCore processes inherit
# it). Spinning keeps the threads awake across the ~150 parallel ops of a decode step: on an idle
# machine a step was 20-40% faster than with OMP_WAIT_POLICY=PASSIVE. libgomp's own default spin
# (300,000 rounds) is long enough that on cores shared with other processes a spinning thread
# burns the time slice its descheduled peer needs (a batch-64 step took 5.7 s instead of 0.63 s);
# 10,000 rounds bounds that waste. Set OMP_WAIT_POLICY=PASSIVE on a crowded machine (the test
# suite does). A value the user set wins. Measurements: docs/PERFORMANCE.md.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from atom.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from atom.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'atom' has no attribute {name!r}")
