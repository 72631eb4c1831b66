"""Multi-node benchmark driver (thin wrapper): the implementation is atom/benchmarks/multinode/,
so ``atom bench multinode ...`` and ``python scripts/multinode_bench.py ...`` are the same program.

Two network hosts on this machine (network namespaces; as root), two ranks in all::

    python scripts/multinode_bench.py --cluster scripts/clusters/netns_2x1.json \\
        --serve-args "--dtype float32 --num-kv-blocks 256" \\
        --bench-args "--num-prompts 32 --random-input-len 128 --random-output-len 32"

Run with ``--help`` for every flag; ``--method print`` shows each node's command.
"""

import sys

from atom.benchmarks.multinode import main

if __name__ == "__main__":
    sys.exit(main())
