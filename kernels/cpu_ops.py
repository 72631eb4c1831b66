"""The compiled CPU kernels (``kernels/csrc``), loaded from where the set-up built them.

``make setup`` builds them once (``python -m atom.kernels.build``: the root folder, the key, the
lock and the layout are described there; ``$ATOM_KERNELS_DIR`` moves the root). :func:`load`,
called once per process when the model runner starts (never on the request path), loads the
library of the current key with ``torch.ops.load_library`` and compiles nothing. Only when that
library is missing (``kernels/csrc`` edited after set-up, a checkout never set up) does it build
it, by running ``python -m atom.kernels.build --exit-with-parent`` in a session of its own (so a
killed engine leaves no compiler behind), for at most :data:`~atom.kernels.build.BUILD_TIMEOUT_S`
seconds; the build's console lines go to this process's stderr.

:func:`load` returns None, logging one WARNING that says why, and callers use the torch paths
(attention, norms, rotary, SiLU, sampling helpers), when:

- ``ATOM_DISABLE_CPP_KERNELS`` is set (to anything but ``""`` or ``"0"``);
- there is no C++ compiler or no ninja (the key names the compiler);
- the build of this key failed, at set-up or here: later starts do not retry (the warning names
  the compiler log; ``python -m atom.kernels.build`` retries);
- the build did not finish in time, or the library does not load.

:func:`unavailable_reason` gives that reason (the kernel tests fail with it).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

import torch

from atom.kernels import build

logger = logging.getLogger(__name__)

OP_NAMES = ("paged_decode_attention", "paged_prefill_attention_", "rms_norm",
            "fused_add_rms_norm", "silu_and_mul", "rotary_embedding_", "logsumexp_argmax",
            "gguf_linear",
            "gguf_gemm_tiled", "gguf_gemm_tiled_is_simd", "llama_decode_layer_", "fused_moe",
            "fused_moe_is_simd", "fused_moe_packed", "fused_moe_packed_is_available", "small_linear")


class CpuOps:
    """The compiled ops as attributes: ``ops.rms_norm(x, weight, eps)`` and the others of
    :data:`OP_NAMES` (arguments as declared in ``kernels/csrc/ops.h``; schemas in
    ``bindings.cpp``).

    Each attribute is the ``torch.ops.atom_kernels.<name>.default`` overload, looked up once.
    A call goes through torch's dispatcher: about 2-3 µs on a tiny tensor, 1-1.7 µs more than
    the pybind11 module this replaced (measured on a 2-core AVX2 machine); a decode step of the
    embedded model makes about 150 calls, so about 0.2 ms more per step.
    """

    def __init__(self, library: os.PathLike | str):
        """Load ``library`` into this process (once: a second library for the same namespace
        would be rejected by torch).

        Raises:
            OSError: the shared object does not load.
            RuntimeError: torch rejects its registrations.
        """
        torch.ops.load_library(str(library))
        for name in OP_NAMES:
            setattr(self, name, getattr(torch.ops.atom_kernels, name).default)


@functools.cache
def _load() -> tuple[CpuOps | None, str | None]:
    ops, reason = _find_or_build()
    if reason is not None:
        logger.warning("%s: using the torch paths (attention, norms, rotary, SiLU, sampling "
                       "helpers)", reason)
    return ops, reason


def _find_or_build() -> tuple[CpuOps | None, str | None]:
    if os.environ.get("ATOM_DISABLE_CPP_KERNELS", "0") not in ("", "0"):
        return None, "ATOM_DISABLE_CPP_KERNELS is set"
    try:
        kb = build.current()
    except build.ToolchainMissing as exc:
        return None, f"the C++ CPU kernels cannot be built here ({exc})"
    if not kb.library.exists():
        if kb.failed_marker.exists():
            return None, (f"the C++ CPU kernels failed to build (compiler output: {kb.log}; "
                          f"`python -m atom.kernels.build` tries again)")
        problem = _build_in_subprocess(kb)
        if problem is not None:
            return None, problem
    try:
        return CpuOps(kb.library), None
    except (OSError, RuntimeError) as exc:
        return None, f"the C++ CPU kernels in {kb.library} do not load ({exc})"


@functools.cache  # the kernels' callers ask at every op: one cache lookup
def load() -> CpuOps | None:
    """The compiled ops, or None (the reason logged once at WARNING; see the module docstring).

    Cached per process. Raises nothing of its own: every failure is a None. An exception raised
    by a signal handler while a build runs (the engine core's SIGTERM) propagates once the
    build's process group is killed.
    """
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why :func:`load` returns None (None when it returns the ops)."""
    return _load()[1]


def _build_in_subprocess(kb: build.KernelBuild) -> str | None:
    """Run the build of ``kb`` in a session of its own; None once ``kb.library`` exists, else
    why not."""
    proc = subprocess.Popen([sys.executable, "-m", "atom.kernels.build", "--exit-with-parent"],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        returncode = proc.wait(timeout=build.BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return (f"the build of the C++ CPU kernels (pid {proc.pid}) did not finish in "
                f"{build.BUILD_TIMEOUT_S:.0f} s")
    finally:
        if proc.poll() is None:  # timed out, or we are being stopped: take its compilers along
            build.stop_build_group(proc.pid)
            proc.wait()
    if kb.library.exists():
        return None
    if kb.failed_marker.exists():
        return f"the C++ CPU kernels failed to build (compiler output: {kb.log})"
    return (f"`python -m atom.kernels.build` exited with status {returncode} and built no "
            f"{kb.library}")
