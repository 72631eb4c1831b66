// The ops of an ISA variant of the kernels (tests/kernels/isa_variants.py; kernels/build.py's
// Variant): the fused MoE and the paged decode attention, built with fewer ISA extensions than
// the CPU has, registered as torch.ops.<variant>.*. The build's -Datom_kernels=<variant> renames
// the C++ namespace, and through ATOM_LIBRARY this file's op namespace too (TORCH_LIBRARY
// stringifies its argument without expanding it). The schemas are bindings.cpp's (a test checks
// that they stay the same).
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#define ATOM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define ATOM_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace atom_kernels {

// The paths this build compiled (vec.h's macros): 1 AVX2 + FMA, 2 AVX-512 F/BW/VL, 4 AVX512-BF16.
int64_t compiled_isa() { return ATOM_AVX2 | ATOM_AVX512 << 1 | ATOM_AVX512_BF16 << 2; }

}  // namespace atom_kernels

ATOM_LIBRARY(atom_kernels, m) {
  m.def("paged_decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor? sinks=None, "
        "int? sliding_window=None, Tensor? key=None, Tensor? value=None, "
        "Tensor? slot_mapping=None) -> Tensor");
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor ids, Tensor gates) -> Tensor");
  m.def("compiled_isa() -> int", &atom_kernels::compiled_isa);
}

ATOM_LIBRARY_IMPL(atom_kernels, CPU, m) {
  m.impl("paged_decode_attention", &atom_kernels::paged_decode_attention);
  m.impl("fused_moe", &atom_kernels::fused_moe);
}
