"""EPLB's real MoE step before and after a rebalance (thin wrapper): the implementation is
atom/benchmarks/eplb.py (its docstring says what is measured). Run on a quiet machine:

    python scripts/bench_eplb.py --output-json results/bench_eplb.json
"""

import sys

from atom.benchmarks.eplb import main

if __name__ == "__main__":
    sys.exit(main())
