"""atom.benchmarks: the offline and serving benchmarks and the multi-node driver (``atom bench
...``; ``scripts/`` holds thin entry points to them)."""
