"""atom.engine: the front end's handle on the engine cores, and the core process itself.

Runs in the front-end process (``LLMEngine``, output processor, detokenizer, the core client
family, rank starters, liveness, KV event subscriber) and in each engine-core process
(``EngineCore`` and its busy loop). Imports ``atom.core`` and ``atom.worker``; never ``atom.dp``.
"""
