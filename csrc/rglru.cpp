// The RG-LRU recurrence on the CPU (RecurrentGemma's recurrent blocks), as the references in
// `vllm_mamba/ops/rglru.py`: `rglru_varlen` over packed prefill chunks (each from its slot's
// state, or a reset on a sequence's first token) and `rglru_update` for one token per row.
//
// Per channel: log_a = c * sigmoid(ga), a = exp(log_a), u = x * sigmoid(gx) * sqrt(1 -
// exp(2 log_a)), h = a * h + u (on a reset, h = x * sigmoid(gx)). The recurrence is diagonal,
// so the tasks are (sequence or row, block of kBlock channels), vectorised over the channels;
// a prefill task walks its chunk's tokens in order. Math is float32; x and the gates are
// float32 or bfloat16 (one dtype), the state float32, the output x's dtype.
//
// Glossary: T tokens, B sequences (or rows), L channels, S state slots.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernel_math.h"

namespace vllm_mamba {
namespace {

// The pointers and sizes one task reads.
template <typename T>
struct Rows {
  const T* x;      // (T, L)
  const T* gates;  // (T, 2L): [gx | ga]
  const float* c;  // (L,) log_a_scale
  float* h;        // (S, L)
  T* out;          // (T, L)
  int64_t width;   // L
};

// Advances channels [c0, c0 + n) of one state `h` over tokens [begin, end), the first one a
// reset when `reset`.
template <typename T>
void scan_block(const Rows<T>& r, float* h, int64_t begin, int64_t end, int64_t c0, int64_t n,
                bool reset) {
  const int64_t L = r.width;
  for (int64_t t = begin; t < end; ++t) {
    const T* x = r.x + t * L + c0;
    const T* gx = r.gates + t * 2 * L + c0;
    const T* ga = gx + L;
    T* out = r.out + t * L + c0;
    const float* c = r.c + c0;
    const bool first = reset && t == begin;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float gated = to_f32(x[i]) / (1.0f + exp_f32(-to_f32(gx[i])));
      const float log_a = c[i] / (1.0f + exp_f32(-to_f32(ga[i])));
      const float a = exp_f32(log_a);
      const float u = gated * std::sqrt(1.0f - exp_f32(2.0f * log_a));
      const float next = first ? gated : a * h[i] + u;
      h[i] = next;
      out[i] = static_cast<T>(next);
    }
  }
}

template <typename T>
Rows<T> rows_of(const at::Tensor& x, const at::Tensor& gates, const at::Tensor& c,
                at::Tensor& h_states, at::Tensor& out) {
  return {x.data_ptr<T>(), gates.data_ptr<T>(), c.data_ptr<float>(),
          h_states.data_ptr<float>(), out.data_ptr<T>(), x.size(1)};
}

void check(const at::Tensor& x, const at::Tensor& gates, const at::Tensor& c,
           const at::Tensor& h_states) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous (T, L)");
  TORCH_CHECK(gates.dim() == 2 && gates.size(0) == x.size(0) && gates.size(1) == 2 * x.size(1) &&
                  gates.is_contiguous(),
              "gates must be contiguous (T, 2L)");
  TORCH_CHECK(gates.scalar_type() == x.scalar_type(), "gates and x differ in dtype");
  TORCH_CHECK(c.numel() == x.size(1) && c.scalar_type() == at::kFloat && c.is_contiguous(),
              "log_a_scale must be contiguous float32 (L,)");
  TORCH_CHECK(h_states.dim() == 2 && h_states.size(1) == x.size(1) &&
                  h_states.scalar_type() == at::kFloat && h_states.is_contiguous(),
              "h_states must be contiguous float32 (S, L)");
}

at::Tensor rglru_varlen(const at::Tensor& x_in, const at::Tensor& gates_in,
                        const at::Tensor& log_a_scale, at::Tensor& h_states,
                        const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                        const at::Tensor& has_initial_state) {
  const at::Tensor x = x_in.contiguous(), gates = gates_in.contiguous();
  check(x, gates, log_a_scale, h_states);
  const VarlenBatch vb = varlen_batch(query_start_loc, state_indices, has_initial_state,
                                      x.size(0), h_states.size(0));
  const int64_t seqs = vb.seqs, L = x.size(1), blocks = (L + kBlock - 1) / kBlock;
  const int64_t* q = vb.q;
  const int64_t* s = vb.s;
  at::Tensor out = at::zeros_like(x);
  const bool* has_init = vb.has_init;
  dispatch_float_bf16(x, "x", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Rows<T> r = rows_of<T>(x, gates, log_a_scale, h_states, out);
    at::parallel_for(0, seqs * blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / blocks, c0 = (i % blocks) * kBlock;
        if (s[b] < 0 || q[b + 1] == q[b]) continue;  // padding, or no tokens
        const int64_t n = std::min(kBlock, L - c0);
        float* h = r.h + s[b] * L + c0;
        scan_block(r, h, q[b], q[b + 1], c0, n, !has_init[b]);
      }
    });
  });
  return out;
}

at::Tensor rglru_update(const at::Tensor& x_in, const at::Tensor& gates_in,
                        const at::Tensor& log_a_scale, at::Tensor& h_states,
                        const at::Tensor& state_indices) {
  const at::Tensor x = x_in.contiguous(), gates = gates_in.contiguous();
  check(x, gates, log_a_scale, h_states);
  const at::Tensor slots = as_index(state_indices);
  const int64_t rows = x.size(0), L = x.size(1), blocks = (L + kBlock - 1) / kBlock;
  TORCH_CHECK(slots.numel() == rows, "state_indices must be (B,)");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(s[b] < h_states.size(0), "state index ", s[b], " outside the state slots");
  }
  at::Tensor out = at::zeros_like(x);
  dispatch_float_bf16(x, "x", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Rows<T> r = rows_of<T>(x, gates, log_a_scale, h_states, out);
    at::parallel_for(0, rows * blocks, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / blocks, c0 = (i % blocks) * kBlock;
        if (s[b] < 0) continue;
        scan_block(r, r.h + s[b] * L + c0, b, b + 1, c0, std::min(kBlock, L - c0), false);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "rglru_varlen(Tensor x, Tensor gates, Tensor log_a_scale, Tensor(a!) h_states, "
      "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state) -> Tensor");
  m.def(
      "rglru_update(Tensor x, Tensor gates, Tensor log_a_scale, Tensor(a!) h_states, "
      "Tensor state_indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("rglru_varlen", &rglru_varlen);
  m.impl("rglru_update", &rglru_update);
}

}  // namespace vllm_mamba
