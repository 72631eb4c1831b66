// The routed experts of a MoE layer in one call (CPU, float32 or bfloat16): every local expert
// that got tokens runs its SiLU-gated MLP on them, weighted by the token's gate, summed per token.
// What vLLM's and SGLang's CPU backends do with their fused-experts kernels (vLLM
// csrc/cpu/moe, SGLang sgl-kernel/csrc/cpu/moe.cpp); this one is written for the shapes a decode
// step gives a MoE layer: few tokens per expert, so the time is the weights' bytes, and one small
// GEMM per expert (a oneDNN call of fixed cost each, about 40 µs for a 512 KB expert here) would
// cost more than reading them.
//
// The pairs (token, expert) are sorted by expert once (a counting sort). Two parallel passes then
// stream every active expert's weights once, in blocks of 8 rows that stay in L1 while every token
// of that expert goes past them, two tokens at a time:
//   1. gate/up: per (active expert, block of 4 intermediate columns), the 4 gate rows and the 4
//      up rows against the expert's tokens, silu(gate) * up written to the activations
//      [pairs, I] in the run dtype (the down projection's input, as the unfused path rounds it);
//   2. down: per block of 8 output columns, every expert's 8 down rows against its activations,
//      times the token's gate, added into a float32 [T, H] sum; the block is this item's alone,
//      so there are no races and no per-pair buffer.
// Pass 1's items go expert by expert, each thread taking a contiguous run: two long sequential
// streams (gate rows, up rows) per thread. Measured on the benchmark's expert shape (bf16, 2
// threads, 24 layers' weights in turn so none is cached; docs/PERFORMANCE.md): one token (4
// experts, 3 MB) 0.14 ms a layer, 22 GB/s, what a plain sum over memory reaches here; the other
// order (column block first) 0.19 ms, and software prefetches of the next block were slower in
// both orders.
//
// Dot products: AVX512-BF16's VDPBF16PS on bf16 pairs into float32 lanes (32 weights a step),
// else float32 FMAs on 16 lanes (bf16 widened exactly); the sums of 16 accumulators in one
// vector (dot_block.h). Without AVX-512 a scalar loop computes the same (fused_moe_is_simd is
// false there and atom.layers.moe keeps its per-expert path; the tests still run it).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "dot_block.h"
#include "expert_pairs.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace atom_kernels {
namespace {

using BF16 = c10::BFloat16;
using dot::dot_block;
using dot::kRows;
using dot::kTokens;
using dot::token_passes;

// The sums of a gate/up block (lanes m * 8 + c: gate column c for c < 4, up column c - 4 after)
// to silu(gate) * up in lanes m * 8 + c, c < 4 (the other lanes are left as garbage).
inline void silu_and_mul_sums(float* s) {
#if ATOM_AVX512
  const __m512 g = _mm512_loadu_ps(s);
  const __m512 up = _mm512_permutexvar_ps(
      _mm512_set_epi32(15, 14, 13, 12, 15, 14, 13, 12, 7, 6, 5, 4, 7, 6, 5, 4), g);
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = _mm512_mul_ps(g, reciprocal16(_mm512_add_ps(_mm512_set1_ps(1.f), e)));
  _mm512_storeu_ps(s, _mm512_mul_ps(silu, up));
#else
  for (int m = 0; m < kTokens; ++m)
    for (int c = 0; c < kRows / 2; ++c) {
      const float g = s[m * kRows + c];
      s[m * kRows + c] = g / (1.f + std::exp(-g)) * s[m * kRows + kRows / 2 + c];
    }
#endif
}

// o[r] += g * y[r], the product rounded before the sum (no FMA contraction): a token's sum of
// two slots is then the same whichever slot comes first, so it does not change when EPLB moves
// its experts to other slots or ranks (a fused multiply-add would round the two orders
// differently).
__attribute__((optimize("fp-contract=off"))) void add_weighted(float* o, float g, const float* y,
                                                              int64_t n) {
  for (int64_t r = 0; r < n; ++r) o[r] += g * y[r];
}

template <typename T>
void fused_moe_impl(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                    const at::Tensor& ids, const at::Tensor& gates, at::Tensor& sum) {
  const int64_t T_ = x.size(0), H = x.size(1), k = ids.size(1);
  const int64_t E = w13.size(0), I = w2.size(2);
  const int64_t ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* gp = gates.data_ptr<float>();
  float* out = sum.data_ptr<float>();

  const ExpertPairs sorted(idp, T_ * k, E);
  const std::vector<int64_t>&offset = sorted.offset, &order = sorted.order, &active = sorted.active;
  const int64_t pairs = sorted.pairs;
  if (pairs == 0) return;
  const int64_t num_active = static_cast<int64_t>(active.size());

  at::Tensor act_t = at::empty({pairs, I}, x.options());
  T* act = act_t.data_ptr<T>();

  // 1. gate/up and silu-and-mul: items (block of 4 intermediate columns) x (active expert)
  constexpr int kCols = kRows / 2;
  const int64_t col_blocks = (I + kCols - 1) / kCols;
  at::parallel_for(0, col_blocks * num_active, 1, [&](int64_t begin, int64_t end) {
    const T* w[kRows];
    const T* xr[kTokens];
    alignas(64) float s[16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = active[item / col_blocks], j0 = item % col_blocks * kCols;
      const int64_t cols = std::min<int64_t>(kCols, I - j0);
      const T* base = w13p + e * 2 * I * H;
      for (int r = 0; r < kCols; ++r) {  // rows past the end repeat the last (results unused)
        const int64_t j = j0 + std::min<int64_t>(r, cols - 1);
        w[r] = base + j * H;
        w[kCols + r] = base + (I + j) * H;
      }
      token_passes(offset[e + 1] - offset[e], [&](auto mr, int64_t m0) {
        constexpr int MR = decltype(mr)::value;
        for (int m = 0; m < MR; ++m) xr[m] = xp + order[offset[e] + m0 + m] / k * ldx;
        dot_block<MR>(xr, w, H, s);
        silu_and_mul_sums(s);
        for (int m = 0; m < MR; ++m) {
          T* a = act + (offset[e] + m0 + m) * I + j0;
          for (int c = 0; c < cols; ++c) a[c] = static_cast<T>(s[m * kRows + c]);
        }
      });
    }
  });

  // 2. down, weighted and summed per token: items are blocks of 8 output columns
  const int64_t row_blocks = (H + kRows - 1) / kRows;
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    const T* w[kRows];
    const T* ar[kTokens];
    alignas(64) float s[16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item * kRows, rows = std::min<int64_t>(kRows, H - n0);
      for (int64_t e : active) {
        for (int r = 0; r < kRows; ++r) w[r] = w2p + (e * H + n0 + std::min<int64_t>(r, rows - 1)) * I;
        token_passes(offset[e + 1] - offset[e], [&](auto mr, int64_t m0) {
          constexpr int MR = decltype(mr)::value;
          for (int m = 0; m < MR; ++m) ar[m] = act + (offset[e] + m0 + m) * I;
          dot_block<MR>(ar, w, I, s);
          for (int m = 0; m < MR; ++m) {
            const int64_t p = order[offset[e] + m0 + m];
            add_weighted(out + p / k * H + n0, gp[p], s + m * kRows, rows);
          }
        });
      }
    }
  });
}

}  // namespace

at::Tensor fused_moe(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor ids,
                     at::Tensor gates) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "fused_moe: x must be a float32 or bfloat16 [T, H] tensor with contiguous rows");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_moe: w13 [E, 2I, H] and w2 [E, H, I] must be contiguous, in x's dtype");
  const int64_t E = w13.size(0), I = w2.size(2), H = x.size(1);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "fused_moe: shapes x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ", w2.sizes(),
              " do not fit [T, H], [E, 2I, H], [E, H, I]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "fused_moe: ids must be contiguous int64 [T, k]");
  TORCH_CHECK(gates.sizes() == ids.sizes() && gates.scalar_type() == at::kFloat &&
                  gates.is_contiguous(),
              "fused_moe: gates must be contiguous float32 [T, k], as ids");
  at::Tensor sum = at::zeros({x.size(0), H}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    fused_moe_impl<float>(x, w13, w2, ids, gates, sum);
    return sum;
  }
  fused_moe_impl<BF16>(x, w13, w2, ids, gates, sum);
  return sum.to(at::kBFloat16);
}

bool fused_moe_is_simd() { return ATOM_AVX512; }

}  // namespace atom_kernels
