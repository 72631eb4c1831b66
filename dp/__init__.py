"""atom.dp: everything that spans ranks (process groups, per-tick sync, prefill policies, DP engine loop, EP collectives, DP front end).

Modules: ``rank_contract`` (the rank contract, torch-free), ``groups`` (process groups), ``collectives`` (the only way to issue a
collective; lockstep check) with ``collective_log``, ``sync`` (the per-tick control and
batch-shape vectors), ``prefill_policy`` (the cross-rank prefill policy interface, the
decode-protection interval, the decision counters) with ``prefill_delayer`` and
``prefill_coalescer``, ``dp_trace`` (the per-tick trace), ``dp_core_proc``
(the DP rank process and its lockstep loop: control sync, dummy batches, waves), ``router`` (the
DP request router) and ``dp_client`` (the front end's client over N rank processes). Nothing is imported
here so that ``import atom.dp`` stays cheap; import the modules themselves.
"""
