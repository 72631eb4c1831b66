"""atom.launch: the torchrun-style launcher (single/multi-node, rank env contract, failures).

Modules: ``launcher`` (``python -m atom.launch`` / ``atom launch``; its docstring is the env-var
contract), ``workers`` (local worker processes: process groups, stderr tee), ``rendezvous`` (the
launcher-hosted ``TCPStore``, node join, cross-node stop, exit barrier), ``env`` (worker side:
who launched me, which store to rendezvous through), ``errors`` (per-rank error files),
``endpoints`` (ZMQ endpoints through the store). Nothing is imported here so that
``import atom.launch`` stays cheap (no torch); import the modules themselves.
"""
