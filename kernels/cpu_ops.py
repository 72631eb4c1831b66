"""Compiled CPU kernels (a torch C++ extension), built on first use.

The sources live in ``kernels/csrc`` (``ops.h`` lists the ops); :func:`load` compiles them with
``torch.utils.cpp_extension.load`` (g++ and ninja, about a minute on two cores) into torch's
extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and reuses the
build afterwards (rebuilt only when a source changes; concurrent processes wait on torch's build
lock). ``-march=native`` is safe because the build happens on the machine that runs it.

When the build is impossible (no compiler) or disabled with ``ATOM_DISABLE_CPP_KERNELS=1``,
:func:`load` returns None and callers use the torch path; the reason is logged once at WARNING.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp")]


@functools.cache
def load():
    """The compiled extension module, or None if unavailable.

    Its functions (declared in ``kernels/csrc/ops.h``): ``paged_decode_attention``,
    ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding_``,
    ``logsumexp_argmax``.
    """
    if os.environ.get("ATOM_DISABLE_CPP_KERNELS", "0") not in ("", "0"):
        logger.warning("ATOM_DISABLE_CPP_KERNELS is set: using the torch paths")
        return None
    from torch.utils import cpp_extension

    # torch rebuilds when a source or a flag changes, not a header: a digest of the headers rides
    # along as a define. -fopenmp: without it at::parallel_for runs on one thread.
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_CSRC.glob("*.h"))))
    try:
        return cpp_extension.load(
            name="atom_cpu_kernels", sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp",
                          f"-DATOM_HEADERS_DIGEST={headers.hexdigest()[:16]}"],
            extra_ldflags=["-fopenmp"], verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler / failed build
        logger.warning("could not build the C++ CPU kernels (%s): using the torch paths",
                       exc)
        return None
