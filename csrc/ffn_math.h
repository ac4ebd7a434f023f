// The element-wise math of the gated feed-forward kernels (`fused_decode_ffn.cpp`,
// `moe_experts.cpp`): the activations by their codes (`ops.ffn.ACT_CODES`), the SwiGLU clip and
// `z = act(gate * gm) * up` over a range of channels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernel_math.h"

namespace vllm_mamba {
namespace ffn {

// Activations (`layers.mlp.ACTIVATIONS`): silu, gelu_pytorch_tanh, gelu (erf), relu, relu2.
enum Act : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kRelu = 3, kRelu2 = 4 };

inline float activate(float v, int64_t act) {
  switch (act) {
    case kSilu:
      return silu_f32(v);
    case kGeluTanh: {
      const float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + std::tanh(inner));
    }
    case kGelu:
      return 0.5f * v * (1.0f + std::erf(v * 0.7071067811865476f));
    case kRelu:
      return v > 0.0f ? v : 0.0f;
    default: {
      const float r = v > 0.0f ? v : 0.0f;
      return r * r;
    }
  }
}

// A SwiGLU clip (`layers.clamped_swiglu`): limit > 0 clips the up factor to +-limit and the
// gate to at most limit, before the activation (`before`) or after it; limit 0: none.
struct Clip {
  float limit = 0.0f;
  bool before = false;
};

// z[i] = act(g[i] * gm) * u[i] (clipped by `clip`) for channels [i0, i1).
inline void gated_row(const float* g, const float* u, float* z, int64_t i0, int64_t i1,
                      int64_t act, float gm, Clip clip) {
  if (clip.limit > 0.0f) {
    const float l = clip.limit;
    for (int64_t i = i0; i < i1; ++i) {
      const float gv = g[i] * gm;
      const float a = clip.before ? activate(std::min(gv, l), act) : std::min(activate(gv, act), l);
      z[i] = a * std::min(std::max(u[i], -l), l);
    }
  } else if (act == kSilu && gm == 1.0f) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) z[i] = silu_f32(g[i]) * u[i];
  } else {
    for (int64_t i = i0; i < i1; ++i) z[i] = activate(g[i] * gm, act) * u[i];
  }
}

}  // namespace ffn
}  // namespace vllm_mamba
