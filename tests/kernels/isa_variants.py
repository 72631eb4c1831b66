"""The kernels' paths that this CPU's own build does not take, built for the tests.

``kernels/build.py`` builds with ``-march=native``, so each CPU compiles (and the suite runs)
only the paths of the extensions it has: on an AVX512-BF16 CPU (Zen 4, Sapphire Rapids and
later) the fused MoE's AVX-512-without-BF16 and scalar dot products, the bfloat16 stores without
VCVTNEPS2BF16 and the whole-build scalar paged attention never run. Each variant here is
``fused_moe.cpp`` and ``paged_attention.cpp`` (and ``isa_variant_bindings.cpp``) built again
with ``-march=native`` plus flags that take extensions away, as a CPU without them would build
them:

- ``no_avx512bf16`` (``-mno-avx512bf16``): AVX-512 F/BW/VL without BF16 (Skylake-SP, Ice Lake):
  the fused MoE widens bf16 to float32 FMAs; attention's bf16 output is rounded by integers;
- ``scalar`` (``-mno-avx2``, which also takes AVX-512 away): no vector path at all.

A variant is a :class:`atom.kernels.build.Variant`: keyed, locked and laid out beside the main
library (``.venv/atom-kernels``), so it is built once per key (a few seconds: three sources, not
the main build's dozen) and every later session loads it.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import torch

from atom.kernels import build

BINDINGS = pathlib.Path(__file__).with_name("isa_variant_bindings.cpp")
SOURCES = (build.CSRC / "fused_moe.cpp", build.CSRC / "paged_attention.cpp", BINDINGS)

# compiled_isa()'s bits (isa_variant_bindings.cpp)
AVX2, AVX512, AVX512_BF16 = 1, 2, 4


@dataclasses.dataclass(frozen=True)
class IsaVariant:
    """A variant's build and the paths it must have compiled."""

    variant: build.Variant
    expected_isa: int  # compiled_isa() of the build on a CPU that has what it takes away
    needs_avx512: bool  # only a CPU with AVX-512 can run it (elsewhere: the native AVX2 path)


VARIANTS = {
    "no_avx512bf16": IsaVariant(
        build.Variant("atom_kernels_no_avx512bf16", SOURCES, ("-mno-avx512bf16",)),
        expected_isa=AVX2 | AVX512, needs_avx512=True),
    "scalar": IsaVariant(build.Variant("atom_kernels_scalar", SOURCES, ("-mno-avx2",)),
                         expected_isa=0, needs_avx512=False),
}


@functools.cache
def load(name: str):
    """``torch.ops.<variant>`` of variant ``name``, built first if needed (once per key; another
    process building it is waited for).

    Raises:
        build.ToolchainMissing: no compiler or no ninja.
        build.BuildError: the compiler failed (the message names its log).
        TimeoutError: another process's build of it held the lock too long.
    """
    kb = build.current(variant=VARIANTS[name].variant)
    library = build.build_library(kb)
    torch.ops.load_library(str(library))
    return getattr(torch.ops, kb.variant.name)
