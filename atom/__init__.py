"""atom: a data-parallel LLM serving engine (one EngineCore per rank, cross-rank prefill alignment).

``from atom import LLM, SamplingParams`` is the offline API (vLLM-shaped).
"""

import os

# Torch's OpenMP threads sleep at barriers instead of spinning (libgomp reads this when torch is
# first imported, so it is set before any import of torch; EngineCore processes inherit it).
# On a CPU shared with other processes, spinning threads wait on a descheduled peer: a batch-64
# decode step measured 5.7 s spinning vs 0.63 s passive with 2 threads here (docs/PERFORMANCE.md).
# A value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from atom.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from atom.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'atom' has no attribute {name!r}")
