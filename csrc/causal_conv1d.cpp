// Causal depthwise conv1d over a packed varlen batch (token-major `(T, D)`), and its one-token
// decode update, on the CPU. Shapes and semantics follow
// `vllm_mamba/ops/causal_conv1d.py`: `conv_states` is `(S, D, K - 1)`, a slot index of -1 marks
// a padding row whose slot is never read nor written (its outputs use a zero history).
//
// Two passes: outputs in parallel over (16 tokens, 256 channels) tasks, all taps of a channel
// in one pass vectorised over the contiguous channels of a token (tokens whose taps reach
// back into the slot's history take a general path); then each sequence's last `K - 1` inputs
// are written to its slot. x may be the leading channels of a wider projection's output (its
// token stride is read, nothing is copied).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "fused_decode.h"
#include "kernel_math.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kConvChunk = 8 * kBlock;  // channels per output task
constexpr int64_t kConvTokens = 16;         // tokens per output task

struct ConvProblem {
  int64_t tokens, dim, width, batch;
  int64_t x_stride;             // token stride of x (its channels are contiguous)
  const int64_t* qsl;           // (B + 1,)
  const int64_t* slots;         // (B,)
  const bool* has_init;         // (B,)
  const int64_t* seq_of_token;  // (T,)
  const float* weight_t;        // (K, D): filters transposed so channels are contiguous
  const float* bias;            // (D,) or nullptr
  bool activation;
};

// Outputs of token `t` for channels [d0, d0 + n), where every tap reads x (t - K + 1 >= the
// sequence's start): all taps of a channel in one vectorised pass. The same operations as the
// general path below: taps added in order by fused multiply-adds from zero, then the bias,
// then SiLU.
template <int kWidth, bool kBias, bool kAct, typename T>
inline void conv_token_inner(const ConvProblem& p, const T* x, T* out, int64_t t, int64_t d0,
                             int64_t n) {
  const int64_t dim = p.dim, xs = p.x_stride;
  const T* xr = x + (t - (kWidth - 1)) * xs + d0;
  const float* w = p.weight_t + d0;
  const float* bias = kBias ? p.bias + d0 : nullptr;
  T* o = out + t * dim + d0;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    float acc = 0.0f;
#pragma GCC unroll 8
    for (int k = 0; k < kWidth; ++k) acc += w[k * dim + j] * load_f32(xr[k * xs + j]);
    if constexpr (kBias) acc = acc + bias[j];
    if constexpr (kAct) acc = silu_f32(acc);
    o[j] = store_as<T>(acc);
  }
}

// Outputs of token `t` for channels [d0, d0 + n), any tap position (the general path: the
// first K - 1 tokens of a sequence read its slot's saved inputs or zeros).
template <typename T, typename S>
void conv_token_chunk(const ConvProblem& p, const T* x, const S* states, T* out, int64_t t,
                      int64_t d0, int64_t n) {
  const int64_t hist = p.width - 1;
  const int64_t b = p.seq_of_token[t];
  const int64_t start = p.qsl[b];
  const int64_t slot = p.slots[b];
  const bool from_state = slot >= 0 && p.has_init[b];
  float acc[kConvChunk] = {};
  for (int64_t k = 0; k < p.width; ++k) {
    const int64_t src = t - hist + k;  // input position seen by tap k
    const float* w = p.weight_t + k * p.dim + d0;
    if (src >= start) {
      const T* xr = x + src * p.x_stride + d0;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) acc[j] += w[j] * load_f32(xr[j]);
    } else if (from_state) {
      // Before the sequence start: column hist + (src - start) of the slot's saved inputs.
      const S* st = states + (slot * p.dim + d0) * hist + hist + (src - start);
      for (int64_t j = 0; j < n; ++j) acc[j] += w[j] * load_f32(st[j * hist]);
    }
  }
  T* o = out + t * p.dim + d0;
  const float* bias = p.bias ? p.bias + d0 : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    const float v = bias ? acc[j] + bias[j] : acc[j];
    o[j] = store_as<T>(p.activation ? silu_f32(v) : v);
  }
}

// Tokens [t0, t1) of channels [d0, d0 + n): the inner path where all taps read x, else the
// general one. `Inner` is `conv_token_inner` for the problem's width, bias and activation.
template <typename T, typename S, typename Inner>
void conv_tokens(const ConvProblem& p, const T* x, const S* states, T* out, int64_t t0,
                 int64_t t1, int64_t d0, int64_t n, Inner&& inner) {
  for (int64_t t = t0; t < t1; ++t) {
    if (t - (p.width - 1) >= p.qsl[p.seq_of_token[t]]) {
      inner(t, d0, n);
    } else {
      conv_token_chunk<T, S>(p, x, states, out, t, d0, n);
    }
  }
}

// Overwrites sequence b's slot with its last K - 1 inputs (older ones from the slot itself).
template <typename T, typename S>
void conv_write_state(const ConvProblem& p, const T* x, S* states, int64_t b) {
  const int64_t hist = p.width - 1;
  const int64_t slot = p.slots[b];
  if (slot < 0 || hist == 0) return;
  const int64_t start = p.qsl[b];
  const int64_t end = p.qsl[b + 1];
  const bool keep = p.has_init[b];
  for (int64_t d = 0; d < p.dim; ++d) {
    S* st = states + (slot * p.dim + d) * hist;
    // In place is safe: column j reads column (len + j) >= j, not yet overwritten.
    for (int64_t j = 0; j < hist; ++j) {
      const int64_t rel = end - hist + j - start;
      const float v = rel >= 0 ? load_f32(x[(start + rel) * p.x_stride + d])
                               : (keep ? load_f32(st[hist + rel]) : 0.0f);
      st[j] = store_as<S>(v);
    }
  }
}

// Calls fn with the inner token kernel for the problem's width (2, 3 or 4 taps; nullptr for
// others, which take the general path), bias and activation.
template <typename T, typename Fn>
void with_inner(const ConvProblem& p, Fn&& fn) {
  auto pick = [&](auto width) {
    constexpr int kW = decltype(width)::value;
    auto run = [&](auto bias, auto act) {
      fn(&conv_token_inner<kW, decltype(bias)::value, decltype(act)::value, T>);
    };
    using t = std::true_type;
    using f = std::false_type;
    if (p.bias) {
      p.activation ? run(t{}, t{}) : run(t{}, f{});
    } else {
      p.activation ? run(f{}, t{}) : run(f{}, f{});
    }
  };
  switch (p.width) {
    case 2: pick(std::integral_constant<int, 2>{}); break;
    case 3: pick(std::integral_constant<int, 3>{}); break;
    case 4: pick(std::integral_constant<int, 4>{}); break;
    default: fn(static_cast<void (*)(const ConvProblem&, const T*, T*, int64_t, int64_t,
                                     int64_t)>(nullptr));
  }
}

template <typename T, typename S>
void conv_run(const ConvProblem& p, const at::Tensor& x, at::Tensor& states, at::Tensor& out) {
  const T* xp = x.data_ptr<T>();
  S* sp = states.data_ptr<S>();
  T* op = out.data_ptr<T>();
  const int64_t chunks = (p.dim + kConvChunk - 1) / kConvChunk;
  const int64_t blocks = (p.tokens + kConvTokens - 1) / kConvTokens;
  with_inner<T>(p, [&](auto kernel) {
    at::parallel_for(0, blocks * chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t d0 = (i % chunks) * kConvChunk, n = std::min(kConvChunk, p.dim - d0);
        const int64_t t0 = (i / chunks) * kConvTokens;
        const int64_t t1 = std::min(p.tokens, t0 + kConvTokens);
        if (kernel) {
          conv_tokens<T, S>(p, xp, sp, op, t0, t1, d0, n, [&](int64_t t, int64_t d, int64_t m) {
            kernel(p, xp, op, t, d, m);
          });
        } else {
          for (int64_t t = t0; t < t1; ++t) conv_token_chunk<T, S>(p, xp, sp, op, t, d0, n);
        }
      }
    });
  });
  at::parallel_for(0, p.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) conv_write_state<T, S>(p, xp, sp, b);
  });
}

at::Tensor conv_impl(const at::Tensor& x_in, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, at::Tensor& conv_states,
                     const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                     const at::Tensor& has_initial_state, bool activation) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (T, D)");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x_in.size(1), "weight must be (D, K)");
  const int64_t width = weight.size(1);
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == x_in.size(1) &&
                  conv_states.size(2) == width - 1,
              "conv_states must be (S, D, K - 1)");
  TORCH_CHECK(conv_states.is_contiguous(), "conv_states must be contiguous");
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  // Rows of a wider projection's output are read in place (channels contiguous).
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor weight_t = weight.to(at::kFloat).t().contiguous();  // (K, D)
  const at::Tensor bias_f = optional_f32(bias);
  const at::Tensor qsl = as_index(query_start_loc);
  const at::Tensor slots = as_index(state_indices);
  const at::Tensor has_init = has_initial_state.to(at::kBool).contiguous();
  const int64_t tokens = x.size(0);
  TORCH_CHECK(qsl[batch].item<int64_t>() == tokens, "query_start_loc[-1] must equal T");
  const at::Tensor seq_of_token =
      at::repeat_interleave(at::arange(batch, qsl.options()), qsl.diff(), std::nullopt, tokens);
  at::Tensor out = at::empty({tokens, x.size(1)}, x.options());

  const ConvProblem p{tokens,
                      x.size(1),
                      width,
                      batch,
                      x.stride(0),
                      qsl.data_ptr<int64_t>(),
                      slots.data_ptr<int64_t>(),
                      has_init.data_ptr<bool>(),
                      seq_of_token.data_ptr<int64_t>(),
                      weight_t.data_ptr<float>(),
                      bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                      activation};
  dispatch_float_bf16(x, "x", [&](auto* xt) {
    using T = std::remove_pointer_t<decltype(xt)>;
    dispatch_float_bf16(conv_states, "conv_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      conv_run<T, S>(p, x, conv_states, out);
    });
  });
  return out;
}

at::Tensor causal_conv1d_varlen(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, at::Tensor conv_states,
                                const at::Tensor& query_start_loc,
                                const at::Tensor& state_indices,
                                const at::Tensor& has_initial_state, bool activation) {
  return conv_impl(x, weight, bias, conv_states, query_start_loc, state_indices,
                   has_initial_state, activation);
}

// Decode: one new input per row. Each channel convolves its saved history and the new input
// with its (D, K) filter, then shifts the input into the history (`fused::conv_update`, the
// fused decode layers' step, on the row in float32). Rows run in parallel only when the batch
// is large enough to pay for the threads.
template <typename T, typename S>
void conv_update_rows(const T* x, S* states, const float* w, const float* bias,
                      const int64_t* slots, T* out, int64_t batch, int64_t dim, int64_t width,
                      bool activation) {
  const int64_t hist = width - 1;
  at::parallel_for(0, batch, 8, [&](int64_t lo, int64_t hi) {
    std::vector<float> widened;  // a bfloat16 row in float32 (a float32 row works in `out`)
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t slot = slots[b];
      const T* xr = x + b * dim;
      T* o = out + b * dim;
      float* v;
      if constexpr (std::is_same_v<T, float>) {
        std::copy(xr, xr + dim, o);
        v = o;
      } else {
        widened.assign(xr, xr + dim);
        v = widened.data();
      }
      fused::conv_update(v, slot >= 0 ? states + slot * dim * hist : nullptr, w, bias, width, 0,
                         dim, activation);
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t d = 0; d < dim; ++d) o[d] = store_as<T>(v[d]);
      }
    }
  });
}

at::Tensor causal_conv1d_update(const at::Tensor& x_in, at::Tensor conv_states,
                                const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const at::Tensor& state_indices, bool activation) {
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == batch, "x must be (B, D)");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x_in.size(1), "weight must be (D, K)");
  const int64_t dim = x_in.size(1), width = weight.size(1);
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == dim &&
                  conv_states.size(2) == width - 1,
              "conv_states must be (S, D, K - 1)");
  TORCH_CHECK(conv_states.is_contiguous(), "conv_states must be contiguous");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous();  // (D, K)
  const at::Tensor bias_f = optional_f32(bias);
  const at::Tensor slots = as_index(state_indices);
  at::Tensor out = at::empty_like(x);
  dispatch_float_bf16(x, "x", [&](auto* xt) {
    using T = std::remove_pointer_t<decltype(xt)>;
    dispatch_float_bf16(conv_states, "conv_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      conv_update_rows<T, S>(x.data_ptr<T>(), conv_states.data_ptr<S>(), w.data_ptr<float>(),
                             bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                             slots.data_ptr<int64_t>(), out.data_ptr<T>(), batch, dim, width,
                             activation);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("causal_conv1d_varlen", &causal_conv1d_varlen);
  m.impl("causal_conv1d_update", &causal_conv1d_update);
}

}  // namespace vllm_mamba
