"""Offline throughput benchmark (thin wrapper): the implementation is atom/benchmarks/offline.py,
so ``atom bench offline ...`` and ``python scripts/bench_offline.py ...`` are the same program.

W1 (the default dataset): ``python scripts/bench_offline.py --max-tokens 128
--compare-hf``. Run with ``--help`` for every flag.
"""

import sys

from atom.benchmarks.offline import main

if __name__ == "__main__":
    sys.exit(main())
