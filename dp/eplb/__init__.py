"""atom.dp.eplb: expert-parallel load balancing (EPLB): the placement plan (``plan``, torch-free,
shared with the simulator)."""
