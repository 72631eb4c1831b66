"""atom.core: torch-free bookkeeping of one rank (sequences, KV blocks, scheduler, n-gram
proposer, the scheduler side of the KV connector). Imports nothing from ``atom.worker`` or
``atom.engine``, and no torch."""
