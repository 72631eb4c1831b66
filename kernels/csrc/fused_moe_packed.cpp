// The routed experts of a MoE layer on weights packed once at load for oneDNN's brgemm
// micro-kernel (bfloat16): what fused_moe.cpp computes, for CPUs with AMX tiles.
//
// Why a second layout: AMX multiplies 16 x 32 bf16 tiles of A by 16 x 32 tiles of B stored as
// pairs along K (VNNI: element (k, n) at [k / 2][n][k % 2]), so the weights are stored that way
// once and brgemm runs on them as they are. SGLang's CPU MoE (sgl-kernel/csrc/cpu/moe.cpp) and
// vLLM's CPU build use the same micro-kernel through PyTorch (at::native::cpublas::brgemm,
// oneDNN's ukernel API); a tile pays off once an expert has a few tokens, so like SGLang an
// expert with at most `max_small_tokens` tokens (decode) runs a VDPBF16PS kernel on the same
// packed blocks instead (broadcast one token's bf16 pair, 32 output columns in two registers),
// and one with more runs brgemm in blocks of 32 tokens.
//
// Layouts (bf16, contiguous; atom.kernels.moe.pack_experts builds them):
//   w13p [E, I / 16, H / 2, 32, 2]: block j holds gate columns 16j .. 16j+15 in its first 16
//        output columns and the matching up columns in its last 16, so silu(gate) * up of 16
//        intermediate columns comes out of one 32-column block;
//   w2p  [E, H / 32, I / 2, 32, 2]: block j holds output columns 32j .. 32j+31.
// H must be a multiple of 32 and I of 16.
//
// Passes (as fused_moe.cpp, so a token's sum comes out in the same order):
//   0. the pairs (token, expert) sorted by expert (counting sort); the rows of experts that take
//      the brgemm path gathered into one [pairs, H] buffer (brgemm reads A with one stride);
//   1. per (active expert, 16 intermediate columns): gate/up, silu-and-mul, the activations
//      [pairs, I] rounded to bf16 (as the unfused path rounds them);
//   2. per 32 output columns: every active expert's down projection of its activations, times
//      the token's gate, added into the float32 [T, H] sum (the block is the item's alone).
// Sums in float32 (AMX and VDPBF16PS both accumulate bf16 products in float32).
//
// Without AVX512-BF16 the kernels are not built (fused_moe_packed_is_available() is false; the
// layer keeps fused_moe.cpp). On a CPU with AVX512-BF16 and no AMX oneDNN runs the same brgemm
// calls on AVX-512 instructions: the tests run both paths there.

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "expert_pairs.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace atom_kernels {
namespace {

using BF16 = c10::BFloat16;

constexpr int kBlockN = 32;   // output columns of a packed block
constexpr int kBlockM = 32;   // tokens per brgemm call
constexpr int kSmallM = 4;    // tokens per pass of the small kernel

#if ATOM_AVX512_BF16

// c[m * 32 + n] = Σ_k a[m][k] · B(k, n) for m < MR, B one packed block [K / 2][32][2].
template <int MR>
inline void small_block(const BF16* const* a, const BF16* b, int64_t K, float* c) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k2 * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + k2 * 64 + 32);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, a[m] + 2 * k2, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], av, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], av, b1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(c + m * kBlockN, acc[m][0]);
    _mm512_storeu_ps(c + m * kBlockN + 16, acc[m][1]);
  }
}

// Runs small_block over `count` rows given by row(m), in passes of up to 4; f(m0, mr, c) after
// each pass with the pass's [mr, 32] sums.
template <typename Row, typename F>
inline void small_rows(int64_t count, const BF16* b, int64_t K, Row&& row, F&& f) {
  alignas(64) float c[kSmallM * kBlockN];
  const BF16* a[kSmallM];
  for (int64_t m0 = 0; m0 < count; m0 += kSmallM) {
    const int mr = static_cast<int>(std::min<int64_t>(kSmallM, count - m0));
    for (int m = 0; m < mr; ++m) a[m] = row(m0 + m);
    switch (mr) {
      case 4: small_block<4>(a, b, K, c); break;
      case 3: small_block<3>(a, b, K, c); break;
      case 2: small_block<2>(a, b, K, c); break;
      default: small_block<1>(a, b, K, c); break;
    }
    f(m0, mr, c);
  }
}

// Runs brgemm over `count` contiguous rows of a (stride lda) in blocks of 32 tokens; f(m0, mr, c)
// after each block with its [mr, 32] sums.
template <typename F>
inline void brgemm_rows(int64_t count, const BF16* a, int64_t lda, const BF16* b, int64_t K,
                        F&& f) {
  alignas(64) float c[kBlockM * kBlockN];
  for (int64_t m0 = 0; m0 < count; m0 += kBlockM) {
    const int64_t mr = std::min<int64_t>(kBlockM, count - m0);
    at::native::cpublas::brgemm(mr, kBlockN, K, lda, kBlockN, kBlockN, /*add_C=*/false,
                                a + m0 * lda, b, c, /*is_vnni=*/true);
    f(m0, static_cast<int>(mr), c);
  }
}

inline void silu_and_mul16(const float* c, BF16* out) {
  const __m512 g = _mm512_loadu_ps(c), up = _mm512_loadu_ps(c + 16);
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = _mm512_mul_ps(g, reciprocal16(_mm512_add_ps(_mm512_set1_ps(1.f), e)));
  const __m512 v = _mm512_mul_ps(silu, up);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}

// o[r] += g * y[r], the product rounded before the sum (fused_moe.cpp's add_weighted: a
// token's sum of two slots does not depend on which comes first).
__attribute__((optimize("fp-contract=off"))) void add_weighted32(float* o, float g,
                                                                const float* y) {
  for (int r = 0; r < kBlockN; ++r) o[r] += g * y[r];
}

void fused_moe_packed_impl(const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& w2p,
                           const at::Tensor& ids, const at::Tensor& gates, int64_t max_small,
                           at::Tensor& sum) {
  const int64_t T_ = x.size(0), H = x.size(1), k = ids.size(1);
  const int64_t E = w13p.size(0), I = w13p.size(1) * 16;
  const int64_t ldx = x.stride(0);
  const BF16* xp = x.data_ptr<BF16>();
  const BF16* w13 = w13p.data_ptr<BF16>();
  const BF16* w2 = w2p.data_ptr<BF16>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* gp = gates.data_ptr<float>();
  float* out = sum.data_ptr<float>();

  const ExpertPairs sorted(idp, T_ * k, E);
  const std::vector<int64_t>&offset = sorted.offset, &order = sorted.order, &active = sorted.active;
  const int64_t pairs = sorted.pairs;
  if (pairs == 0) return;
  bool any_tiles = false;
  for (int64_t e : active) any_tiles = any_tiles || sorted.count(e) > max_small;
  const int64_t num_active = static_cast<int64_t>(active.size());
  auto count_of = [&](int64_t e) { return sorted.count(e); };

  // 0. the rows of the brgemm experts, gathered in pair order
  at::Tensor rows_t = any_tiles ? at::empty({pairs, H}, x.options()) : at::Tensor();
  if (any_tiles) {
    BF16* rows = rows_t.data_ptr<BF16>();
    at::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        std::memcpy(rows + i * H, xp + order[i] / k * ldx, H * sizeof(BF16));
    });
  }
  const BF16* rows = any_tiles ? rows_t.data_ptr<BF16>() : nullptr;

  at::Tensor act_t = at::empty({pairs, I}, x.options());
  BF16* act = act_t.data_ptr<BF16>();

  // 1. gate/up and silu-and-mul: items (active expert) x (16 intermediate columns)
  const int64_t col_blocks = I / 16;
  at::parallel_for(0, num_active * col_blocks, 1, [&](int64_t begin, int64_t end) {
    bool used_tiles = false;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = active[item / col_blocks], j = item % col_blocks;
      const BF16* b = w13 + (e * col_blocks + j) * H * kBlockN;
      const int64_t first = offset[e], count = count_of(e);
      auto store = [&](int64_t m0, int mr, const float* c) {
        for (int m = 0; m < mr; ++m)
          silu_and_mul16(c + m * kBlockN, act + (first + m0 + m) * I + j * 16);
      };
      if (count > max_small) {
        brgemm_rows(count, rows + first * H, H, b, H, store);
        used_tiles = true;
      } else {
        small_rows(count, b, H, [&](int64_t m) { return xp + order[first + m] / k * ldx; },
                   store);
      }
    }
    if (used_tiles) at::native::cpublas::brgemm_release();
  });

  // 2. down, weighted and summed per token: items are blocks of 32 output columns
  const int64_t row_blocks = H / kBlockN;
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    bool used_tiles = false;
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t e : active) {
        const BF16* b = w2 + (e * row_blocks + j) * I * kBlockN;
        const int64_t first = offset[e], count = count_of(e);
        auto add = [&](int64_t m0, int mr, const float* c) {
          for (int m = 0; m < mr; ++m) {
            const int64_t p = order[first + m0 + m];
            add_weighted32(out + p / k * H + j * kBlockN, gp[p], c + m * kBlockN);
          }
        };
        if (count > max_small) {
          brgemm_rows(count, act + first * I, I, b, I, add);
          used_tiles = true;
        } else {
          small_rows(count, b, I, [&](int64_t m) { return act + (first + m) * I; }, add);
        }
      }
    }
    if (used_tiles) at::native::cpublas::brgemm_release();
  });
}

#endif  // ATOM_AVX512_BF16

}  // namespace

at::Tensor fused_moe_packed(at::Tensor x, at::Tensor w13p, at::Tensor w2p, at::Tensor ids,
                            at::Tensor gates, int64_t max_small_tokens) {
  TORCH_CHECK(fused_moe_packed_is_available(),
              "fused_moe_packed: this build has no AVX512-BF16 (use fused_moe and unpacked "
              "weights)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "fused_moe_packed: x must be a bfloat16 [T, H] tensor with contiguous rows");
  TORCH_CHECK(w13p.dim() == 5 && w2p.dim() == 5 && w13p.is_contiguous() && w2p.is_contiguous() &&
                  w13p.scalar_type() == at::kBFloat16 && w2p.scalar_type() == at::kBFloat16,
              "fused_moe_packed: w13p [E, I/16, H/2, 32, 2] and w2p [E, H/32, I/2, 32, 2] must "
              "be contiguous bfloat16 (atom.kernels.moe.pack_experts)");
  const int64_t E = w13p.size(0), I = w13p.size(1) * 16, H = x.size(1);
  TORCH_CHECK(w13p.size(2) * 2 == H && w13p.size(3) == 32 && w13p.size(4) == 2 &&
                  w2p.size(0) == E && w2p.size(1) * 32 == H && w2p.size(2) * 2 == I &&
                  w2p.size(3) == 32 && w2p.size(4) == 2,
              "fused_moe_packed: shapes x ", x.sizes(), ", w13p ", w13p.sizes(), ", w2p ",
              w2p.sizes(), " do not fit [T, H], [E, I/16, H/2, 32, 2], [E, H/32, I/2, 32, 2]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "fused_moe_packed: ids must be contiguous int64 [T, k]");
  TORCH_CHECK(gates.sizes() == ids.sizes() && gates.scalar_type() == at::kFloat &&
                  gates.is_contiguous(),
              "fused_moe_packed: gates must be contiguous float32 [T, k], as ids");
  TORCH_CHECK(max_small_tokens >= 0, "fused_moe_packed: max_small_tokens must be >= 0");
  at::Tensor sum = at::zeros({x.size(0), H}, x.options().dtype(at::kFloat));
#if ATOM_AVX512_BF16
  fused_moe_packed_impl(x, w13p, w2p, ids, gates, max_small_tokens, sum);
#endif
  return sum.to(at::kBFloat16);
}

bool fused_moe_packed_is_available() {
#if ATOM_AVX512_BF16
  // brgemm's VNNI path needs oneDNN on (torch.backends.mkldnn.enabled), else it raises
  return at::globalContext().userEnabledMkldnn();
#else
  return false;
#endif
}

}  // namespace atom_kernels
