// The convs of Compressed Convolutional Attention on the CPU (ZAYA1's `qkv_proj`), as the
// references `cca_conv_varlen_ref` / `cca_conv_update_ref` in `vllm_mamba/ops/cca.py`: a
// depthwise conv of width K0, then a grouped conv of width K1 whose group g (one per query or
// key head, D channels) mixes the group's channels, both with biases, over each sequence's
// inputs with its `K - 1 = K0 + K1 - 2` previous ones (its slot's history, or zeros) in front.
//
// The depthwise conv and the histories run here, in tasks of (sequence or decode row, group):
// a task lays the group's history and inputs out as rows of a float32 buffer, computes each
// token's K1 depthwise outputs the grouped conv reads, rounded to x's dtype as transformers'
// first `nn.Conv1d` rounds them, laid out `(G, T, D, K1)` as a row of the grouped weight
// `(C, D, K1)` is, and saves the slot's new history (its last K - 1 inputs). The grouped conv
// is then one batched GEMM per call, `(G, T, D K1) x (G, D K1, D)` plus the bias (oneDNN or
// MKL through ATen, accumulating in float32, rounded once to x's dtype). Math is float32; x,
// the weights and the history are float32 or bfloat16 (x and the weights one dtype).
//
// Glossary: T tokens, B sequences (or rows), C channels (G D), G groups, D channels per group,
// K0 / K1 the convs' widths, S state slots.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernel_math.h"

namespace vllm_mamba {
namespace {

// What every task reads and writes; `S` is the history's element type.
template <typename T, typename S>
struct Problem {
  const T* x;        // (T, C)
  const T* dw;       // (C, K0)
  const T* dw_bias;  // (C,)
  S* states;         // (S, C, K - 1)
  T* y;              // (G, T, D, K1): the depthwise outputs the grouped conv reads
  int64_t tokens, channels, dim, k0, k1;
};

// Scratch of one worker: the group's rows of inputs.
struct Scratch {
  std::vector<float> ext;
};

// Tokens [begin, end) of one sequence through group g's depthwise conv, from `hist` (its
// slot's history rows, or nullptr for zeros); the new history goes to `save` (nullptr: none).
template <typename T, typename S>
void conv_group(const Problem<T, S>& p, const S* hist, S* save, int64_t begin, int64_t end,
                int64_t g, Scratch& sc) {
  const int64_t C = p.channels, D = p.dim, K0 = p.k0, K1 = p.k1, H = K0 + K1 - 2;
  const int64_t tokens = end - begin, c0 = g * D;
  sc.ext.assign((H + tokens) * D, 0.0f);  // row r: input r - H of the chunk (< 0: history)
  for (int64_t d = 0; d < D && hist != nullptr; ++d) {
    for (int64_t j = 0; j < H; ++j) sc.ext[j * D + d] = to_f32(hist[(c0 + d) * H + j]);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const T* x = p.x + (begin + t) * C + c0;
    float* row = sc.ext.data() + (H + t) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = to_f32(x[d]);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    // y[d, j]: the depthwise output over rows t + j .. t + j + K0 - 1 (token t's window
    // starts at row t), rounded as the first conv's output.
    T* y = p.y + ((g * p.tokens) + begin + t) * D * K1;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = c0 + d;
      for (int64_t j = 0; j < K1; ++j) {
        float acc = to_f32(p.dw_bias[c]);
        for (int64_t a = 0; a < K0; ++a) {
          acc += to_f32(p.dw[c * K0 + a]) * sc.ext[(t + j + a) * D + d];
        }
        y[d * K1 + j] = static_cast<T>(acc);
      }
    }
  }
  if (save != nullptr) {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < H; ++j) {
        save[(c0 + d) * H + j] = static_cast<S>(sc.ext[(tokens + j) * D + d]);
      }
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& dw, const at::Tensor& dw_bias,
           const at::Tensor& gw, const at::Tensor& g_bias, const at::Tensor& states) {
  TORCH_CHECK(x.dim() == 2, "x must be (T, C)");
  const int64_t C = x.size(1);
  TORCH_CHECK(dw.dim() == 2 && dw.size(0) == C && dw_bias.numel() == C,
              "dw_weight must be (C, K0) and dw_bias (C,)");
  TORCH_CHECK(gw.dim() == 3 && gw.size(0) == C && gw.size(1) > 0 && C % gw.size(1) == 0 &&
                  g_bias.numel() == C,
              "g_weight must be (C, D, K1) with C a multiple of D, and g_bias (C,)");
  TORCH_CHECK(dw.size(1) + gw.size(2) >= 2, "the convs need a width");
  TORCH_CHECK(states.dim() == 3 && states.size(1) == C &&
                  states.size(2) == dw.size(1) + gw.size(2) - 2 && states.is_contiguous(),
              "conv_states must be contiguous (S, C, K0 + K1 - 2)");
  for (const at::Tensor* t : {&dw, &dw_bias, &gw, &g_bias}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "the conv weights and x differ in dtype");
  }
}

// Runs `fn(problem)` with the element types of x and the history, the depthwise outputs
// going to `y (G, T, D, K1)`.
template <typename Fn>
void dispatch(const at::Tensor& x, const at::Tensor& dw, const at::Tensor& dw_bias,
              const at::Tensor& gw, at::Tensor& states, at::Tensor& y, Fn&& fn) {
  dispatch_float_bf16(x, "x", [&](auto* xt) {
    using T = std::remove_pointer_t<decltype(xt)>;
    dispatch_float_bf16(states, "conv_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      fn(Problem<T, S>{x.data_ptr<T>(), dw.data_ptr<T>(), dw_bias.data_ptr<T>(),
                       states.data_ptr<S>(), y.data_ptr<T>(), x.size(0), x.size(1),
                       gw.size(1), dw.size(1), gw.size(2)});
    });
  });
}

// The grouped conv over the depthwise outputs `y (G, T, D, K1)` -> `(T, C)`: one batched GEMM
// with the weight `(C, D, K1)` as `(G, D, D K1)`, plus the bias.
at::Tensor grouped_conv(const at::Tensor& y, const at::Tensor& gw, const at::Tensor& g_bias) {
  const int64_t groups = y.size(0), tokens = y.size(1), D = gw.size(1);
  const at::Tensor rows = y.view({groups, tokens, -1});            // (G, T, D K1)
  const at::Tensor w = gw.view({groups, D, -1}).transpose(1, 2);    // (G, D K1, D out)
  const at::Tensor out = at::baddbmm(g_bias.view({groups, 1, D}), rows, w);  // (G, T, D)
  return out.transpose(0, 1).reshape({tokens, groups * D});
}

at::Tensor cca_conv_varlen(const at::Tensor& x_in, const at::Tensor& dw_weight,
                           const at::Tensor& dw_bias, const at::Tensor& g_weight,
                           const at::Tensor& g_bias, at::Tensor& conv_states,
                           const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                           const at::Tensor& has_initial_state) {
  const at::Tensor x = x_in.contiguous(), dw = dw_weight.contiguous();
  const at::Tensor dwb = dw_bias.contiguous(), gw = g_weight.contiguous();
  const at::Tensor gb = g_bias.contiguous();
  check(x, dw, dwb, gw, gb, conv_states);
  const VarlenBatch vb = varlen_batch(query_start_loc, state_indices, has_initial_state,
                                      x.size(0), conv_states.size(0));
  const int64_t seqs = vb.seqs, C = x.size(1), groups = C / gw.size(1);
  const int64_t H = dw.size(1) + gw.size(2) - 2;
  const int64_t* q = vb.q;
  const int64_t* s = vb.s;
  at::Tensor y = at::zeros({groups, x.size(0), gw.size(1), gw.size(2)}, x.options());
  const bool* has_init = vb.has_init;
  dispatch(x, dw, dwb, gw, conv_states, y, [&](const auto& p) {
    at::parallel_for(0, seqs * groups, 1, [&](int64_t lo, int64_t hi) {
      Scratch sc;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / groups, g = i % groups;
        // A sequence without tokens still saves its history (zeros when fresh), as the ref.
        auto* slot = s[b] < 0 ? nullptr : p.states + s[b] * C * H;
        conv_group(p, has_init[b] ? slot : nullptr, slot, q[b], q[b + 1], g, sc);
      }
    });
  });
  return grouped_conv(y, gw, gb);
}

at::Tensor cca_conv_update(const at::Tensor& x_in, at::Tensor& conv_states,
                           const at::Tensor& dw_weight, const at::Tensor& dw_bias,
                           const at::Tensor& g_weight, const at::Tensor& g_bias,
                           const at::Tensor& state_indices) {
  const at::Tensor x = x_in.contiguous(), dw = dw_weight.contiguous();
  const at::Tensor dwb = dw_bias.contiguous(), gw = g_weight.contiguous();
  const at::Tensor gb = g_bias.contiguous();
  check(x, dw, dwb, gw, gb, conv_states);
  const at::Tensor slots = as_index(state_indices);
  const int64_t rows = x.size(0), C = x.size(1), groups = C / gw.size(1);
  const int64_t H = dw.size(1) + gw.size(2) - 2;
  TORCH_CHECK(slots.numel() == rows, "state_indices must be (B,)");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(s[b] < conv_states.size(0), "state index ", s[b], " outside the state slots");
  }
  at::Tensor y = at::empty({groups, rows, gw.size(1), gw.size(2)}, x.options());
  dispatch(x, dw, dwb, gw, conv_states, y, [&](const auto& p) {
    at::parallel_for(0, rows * groups, 4, [&](int64_t lo, int64_t hi) {
      Scratch sc;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / groups, g = i % groups;
        auto* slot = s[b] < 0 ? nullptr : p.states + s[b] * C * H;  // padding: zeros
        conv_group(p, slot, slot, b, b + 1, g, sc);
      }
    });
  });
  return grouped_conv(y, gw, gb);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "cca_conv_varlen(Tensor x, Tensor dw_weight, Tensor dw_bias, Tensor g_weight, "
      "Tensor g_bias, Tensor(a!) conv_states, Tensor query_start_loc, Tensor state_indices, "
      "Tensor has_initial_state) -> Tensor");
  m.def(
      "cca_conv_update(Tensor x, Tensor(a!) conv_states, Tensor dw_weight, Tensor dw_bias, "
      "Tensor g_weight, Tensor g_bias, Tensor state_indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("cca_conv_varlen", &cca_conv_varlen);
  m.impl("cca_conv_update", &cca_conv_update);
}

}  // namespace vllm_mamba
