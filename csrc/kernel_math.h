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

// float32 <-> bfloat16 by bit operations (round to nearest even, NaN kept a quiet NaN), the
// values of c10's conversions but branch-free, so loops over bfloat16 rows vectorise (c10's
// `static_cast` between float and at::BFloat16 kept them scalar).
inline float load_f32(float v) { return v; }
inline float load_f32(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename S>
inline S store_as(float v);
template <>
inline float store_as<float>(float v) {
  return v;
}
template <>
inline at::BFloat16 store_as<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return at::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), at::BFloat16::from_bits());
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

// The index tensors of a varlen batch of B sequences, converted and checked: sequence b owns
// tokens [q[b], q[b + 1]) of `tokens` (never decreasing), its state slot s[b] is below
// `num_slots` (negative: padding), and has_init[b] says whether its slot holds a state.
struct VarlenBatch {
  at::Tensor qsl, slots, init;  // keep the converted copies alive
  const int64_t* q;
  const int64_t* s;
  const bool* has_init;
  int64_t seqs;
};

inline VarlenBatch varlen_batch(const at::Tensor& query_start_loc,
                                const at::Tensor& state_indices,
                                const at::Tensor& has_initial_state, int64_t tokens,
                                int64_t num_slots) {
  VarlenBatch v{as_index(query_start_loc), as_index(state_indices),
                has_initial_state.to(at::kBool).contiguous(), nullptr, nullptr, nullptr, 0};
  v.seqs = v.slots.numel();
  TORCH_CHECK(v.qsl.numel() == v.seqs + 1 && v.init.numel() == v.seqs,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  v.q = v.qsl.data_ptr<int64_t>();
  v.s = v.slots.data_ptr<int64_t>();
  v.has_init = v.init.data_ptr<bool>();
  TORCH_CHECK(v.q[0] >= 0 && v.q[v.seqs] <= tokens, "query_start_loc beyond the tokens");
  for (int64_t b = 0; b < v.seqs; ++b) {
    TORCH_CHECK(v.q[b + 1] >= v.q[b], "query_start_loc must not decrease");
    TORCH_CHECK(v.s[b] < num_slots, "state index ", v.s[b], " outside the state slots");
  }
  return v;
}

}  // namespace vllm_mamba
