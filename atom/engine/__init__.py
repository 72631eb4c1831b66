"""atom.engine: the front end's handle on the engine cores, and the core process itself.

Runs in the front-end process (``LLMEngine``, output processor, detokenizer, the core client
family, rank starters, liveness, KV event subscriber) and in each engine-core process
(``EngineCore`` and its busy loop). Imports ``atom.core`` and never ``atom.dp`` nor torch; the
torch worker is built in one function (``core_proc.build_engine_core``).
"""
