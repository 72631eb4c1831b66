"""``atom`` command line whose DP rank 1 skips one batch-shape exchange (tests only).

Run under a launcher in place of the ``atom`` command::

    ATOM_TEST_SKIP_TICK=3 atom launch --nproc-per-node 2 tests/launch/skip_collective_rank.py generate ...

Rank 1 pretends the ``ATOM_TEST_SKIP_TICK``-th exchange (counted from 1) happened without
issuing the collective, as a rank with a bug would; every other process is the real command.
"""

from __future__ import annotations

import itertools
import os
import sys

import atom.dp.sync as sync
from atom.entrypoints.cli import main
from atom.entrypoints.launched import is_front_end

if os.environ.get("RANK") == "1" and not is_front_end():
    _skip_at = int(os.environ["ATOM_TEST_SKIP_TICK"])
    _calls = itertools.count(1)
    _real = sync.exchange_batch_shape

    def _skipping_exchange(shape, group, *, log=None):
        if next(_calls) == _skip_at:
            return sync.GatheredBatchShape.from_shapes([shape] * group.size())
        return _real(shape, group, log=log)

    sync.exchange_batch_shape = _skipping_exchange

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
