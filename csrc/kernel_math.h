// Torch-side helpers shared by the CPU kernels: dtype dispatch and parameter conversion. The
// scalar math (`exp_f32`, `silu_f32`, `softplus_f32`) is in `math.h`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "math.h"

namespace vllm_mamba {

// Channels handled together by one task of a kernel: the unit of vectorisation.
constexpr int64_t kBlock = 32;

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

// Calls `fn` with a null pointer of the element type of `t` (float or bfloat16).
template <typename Fn>
void dispatch_float_bf16(const at::Tensor& t, const char* what, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(static_cast<at::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, what, " must be float32 or bfloat16, got ", t.scalar_type());
  }
}

// Optional (D,) parameter as contiguous float32, or an undefined tensor.
inline at::Tensor optional_f32(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
}

// `(B,)` integer indices as contiguous int64 on the CPU.
inline at::Tensor as_index(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

}  // namespace vllm_mamba
