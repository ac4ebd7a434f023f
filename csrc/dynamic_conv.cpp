// A depthwise causal conv with per-token taps on the CPU (Inkling 2's key and value convs), as
// the references in `vllm_mamba/ops/dynamic_conv.py`: `dynamic_conv_varlen` over packed
// prefill chunks (each from its slot's history, or zeros) and `dynamic_conv_update` for one
// token per row.
//
// Token t's tap at lag l of channel c is `static_weight[l, c] + dynamic_taps[t, c / (C / Hc),
// l]`; y[t, c] sums the taps times x[t - l, c] in lag order. Tasks are (sequence or row, block
// of kBlock channels), vectorised over the channels: a task lays its slot's history and its
// tokens' inputs out as rows of one float32 buffer, then each token's output reads the K rows
// ending at its own. Math and the history are float32; x is float32 or bfloat16; the output is
// float32.
//
// Glossary: T tokens, B sequences (or rows), C channels, Hc heads of dynamic taps, K conv
// width, S state slots.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernel_math.h"

namespace vllm_mamba {
namespace {

// What every task reads and writes.
template <typename T>
struct Problem {
  const T* x;             // (T, C)
  const float* stat;      // (K, C)
  const float* dyn;       // (T, Hc, K)
  float* states;          // (S, C, K - 1)
  float* out;             // (T, C)
  int64_t channels, width, heads, per_head;
};

// Outputs of tokens [begin, end) for channels [c0, c0 + n) of one sequence, from `hist (n, K -
// 1)` (a slot's history rows, or nullptr for zeros); the slot's new history goes to `save`
// (nullptr: none). `ext` is scratch of (K - 1 + tokens) * n floats.
template <typename T>
void conv_block(const Problem<T>& p, const float* hist, float* save, int64_t begin, int64_t end,
                int64_t c0, int64_t n, std::vector<float>& ext) {
  const int64_t C = p.channels, K = p.width, H = K - 1, tokens = end - begin;
  ext.assign((H + tokens) * n, 0.0f);
  for (int64_t j = 0; j < H && hist != nullptr; ++j) {
    for (int64_t i = 0; i < n; ++i) ext[j * n + i] = hist[i * H + j];
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const T* x = p.x + (begin + t) * C + c0;
    float* row = ext.data() + (H + t) * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = to_f32(x[i]);
  }
  int64_t head_of[kBlock];  // each channel's row of dynamic taps
  for (int64_t i = 0; i < n; ++i) head_of[i] = (c0 + i) / p.per_head * K;
  for (int64_t t = 0; t < tokens; ++t) {
    float* out = p.out + (begin + t) * C + c0;
    const float* dyn = p.dyn + (begin + t) * p.heads * K;
    for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
    for (int64_t l = 0; l < K; ++l) {
      const float* stat = p.stat + l * C + c0;
      const float* in = ext.data() + (H + t - l) * n;
      for (int64_t i = 0; i < n; ++i) out[i] += (stat[i] + dyn[head_of[i] + l]) * in[i];
    }
  }
  if (save != nullptr) {
    for (int64_t j = 0; j < H; ++j) {
      const float* row = ext.data() + (tokens + j) * n;
      for (int64_t i = 0; i < n; ++i) save[i * H + j] = row[i];
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& stat, const at::Tensor& dyn,
           const at::Tensor& states) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous (T, C)");
  const int64_t C = x.size(1);
  TORCH_CHECK(stat.dim() == 2 && stat.size(1) == C && stat.size(0) >= 1,
              "static_weight must be (K, C)");
  const int64_t K = stat.size(0);
  TORCH_CHECK(dyn.dim() == 3 && dyn.size(0) == x.size(0) && dyn.size(2) == K &&
                  dyn.size(1) > 0 && C % dyn.size(1) == 0,
              "dynamic_taps must be (T, Hc, K) with C a multiple of Hc");
  TORCH_CHECK(states.dim() == 3 && states.size(1) == C && states.size(2) == K - 1 &&
                  states.scalar_type() == at::kFloat && states.is_contiguous(),
              "conv_states must be contiguous float32 (S, C, K - 1)");
}

template <typename T>
Problem<T> problem_of(const at::Tensor& x, const at::Tensor& stat, const at::Tensor& dyn,
                      at::Tensor& states, at::Tensor& out) {
  const int64_t heads = dyn.size(1);
  return {x.data_ptr<T>(), stat.data_ptr<float>(), dyn.data_ptr<float>(),
          states.data_ptr<float>(), out.data_ptr<float>(), x.size(1), stat.size(0), heads,
          x.size(1) / heads};
}

at::Tensor dynamic_conv_varlen(const at::Tensor& x_in, const at::Tensor& static_weight,
                               const at::Tensor& dynamic_taps, at::Tensor& conv_states,
                               const at::Tensor& query_start_loc,
                               const at::Tensor& state_indices,
                               const at::Tensor& has_initial_state) {
  const at::Tensor x = x_in.contiguous();
  const at::Tensor stat = static_weight.to(at::kFloat).contiguous();
  const at::Tensor dyn = dynamic_taps.to(at::kFloat).contiguous();
  check(x, stat, dyn, conv_states);
  const VarlenBatch vb = varlen_batch(query_start_loc, state_indices, has_initial_state,
                                      x.size(0), conv_states.size(0));
  const int64_t seqs = vb.seqs, C = x.size(1), H = stat.size(0) - 1;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  const int64_t* q = vb.q;
  const int64_t* s = vb.s;
  at::Tensor out = at::zeros({x.size(0), C}, x.options().dtype(at::kFloat));
  const bool* has_init = vb.has_init;
  dispatch_float_bf16(x, "x", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Problem<T> p = problem_of<T>(x, stat, dyn, conv_states, out);
    at::parallel_for(0, seqs * blocks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> ext;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / blocks, c0 = (i % blocks) * kBlock;
        if (q[b + 1] == q[b]) continue;  // no tokens: the slot is left alone
        float* slot = s[b] < 0 ? nullptr : p.states + (s[b] * C + c0) * H;
        const float* hist = slot != nullptr && has_init[b] ? slot : nullptr;
        conv_block(p, hist, slot, q[b], q[b + 1], c0, std::min(kBlock, C - c0), ext);
      }
    });
  });
  return out;
}

at::Tensor dynamic_conv_update(const at::Tensor& x_in, at::Tensor& conv_states,
                               const at::Tensor& static_weight, const at::Tensor& dynamic_taps,
                               const at::Tensor& state_indices) {
  const at::Tensor x = x_in.contiguous();
  const at::Tensor stat = static_weight.to(at::kFloat).contiguous();
  const at::Tensor dyn = dynamic_taps.to(at::kFloat).contiguous();
  check(x, stat, dyn, conv_states);
  const at::Tensor slots = as_index(state_indices);
  const int64_t rows = x.size(0), C = x.size(1), H = stat.size(0) - 1;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  TORCH_CHECK(slots.numel() == rows, "state_indices must be (B,)");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(s[b] < conv_states.size(0), "state index ", s[b], " outside the state slots");
  }
  at::Tensor out = at::zeros({rows, C}, x.options().dtype(at::kFloat));
  dispatch_float_bf16(x, "x", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Problem<T> p = problem_of<T>(x, stat, dyn, conv_states, out);
    at::parallel_for(0, rows * blocks, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> ext;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / blocks, c0 = (i % blocks) * kBlock;
        float* slot = s[b] < 0 ? nullptr : p.states + (s[b] * C + c0) * H;
        conv_block(p, slot, slot, b, b + 1, c0, std::min(kBlock, C - c0), ext);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "dynamic_conv_varlen(Tensor x, Tensor static_weight, Tensor dynamic_taps, "
      "Tensor(a!) conv_states, Tensor query_start_loc, Tensor state_indices, "
      "Tensor has_initial_state) -> Tensor");
  m.def(
      "dynamic_conv_update(Tensor x, Tensor(a!) conv_states, Tensor static_weight, "
      "Tensor dynamic_taps, Tensor state_indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("dynamic_conv_varlen", &dynamic_conv_varlen);
  m.impl("dynamic_conv_update", &dynamic_conv_update);
}

}  // namespace vllm_mamba
