"""A process that hangs while tearing down prints every thread's stack before the launcher's
SIGKILL (``dump_stacks_if_still_running``), and one that exits in time prints nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = ("import time; from atom.engine.core_proc import dump_stacks_if_still_running; "
          "dump_stacks_if_still_running(0.3); time.sleep({})")


@pytest.mark.parametrize("teardown_s, dumped", [(2.0, True), (0.0, False)])
def test_a_hung_teardown_prints_every_threads_stack(teardown_s, dumped):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(teardown_s)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("most recent call first" in done.stderr) == dumped, done.stderr
    assert "Traceback" not in done.stderr  # the launcher's logs are checked for tracebacks
