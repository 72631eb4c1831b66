// x @ W.T (+ bias) for weights small enough that a oneDNN call's fixed cost (about 40 µs here)
// is more than the product itself: a MoE layer's router ([E, hidden], 64 KB for 32 experts of
// width 1024 in bf16) and the linears of tiny models. Blocks of 8 weight rows are spread over the
// threads only when there is enough weight to share (at least 64k elements a thread); each block
// stays in L1 while every activation row goes past it, two at a time (dot_block.h).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "dot_block.h"
#include "ops.h"

#include <algorithm>

namespace atom_kernels {
namespace {

template <typename T>
void small_linear_impl(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t blocks = (N + dot::kRows - 1) / dot::kRows;
  const int64_t grain = std::max<int64_t>(1, 65536 / (dot::kRows * std::max<int64_t>(K, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const T* wr[dot::kRows];
    const T* xr[dot::kTokens];
    alignas(64) float s[16];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * dot::kRows, rows = std::min<int64_t>(dot::kRows, N - n0);
      for (int r = 0; r < dot::kRows; ++r) wr[r] = wp + (n0 + std::min<int64_t>(r, rows - 1)) * K;
      dot::token_passes(M, [&](auto mr, int64_t m0) {
        constexpr int MR = decltype(mr)::value;
        for (int m = 0; m < MR; ++m) xr[m] = xp + (m0 + m) * ldx;
        dot::dot_block<MR>(xr, wr, K, s);
        for (int m = 0; m < MR; ++m)
          for (int r = 0; r < rows; ++r)
            op[(m0 + m) * N + n0 + r] = static_cast<T>(
                s[m * dot::kRows + r] + (bias != nullptr ? dot::to_f(bias[n0 + r]) : 0.f));
      });
    }
  });
}

}  // namespace

at::Tensor small_linear(at::Tensor x, at::Tensor weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "small_linear: x must be a float32 or bfloat16 [M, K] tensor with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "small_linear: weight must be contiguous [N, K] in x's dtype; got ", weight.sizes(),
              " ", weight.scalar_type(), " for x ", x.sizes(), " ", x.scalar_type());
  if (bias) {
    TORCH_CHECK(bias->numel() == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "small_linear: bias must be contiguous [N] in x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    small_linear_impl<float>(x, weight, bias ? bias->data_ptr<float>() : nullptr, out);
  } else {
    small_linear_impl<c10::BFloat16>(x, weight, bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
                                     out);
  }
  return out;
}

}  // namespace atom_kernels
