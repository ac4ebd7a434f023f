// The parts the two delta-rule fused decode blocks share (`fused_decode_gdn.cpp`: Gated
// DeltaNet; `fused_decode_kda.cpp`: Kimi Delta Attention): their shapes, read from the states
// and checked; the input projections of a range of outputs; the conv update of a range of
// channels (a chain's row first copying its source slot's history); the L2 norm of q and k;
// the block norm of a row; the check of the slot indices.
//
// Glossary: B batch rows, H hidden, Hk / Hv key / value heads of Dk / Dv, KD = Hk Dk,
// VD = Hv Dv, CD = 2 KD + VD conv channels, K conv width, NIN projected values per row.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fused_decode.h"

namespace vllm_mamba {
namespace delta {

constexpr int64_t kMaxIn = 8;  // input projections at most
constexpr float kL2Eps = 1e-6f;

struct Dims {
  int64_t batch, hidden, k_heads, v_heads, dk, dv, key_dim, value_dim, conv_dim, kernel, nin;
};

// The shapes of a call (nin left to the block), checked: `params` holds `first_in` entries then
// one (weight, scale) pair per input projection (1 to kMaxIn), hidden (B, H), ssm_states
// (S, Hv, Dk, Dv) and conv_states (S, CD, K - 1) contiguous with CD = 2 Hk Dk + Hv Dv, Hv a
// multiple of Hk, slots (B,).
inline Dims check_dims(const at::Tensor& hidden, int64_t num_params, int64_t first_in,
                       const at::Tensor& conv_states, const at::Tensor& ssm_states,
                       const at::Tensor& slots) {
  TORCH_CHECK(num_params > first_in && (num_params - first_in) % 2 == 0 &&
                  (num_params - first_in) / 2 <= kMaxIn,
              "params must hold ", first_in, " entries and a (weight, scale) pair for each of 1 to ",
              kMaxIn, " input projections, got ", num_params, " entries");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.is_contiguous(),
              "ssm_states must be contiguous (S, Hv, Dk, Dv)");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.is_contiguous(),
              "conv_states must be contiguous (S, CD, K - 1)");
  Dims d{};
  d.batch = hidden.size(0);
  d.hidden = hidden.size(1);
  d.v_heads = ssm_states.size(1);
  d.dk = ssm_states.size(2);
  d.dv = ssm_states.size(3);
  d.value_dim = d.v_heads * d.dv;
  d.conv_dim = conv_states.size(1);
  d.kernel = conv_states.size(2) + 1;
  const int64_t keys2 = d.conv_dim - d.value_dim;  // 2 Hk Dk
  TORCH_CHECK(d.dk > 0 && d.dv > 0 && d.v_heads > 0 && keys2 > 0 && keys2 % (2 * d.dk) == 0,
              "conv_states must have 2 Hk Dk + Hv Dv channels (Dk, Dv from ssm_states)");
  d.k_heads = keys2 / (2 * d.dk);
  TORCH_CHECK(d.v_heads % d.k_heads == 0, "the value heads (", d.v_heads,
              ") must be a multiple of the key heads (", d.k_heads, ")");
  d.key_dim = d.k_heads * d.dk;
  TORCH_CHECK(conv_states.size(0) == ssm_states.size(0),
              "conv_states and ssm_states must have the same slots");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == d.batch, "state_indices must be (B,)");
  return d;
}

// Every entry of `slots` (int64) a slot of the states or PAD_SLOT_ID (-1).
inline void check_slots(const at::Tensor& slots, int64_t num_slots, const char* what) {
  const int64_t* p = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(p[i] >= -1 && p[i] < num_slots, what, "[", i, "] = ", p[i],
                " is neither a state slot (0 to ", num_slots - 1, ") nor -1 (padding)");
  }
}

// Outputs [lo, hi) of the concatenated input projections for every row (into io.proj, rows of
// d.nin): io.in_w[i] makes outputs [io.in_off[i], io.in_off[i + 1]) from io.xn.
template <typename D, typename Io>
void project_rows(const D& d, const Io& io, int64_t lo, int64_t hi) {
  for (int64_t i = 0; i < io.n_in; ++i) {
    const int64_t w0 = io.in_off[i];
    const int64_t r0 = std::max(lo, w0), r1 = std::min(hi, io.in_off[i + 1]);
    if (r0 < r1) {
      fused::gemv(io.in_w[i], io.xn, d.hidden, d.batch, r0 - w0, r1 - w0, io.proj + r0, d.nin);
    }
  }
}

// Conv + SiLU of channels [c0, c1) of batch row b (values in place in io.proj), shifting their
// histories into io.conv_states (a chain's row reads them from its source slot).
template <typename D, typename Io>
void conv_rows(const D& d, const float* conv_w, const Io& io, int64_t b, int64_t c0, int64_t c1) {
  float* v = io.proj + b * d.nin;
  const int64_t slot = io.slots[b], width = d.kernel - 1;
  auto* hist = slot >= 0 ? io.conv_states + slot * d.conv_dim * width : nullptr;
  const auto* from = hist && io.src_slots ? io.conv_states + io.src_slots[b] * d.conv_dim * width
                                          : hist;
  fused::conv_update(v, hist, conv_w, nullptr, d.kernel, c0, c1, true, from);
}

// dst (n,) = x * scale / sqrt(|x|^2 + eps).
inline void l2norm(const float* x, int64_t n, float scale, float* dst) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + kL2Eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = x[i] * r;
}

// The block norm of batch row b: io.xn[b] = rms_norm(io.hidden[b]) with norm_w.
template <typename D, typename Io>
void norm_row(const D& d, const float* norm_w, float eps, const Io& io, int64_t b) {
  fused::rms_norm_row(io.hidden + b * d.hidden, norm_w, d.hidden, eps, io.xn + b * d.hidden);
}

}  // namespace delta
}  // namespace vllm_mamba
