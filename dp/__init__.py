"""atom.dp: everything that spans ranks (process groups, per-tick sync, PrefillDelayer, DP engine loop, EP collectives, DP front end).

Modules: ``groups`` (rank contract, process groups), ``collectives`` (the only way to issue a
collective; lockstep check) with ``collective_log``, ``sync`` (the per-tick control and
batch-shape vectors), ``prefill_delayer`` (cross-rank prefill alignment). Nothing is imported
here so that ``import atom.dp`` stays cheap; import the modules themselves.
"""
