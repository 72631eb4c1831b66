"""atom: a data-parallel LLM serving engine (one EngineCore per rank, cross-rank prefill alignment).

``from atom import LLM, SamplingParams`` is the offline API (vLLM-shaped).
"""

from atom.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from atom.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'atom' has no attribute {name!r}")
