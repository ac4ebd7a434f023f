// Scalar math shared by the CPU kernels, written so that loops over channels auto-vectorise.
//
// `exp_f32` is a branch-free exp (Cody-Waite range reduction and a degree-7 polynomial,
// within a few float ulps of std::exp); it inlines into `#pragma omp simd` loops where
// std::exp would stay a scalar libm call. softplus and SiLU follow torch's definitions.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vllm_mamba {

// Channels handled together by one task of a kernel: the unit of vectorisation.
constexpr int64_t kBlock = 32;

inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  x = std::fmin(std::fmax(x, -87.33f), 88.72f);
  const float k = std::floor(x * kLog2e + 0.5f);
  const float r = (x - k * kLn2Hi) - k * kLn2Lo;  // |r| <= ln(2) / 2
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float silu_f32(float x) { return x / (1.0f + exp_f32(-x)); }

// torch.nn.functional.softplus with beta 1 and threshold 20.
inline float softplus_f32(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

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
