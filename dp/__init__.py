"""atom.dp: everything that spans ranks (process groups, per-tick sync, PrefillDelayer, DP engine loop, EP collectives, DP front end).

Modules: ``rank_contract`` (the rank contract, torch-free), ``groups`` (process groups), ``collectives`` (the only way to issue a
collective; lockstep check) with ``collective_log``, ``sync`` (the per-tick control and
batch-shape vectors), ``prefill_delayer`` (cross-rank prefill alignment), ``engine_core_proc``
(the DP rank process and its lockstep loop: control sync, dummy batches, waves), ``router`` (the
DP request router) and ``dp_client`` (the front end's client over N rank processes). Nothing is imported
here so that ``import atom.dp`` stays cheap; import the modules themselves.
"""
