// Scalar math shared by the CPU kernels, written so that loops over channels auto-vectorise.
//
// `exp_f32` is a branch-free exp (Cody-Waite range reduction and a degree-7 polynomial,
// within a few float ulps of std::exp); it inlines into `#pragma omp simd` loops where
// std::exp would stay a scalar libm call (fmin/fmax/floor would too, without -ffast-math).
// softplus and SiLU follow torch's definitions. No torch header: the Arm kernel tests
// (`csrc/tests/`) build it without torch.
#pragma once

#include <cstdint>
#include <cstring>

namespace vllm_mamba {

// `c ? a : b` as bit operations on the floats, which vectorise at every ISA level.
inline float select_f32(bool c, float a, float b) {
  int32_t ai, bi;
  std::memcpy(&ai, &a, sizeof(ai));
  std::memcpy(&bi, &b, sizeof(bi));
  const int32_t m = -static_cast<int32_t>(c);  // all ones when c
  const int32_t r = (ai & m) | (bi & ~m);
  float f;
  std::memcpy(&f, &r, sizeof(f));
  return f;
}

inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // The clamp as bit selects: GCC's if-conversion leaves `?:` clamps feeding this arithmetic
  // as control flow below AVX-512 (no masks), which keeps the whole loop scalar; fmin/fmax
  // and floor do not vectorise without -ffast-math.
  x = select_f32(x < -87.33f, -87.33f, x);
  x = select_f32(x > 88.37f, 88.37f, x);
  const float k = (x * kLog2e + kRound) - kRound;
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

// log(1 + y) for y in [0, 1]: 2 atanh(s) with s = y / (2 + y) in [0, 1/3], as an odd series
// in s (truncation error below 2e-9 relative). Branch-free, so it vectorises.
inline float log1p_unit_f32(float y) {
  const float s = y / (2.0f + y);
  const float s2 = s * s;
  float p = 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return 2.0f * s * p;
}

// torch.nn.functional.softplus (beta 1, threshold 20) as max(x, 0) + log1p(exp(-|x|)); above
// the threshold the second term is below half an ulp of x, so the result is x as in torch.
inline float softplus_f32(float x) {
  const float pos = x > 0.0f ? x : 0.0f;
  const float neg_abs = x > 0.0f ? -x : x;
  return pos + log1p_unit_f32(exp_f32(neg_abs));
}

}  // namespace vllm_mamba
