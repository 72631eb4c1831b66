// Python bindings of the atom_cpu_kernels extension (loaded by atom.kernels.cpu_ops).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace atom_kernels;
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention read in place from the paged KV cache (float32 output)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x in place, then RMSNorm of residual (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] float32 rows");
  m.def("rotary_embedding_", &rotary_embedding_,
        "Rotary embedding of the query and key heads of a fused qkv tensor, in place (float32)");
  m.def("logsumexp_argmax", &logsumexp_argmax,
        "Row-wise logsumexp and first argmax of float32 [S, V] (sampling)");
}
