"""atom.core: torch-free bookkeeping of one rank (sequences, KV blocks, the scheduler and its
``update_from_output``, the worker's ``ModelRunnerOutput``, speculative statistics, the n-gram
proposer, the TBO split rule, the scheduler side of the KV connector). Imports nothing from
``atom.worker`` or ``atom.engine``, and no torch."""
