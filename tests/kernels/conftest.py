"""The compiled kernels for the kernel tests: a kernel that did not build fails, it never skips.

The tests skip only where the kernels cannot exist (``toolchain.why_kernels_cannot_exist``:
``ATOM_DISABLE_CPP_KERNELS`` set, no C++ compiler, no ninja). A build that fails for any other
reason (a compile error, a library that does not load, a build lock never released) fails every
test that takes ``ops``, with the reason ``cpu_ops`` gives, which names the compiler log; the
same for ``isa_variant`` (the paths other CPUs take, ``isa_variants.py``), which skips besides
only where this CPU cannot run the variant at all.
"""

from __future__ import annotations

import pytest

from atom.kernels import build, cpu_ops
from tests.kernels import isa_variants
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


@pytest.fixture(scope="session")
def isa_variant(ops):
    """``isa_variant(name)``: ``torch.ops.<variant>`` of ``isa_variants.VARIANTS[name]`` (built
    once per key), checked to have compiled the paths it names; skips where this CPU has no
    AVX-512 for a variant that needs it."""

    def get(name: str):
        spec = isa_variants.VARIANTS[name]
        if spec.needs_avx512 and not ops.fused_moe_is_simd():
            pytest.skip(f"{name}: this CPU has no AVX-512 (its own build runs the AVX2 path)")
        try:
            variant_ops = isa_variants.load(name)
        except (build.BuildError, OSError) as exc:  # OSError: TimeoutError, a bad library
            pytest.fail(f"the kernels' {name} variant did not build or load: {exc}",
                        pytrace=False)
        compiled = variant_ops.compiled_isa()
        assert compiled == spec.expected_isa, (
            f"{name} compiled the paths {compiled:#x}, not {spec.expected_isa:#x} "
            f"(isa_variant_bindings.cpp's bits)")
        return variant_ops

    return get
