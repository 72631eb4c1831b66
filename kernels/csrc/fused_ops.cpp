// Fused elementwise ops of the Llama decoder (CPU, float32 or bfloat16): RMSNorm (with the
// residual add folded in, as vLLM's fused_add_rms_norm), SiLU-and-mul, and the rotary embedding
// applied in place to a fused qkv tensor. Each replaces a chain of 4-8 torch ops (one pass over
// memory and one dispatch instead of several); the math is that of the torch reference paths in
// atom.kernels.fused, which the tests compare against (and against float64).
//
// bfloat16 tensors are computed in float32 lanes (bf16 loads are exact) and rounded to bf16 once
// per output element, to nearest even (vec.h). The torch reference rounds after every op (HF's
// RMSNorm casts x * rsqrt(...) to bf16 and then multiplies by the bf16 weight, SiLU-and-mul
// rounds silu(gate) before the product): the kernels are at least as close to the exact result.
// The residual stream stays bf16: fused_add_rms_norm stores residual + x rounded to bf16 and
// normalizes that rounded sum, as the reference does.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace atom_kernels {
namespace {

using BF16 = c10::BFloat16;

// Rows per parallel chunk: about 16k elements, so small (decode) batches stay on one thread.
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

inline float to_f(float v) { return v; }
inline float to_f(BF16 v) { return static_cast<float>(v); }
template <typename T> inline T from_f(float v) { return static_cast<T>(v); }
// float32 rounded to T's precision (identity for float32): what a store and a load back give.
inline float round_to(float v, float*) { return v; }
inline float round_to(float v, BF16*) { return static_cast<float>(BF16(v)); }
#if ATOM_AVX2
inline __m256 round_to(__m256 v, float*) { return v; }
inline __m256 round_to(__m256 v, BF16*) { return round_bf16(v); }
#endif

// sum of x[i]^2 over one row of n
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float ss = 0.f;
  int64_t i = 0;
#if ATOM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  return ss;
}

// out[i] = w[i] * x[i] * inv over one row of n (one rounding to T)
template <typename T>
inline void scale_row(T* out, const T* x, const T* w, int64_t n, float inv) {
  int64_t i = 0;
#if ATOM_AVX2
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(load8(w + i), _mm256_mul_ps(load8(x + i), iv)));
#endif
  for (; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * (to_f(x[i]) * inv));
}

inline float rms_inverse(float sum_squares, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

// res[i] = round_T(res[i] + x[i]) over one row of n; returns the sum of the squares of the
// rounded sums
template <typename T>
inline float add_residual_row(T* res, const T* x, int64_t n) {
  float ss = 0.f;
  int64_t i = 0;
#if ATOM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = round_to(_mm256_add_ps(load8(res + i), load8(x + i)), res);
    store8(res + i, v);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < n; ++i) {
    const float v = round_to(to_f(res[i]) + to_f(x[i]), res);
    res[i] = from_f<T>(v);
    ss += v * v;
  }
  return ss;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1,
              name, ": expects a float32 or bfloat16 [T, N] tensor with contiguous rows");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, ": all tensors must share one dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

// Calls f with a null pointer of x's element type (float or c10::BFloat16).
template <typename F>
void dispatch_float_bf16(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) f(static_cast<float*>(nullptr));
  else f(static_cast<BF16*>(nullptr));
}

template <typename T>
void silu_and_mul_row(T* o, const T* gate, const T* up, int64_t n) {
  int64_t i = 0;
#if ATOM_AVX512
  // 16 lanes, and 1 / (1 + e^-g) by reciprocal estimate + Newton step instead of a division
  // (the division was a third of this loop's time)
  const __m512 one16 = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_mul_ps(g, reciprocal16(_mm512_add_ps(one16, e)));
    store16(o + i, _mm512_mul_ps(silu, load16(up + i)));
  }
#endif
#if ATOM_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));  // e^-g
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    store8(o + i, _mm256_mul_ps(silu, load8(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = to_f(gate[i]);
    o[i] = from_f<T>(g / (1.f + std::exp(-g)) * to_f(up[i]));
  }
}

// [x1, x2] * cos + [-x2, x1] * sin in place on one head, x1 = x[:half], x2 = x[half:]
template <typename T>
void rotate_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
#if ATOM_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + half + i);
    // separate products and sums (no FMA): the same float32 rounding as the torch reference
    const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(x1, load8(c + i)), _mm256_mul_ps(x2, load8(s + i)));
    const __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, load8(c + half + i)),
                                    _mm256_mul_ps(x1, load8(s + half + i)));
    store8(x + i, lo);
    store8(x + half + i, hi);
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[half + i]);
    x[i] = from_f<T>(x1 * to_f(c[i]) - x2 * to_f(s[i]));
    x[half + i] = from_f<T>(x2 * to_f(c[half + i]) + x1 * to_f(s[half + i]));
  }
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  check_same_dtype(x, weight, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "rms_norm: weight must be [N]");
  auto out = at::empty({rows, n}, x.options());
  dispatch_float_bf16(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * xs;
        scale_row(op + r * n, xr, wp, n, rms_inverse(sum_squares(xr, n), n, eps));
      }
    });
  });
  return out;
}

at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                              double eps) {
  check_rows(x, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  check_same_dtype(x, residual, "fused_add_rms_norm");
  check_same_dtype(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "fused_add_rms_norm: x and residual shapes differ");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(),
              "fused_add_rms_norm: weight must be [N]");
  auto out = at::empty({rows, n}, x.options());
  dispatch_float_bf16(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* res = rp + r * rs;
        const float ss = add_residual_row(res, xp + r * xs, n);
        scale_row(op + r * n, res, wp, n, rms_inverse(ss, n, eps));
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "silu_and_mul");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even (gate, up)");
  auto out = at::empty({rows, n}, x.options());
  dispatch_float_bf16(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_and_mul_row(op + r * n, xp + r * xs, xp + r * xs + n, n);
    });
  });
  return out;
}

void rotary_embedding_(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                       int64_t num_heads, int64_t num_kv_heads,
                       const std::optional<at::Tensor>& q_norm,
                       const std::optional<at::Tensor>& k_norm, double eps) {
  check_rows(qkv, "rotary_embedding_");
  check_rows(cos, "rotary_embedding_");
  check_rows(sin, "rotary_embedding_");
  check_same_dtype(qkv, cos, "rotary_embedding_");
  check_same_dtype(qkv, sin, "rotary_embedding_");
  const int64_t rows = qkv.size(0), head_dim = cos.size(1), half = head_dim / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == rows && head_dim % 2 == 0,
              "rotary_embedding_: cos and sin must be [T, D] with an even D");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rotary_embedding_: qkv must be [T, (H + 2 H_kv) * D]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
              "rotary_embedding_: give both q_norm and k_norm, or neither");
  if (q_norm) {
    for (const at::Tensor* w : {&*q_norm, &*k_norm}) {
      check_same_dtype(qkv, *w, "rotary_embedding_");
      TORCH_CHECK(w->numel() == head_dim && w->is_contiguous(),
                  "rotary_embedding_: q_norm and k_norm must be [D]");
    }
  }
  const int64_t heads = num_heads + num_kv_heads;  // queries, then keys; values untouched
  dispatch_float_bf16(qkv, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const T* qw = q_norm ? q_norm->data_ptr<T>() : nullptr;
    const T* kw = k_norm ? k_norm->data_ptr<T>() : nullptr;
    const float e = static_cast<float>(eps);
    const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
    at::parallel_for(0, rows, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          T* x = xp + r * xs + h * head_dim;
          if (qw != nullptr)  // QK-norm: rms_norm's math and rounding, then the rotation
            scale_row(x, x, h < num_heads ? qw : kw, head_dim,
                      rms_inverse(sum_squares(x, head_dim), head_dim, e));
          rotate_head(x, cp + r * cs, sp + r * ss, half);
        }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> logsumexp_argmax(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "logsumexp_argmax: expects a float32 [S, V] tensor with contiguous rows");
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
