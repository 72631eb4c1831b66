"""Whether this machine and environment can have compiled kernels, decided without the code
under test (``shutil.which``), so that a kernel build that fails for any other reason fails the
tests instead of skipping them."""

from __future__ import annotations

import os
import shutil
import sys


def why_kernels_cannot_exist() -> str | None:
    """Why there are no compiled kernels here by design (disabled, no compiler, no ninja), or
    None when a build must succeed."""
    if os.environ.get("ATOM_DISABLE_CPP_KERNELS", "0") not in ("", "0"):
        return "ATOM_DISABLE_CPP_KERNELS is set"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    venv_bin = os.path.dirname(sys.executable)  # the ninja pip package installs here
    if shutil.which("ninja", path=os.pathsep.join([os.environ.get("PATH", ""), venv_bin])) is None:
        return "no ninja"
    return None
