// The per-layer options both paged attention kernels take (gpt-oss), checked once per call:
// - sinks: float [H], one learned logit per query head added to each softmax's denominator only
//   (attention_tiles.h softmax_normalizer); held here as float32 for the call.
// - sliding_window = W > 0: a query at position p sees only the keys at positions (p - W, p]
//   (Hugging Face's sliding_window_overlay). The cache keeps every token; the window only masks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace atom_kernels {

struct AttentionOptions {
  at::Tensor sinks_f32;        // [H] float32 contiguous, or undefined
  int64_t sliding_window = 0;  // 0 = every key up to the query's position

  AttentionOptions(const char* op, const std::optional<at::Tensor>& sinks,
                   std::optional<int64_t> window, int64_t num_heads) {
    if (sinks.has_value() && sinks->defined()) {
      TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, op,
                  ": sinks must be one logit per query head, [", num_heads, "], got ",
                  sinks->sizes());
      sinks_f32 = sinks->to(at::kFloat).contiguous();
    }
    if (window.has_value()) {
      TORCH_CHECK(*window > 0, op, ": sliding_window must be a positive number of tokens, got ",
                  *window);
      sliding_window = *window;
    }
  }

  // [H] float32 logits, or nullptr without sinks.
  const float* sinks() const {
    return sinks_f32.defined() ? sinks_f32.data_ptr<float>() : nullptr;
  }
};

// The first key position a query at position pos sees under sliding_window (0 = no window).
inline int64_t first_visible_key(int64_t pos, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
}

}  // namespace atom_kernels
