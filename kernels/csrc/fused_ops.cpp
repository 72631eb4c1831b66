// Fused elementwise ops of the Llama decoder (CPU, float32): RMSNorm (with the residual add
// folded in, as vLLM's fused_add_rms_norm), SiLU-and-mul, and the rotary embedding applied in
// place to a fused qkv tensor. Each replaces a chain of 4-8 torch ops (one pass over memory and
// one dispatch instead of several); the math is that of the torch reference paths in
// atom.kernels.fused, which the tests compare against.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>

namespace atom_kernels {
namespace {

// Rows per parallel chunk: about 16k elements, so small (decode) batches stay on one thread.
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// out[i] = w[i] * x[i] * rsqrt(mean(x^2) + eps) over one row of n.
inline void rms_norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#if ATOM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if ATOM_AVX2
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                            _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
#endif
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              name, ": expects a float32 [T, N] tensor with contiguous rows");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "rms_norm: weight must be float32 [N]");
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(op + r * n, xp + r * xs, wp, n, eps);
  });
  return out;
}

at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                              double eps) {
  check_rows(x, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "fused_add_rms_norm: x and residual shapes differ");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "fused_add_rms_norm: weight must be float32 [N]");
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = rp + r * rs;
      const float* xr = xp + r * xs;
      for (int64_t i = 0; i < n; ++i) res[i] += xr[i];
      rms_norm_row(op + r * n, res, wp, n, eps);
    }
  });
  return out;
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "silu_and_mul");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even (gate, up)");
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * xs;
      const float* up = gate + n;
      float* o = op + r * n;
      int64_t i = 0;
#if ATOM_AVX2
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));  // e^-g
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < n; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

void rotary_embedding_(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                       int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rotary_embedding_");
  check_rows(cos, "rotary_embedding_");
  check_rows(sin, "rotary_embedding_");
  const int64_t rows = qkv.size(0), head_dim = cos.size(1), half = head_dim / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == rows && head_dim % 2 == 0,
              "rotary_embedding_: cos and sin must be [T, D] with an even D");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rotary_embedding_: qkv must be [T, (H + 2 H_kv) * D]");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  const int64_t heads = num_heads + num_kv_heads;  // queries, then keys; values untouched
  at::parallel_for(0, rows, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * cs;
      const float* s = sp + r * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = xp + r * xs + h * head_dim;
        // [x1, x2] * cos + [-x2, x1] * sin, with x1 = x[:half], x2 = x[half:]
        int64_t i = 0;
#if ATOM_AVX2
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
          const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(x2, _mm256_loadu_ps(s + i)));
          const __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
          _mm256_storeu_ps(x + i, lo);
          _mm256_storeu_ps(x + half + i, hi);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] - x2 * s[i];
          x[half + i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> logsumexp_argmax(at::Tensor x) {
  check_rows(x, "logsumexp_argmax");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "logsumexp_argmax: rows must not be empty");
  auto lse = at::empty({rows}, x.options());
  auto ids = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      // Pass 1: the maximum and its first index (each lane keeps its first maximum; lanes are
      // merged by value, then by the smaller index, so ties resolve as torch.argmax does).
      float best = row[0];
      int64_t best_i = 0, i = 0;
#if ATOM_AVX2
      if (n >= 8) {
        __m256 vmax = _mm256_loadu_ps(row);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i cur = vidx;
        const __m256i step = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= n; i += 8) {
          cur = _mm256_add_epi32(cur, step);
          const __m256 v = _mm256_loadu_ps(row + i);
          const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
          vmax = _mm256_blendv_ps(vmax, v, gt);
          vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx),
                                                      _mm256_castsi256_ps(cur), gt));
        }
        alignas(32) float mv[8];
        alignas(32) int32_t mi[8];
        _mm256_store_ps(mv, vmax);
        _mm256_store_si256(reinterpret_cast<__m256i*>(mi), vidx);
        best = mv[0];
        best_i = mi[0];
        for (int l = 1; l < 8; ++l)
          if (mv[l] > best || (mv[l] == best && mi[l] < best_i)) { best = mv[l]; best_i = mi[l]; }
      }
#endif
      for (; i < n; ++i)
        if (row[i] > best) { best = row[i]; best_i = i; }
      // Pass 2: log(sum exp(x - max)) + max.
      float sum = 0.f;
      i = 0;
#if ATOM_AVX2
      const __m256 mb = _mm256_set1_ps(best);
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= n; i += 8)
        acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(row + i), mb)));
      sum = hsum(acc);
#endif
      for (; i < n; ++i) sum += std::exp(row[i] - best);
      lp[r] = best + std::log(sum);
      ip[r] = best_i;
    }
  });
  return {lse, ids};
}

}  // namespace atom_kernels
