"""Compiled CPU kernels (a torch C++ extension), built on first use.

The sources live in ``kernels/csrc``; :func:`load` compiles them with
``torch.utils.cpp_extension.load`` (g++ and ninja, about a minute on two cores) into torch's
extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and reuses the
build afterwards (rebuilt only when a source changes; concurrent processes wait on torch's build
lock). ``-march=native`` is safe because the build happens on the machine that runs it.

When the build is impossible (no compiler) or disabled with ``ATOM_DISABLE_CPP_KERNELS=1``,
:func:`load` returns None and callers use the torch path; the reason is logged once at WARNING.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib

logger = logging.getLogger(__name__)

_SOURCES = [pathlib.Path(__file__).parent / "csrc" / "paged_attention.cpp"]


@functools.cache
def load():
    """The compiled extension module (``paged_decode_attention``), or None if unavailable."""
    if os.environ.get("ATOM_DISABLE_CPP_KERNELS", "0") not in ("", "0"):
        logger.warning("ATOM_DISABLE_CPP_KERNELS is set: using the torch attention path")
        return None
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="atom_cpu_kernels", sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native"], verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler / failed build
        logger.warning("could not build the C++ CPU kernels (%s): using the torch attention path",
                       exc)
        return None
