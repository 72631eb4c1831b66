"""The compiled kernels for the kernel tests: a kernel that did not build fails, it never skips.

The tests skip only where the kernels cannot exist (``toolchain.why_kernels_cannot_exist``:
``ATOM_DISABLE_CPP_KERNELS`` set, no C++ compiler, no ninja). A build that fails for any other
reason (a compile error, a library that does not load, a build lock never released) fails every
test that takes ``ops``, with the reason ``cpu_ops`` gives, which names the compiler log.
"""

from __future__ import annotations

import pytest

from atom.kernels import cpu_ops
from tests.kernels.toolchain import why_kernels_cannot_exist


@pytest.fixture(scope="session")
def ops() -> cpu_ops.CpuOps:
    """``cpu_ops.load()``; skips where the kernels cannot exist, fails where they should."""
    reason = why_kernels_cannot_exist()
    if reason is not None:
        pytest.skip(f"the C++ kernels cannot exist here: {reason}")
    loaded = cpu_ops.load()
    if loaded is None:
        pytest.fail(f"the C++ kernels did not load although a compiler and ninja are present: "
                    f"{cpu_ops.unavailable_reason()}", pytrace=False)
    return loaded
