"""atom.launch: the torchrun-style launcher (single and multi-node, rank env contract, failure reporting)."""
