// One short-conv block's decode step for a few sequences in one call
// (`fused_short_conv_decode`, LFM2's mixer): block RMSNorm (optional) -> in_proj -> B * x ->
// depthwise causal conv over the saved history (no activation) -> C * conv -> out_proj (+ the
// residual when the block norm is given).
//
// Semantics are those of the unfused path: `ShortConv.forward` with the op `short_conv_update`
// (`vllm_mamba/ops/short_conv.py`); a slot index of -1 marks a padding row, computed from a zero
// history and never written. All intermediates stay float32 (the unfused path rounds the
// in_proj output and the gated conv to the model dtype; in float32 the two agree to rounding).
//
// Up to `kGemvMaxBatch` rows (and speculative chains of any length), one OpenMP region per
// call: the in_proj rows, then the conv channels, then the out_proj rows are split over the
// threads, with a barrier between the stages. Chains (`src_state_indices`) run each channel's
// rows in order on one thread, row b starting from the history row src[b] left. More rows run
// the projections as GEMMs between parallel stages.
//
// Glossary: B batch rows, H hidden, D conv channels, K conv width.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fused_decode.h"
#include "kernel_math.h"

namespace vllm_mamba {
namespace {

using fused::gemv;
using fused::split;
using fused::Weight;

// Index of each entry of the `params` list (`SHORT_CONV_PARAMS`, `vllm_mamba/ops/short_conv.py`).
enum Param : size_t { kNormW, kInW, kInB, kConvW, kConvB, kOutW, kOutB, kInScale, kOutScale,
                      kNumParams };  // clang-format off

struct Dims {
  int64_t batch, hidden, channels, kernel;
};

struct Small {  // float32 parameters; nullptr when absent
  const float *norm_w, *in_b, *conv_w, *conv_b, *out_b;
  float norm_eps;
};

// C: the conv states' dtype (float32 or bfloat16).
template <typename C>
struct Io {
  const Weight *in_w, *out_w;
  C* conv_states;  // (S, D, K - 1)
  const int64_t* slots;
  const int64_t* src_slots;  // where row b's history is read from (nullptr: `slots`)
  const float* hidden;       // (B, H)
  float *xn, *bcx, *gated, *mixed;  // (B, H), (B, 3D), (B, D), (B, H) scratch
};

// Channels [c0, c1) of row b: gated = C * conv(B * x), the history shifted in place.
template <typename C>
void conv_rows(const Dims& d, const Small& s, const Io<C>& io, int64_t b, int64_t c0,
               int64_t c1) {
  const float* row = io.bcx + b * 3 * d.channels;
  const float *bv = row, *cv = row + d.channels, *xv = row + 2 * d.channels;
  float* v = io.gated + b * d.channels;
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) v[c] = bv[c] * xv[c];
  const int64_t slot = io.slots[b], width = d.kernel - 1;
  C* hist = slot >= 0 ? io.conv_states + slot * d.channels * width : nullptr;
  const C* from = hist && io.src_slots  // a chain: from the row before
                      ? io.conv_states + io.src_slots[b] * d.channels * width
                      : hist;
  fused::conv_update(v, hist, s.conv_w, s.conv_b, d.kernel, c0, c1, /*silu=*/false, from);
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) v[c] *= cv[c];
}

void norm_rows(const Dims& d, const Small& s, const float* hidden, float* xn, int64_t lo,
               int64_t hi) {
  for (int64_t b = lo; b < hi; ++b) {
    fused::rms_norm_row(hidden + b * d.hidden, s.norm_w, d.hidden, s.norm_eps, xn + b * d.hidden);
  }
}

template <typename C>
void run_layer(const Dims& d, const Small& s, const Io<C>& io) {
  const int64_t nin = 3 * d.channels;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
    int64_t lo, hi;
    if (s.norm_w) {
      split(d.batch, 1, tid, nth, lo, hi);
      norm_rows(d, s, io.hidden, io.xn, lo, hi);
#pragma omp barrier
    }
    split(nin, fused::kRowBlock, tid, nth, lo, hi);
    gemv(*io.in_w, io.xn, d.hidden, d.batch, lo, hi, io.bcx + lo, nin);
    if (s.in_b) {
      for (int64_t b = 0; b < d.batch; ++b) {
        for (int64_t r = lo; r < hi; ++r) io.bcx[b * nin + r] += s.in_b[r];
      }
    }
#pragma omp barrier
    split(d.channels, 16, tid, nth, lo, hi);
    for (int64_t b = 0; b < d.batch; ++b) conv_rows(d, s, io, b, lo, hi);  // rows in order
#pragma omp barrier
    split(d.hidden, fused::kRowBlock, tid, nth, lo, hi);
    gemv(*io.out_w, io.gated, d.channels, d.batch, lo, hi, io.mixed + lo, d.hidden);
    for (int64_t b = 0; b < d.batch; ++b) {
      fused::finish_row(io.mixed + b * d.hidden + lo, s.out_b ? s.out_b + lo : nullptr,
                        s.norm_w ? io.hidden + b * d.hidden + lo : nullptr, hi - lo);
    }
  }
}

// The same block for more rows than `kGemvMaxBatch`: the projections as GEMMs.
template <typename C>
void run_layer_gemm(const Dims& d, const Small& s, const Io<C>& io, const at::Tensor& xn,
                    at::Tensor& bcx, const at::Tensor& gated, at::Tensor& mixed) {
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      norm_rows(d, s, io.hidden, io.xn, lo, hi);
    });
  }
  fused::project(xn, *io.in_w, bcx);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (s.in_b) {
        float* row = io.bcx + b * 3 * d.channels;
        for (int64_t r = 0; r < 3 * d.channels; ++r) row[r] += s.in_b[r];
      }
      conv_rows(d, s, io, b, 0, d.channels);
    }
  });
  fused::project(gated, *io.out_w, mixed);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      fused::finish_row(io.mixed + b * d.hidden, s.out_b,
                        s.norm_w ? io.hidden + b * d.hidden : nullptr, d.hidden);
    }
  });
}

at::Tensor fused_short_conv_decode(const at::Tensor& hidden_in,
                                   const c10::List<std::optional<at::Tensor>>& params,
                                   at::Tensor& conv_states, const at::Tensor& state_indices,
                                   double norm_eps, at::ScalarType out_dtype,
                                   const std::optional<at::Tensor>& src_state_indices,
                                   bool int_dot) {
  TORCH_CHECK(params.size() == kNumParams, "params must hold ", kNumParams, " entries");
  TORCH_CHECK(hidden_in.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.is_contiguous(),
              "conv_states must be contiguous (S, D, K - 1)");
  Dims d{hidden_in.size(0), hidden_in.size(1), conv_states.size(1), conv_states.size(2) + 1};
  TORCH_CHECK(state_indices.dim() == 1 && state_indices.size(0) == d.batch,
              "state_indices must be (B,)");
  const at::Tensor src = fused::src_slots(src_state_indices, d.batch);
  const Weight in_w = fused::weight_of(params, kInW, kInScale, 3 * d.channels, d.hidden,
                                       "in_proj weight", int_dot);
  const Weight out_w = fused::weight_of(params, kOutW, kOutScale, d.hidden, d.channels,
                                        "out_proj weight", int_dot);
  Small s{};
  s.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  s.in_b = fused::param_f32(params, kInB, 3 * d.channels, "in_proj bias");
  s.conv_w = fused::param_f32(params, kConvW, d.channels * d.kernel, "conv weight");
  s.conv_b = fused::param_f32(params, kConvB, d.channels, "conv bias");
  s.out_b = fused::param_f32(params, kOutB, d.hidden, "out_proj bias");
  TORCH_CHECK(s.conv_w, "conv weight is required");
  s.norm_eps = static_cast<float>(norm_eps);

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const at::Tensor slots = as_index(state_indices);
  const auto f32 = hidden.options();
  at::Tensor xn = s.norm_w ? at::empty({d.batch, d.hidden}, f32) : hidden;
  at::Tensor bcx = at::empty({d.batch, 3 * d.channels}, f32);
  at::Tensor gated = at::empty({d.batch, d.channels}, f32);
  at::Tensor mixed = at::empty({d.batch, d.hidden}, f32);
  dispatch_float_bf16(conv_states, "conv_states", [&](auto* c_tag) {
    using C = std::remove_pointer_t<decltype(c_tag)>;
    Io<C> io{&in_w, &out_w, conv_states.data_ptr<C>(), slots.data_ptr<int64_t>(),
             src.defined() ? src.data_ptr<int64_t>() : nullptr, hidden.data_ptr<float>(),
             xn.data_ptr<float>(), bcx.data_ptr<float>(), gated.data_ptr<float>(),
             mixed.data_ptr<float>()};
    if (d.batch <= fused::kGemvMaxBatch || io.src_slots != nullptr) {
      run_layer(d, s, io);
    } else {
      run_layer_gemm(d, s, io, xn, bcx, gated, mixed);
    }
  });
  return mixed.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "fused_short_conv_decode(Tensor hidden, Tensor?[] params, Tensor(a!) conv_states, "
      "Tensor state_indices, float norm_eps, ScalarType out_dtype, "
      "Tensor? src_state_indices=None, bool int_dot=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("fused_short_conv_decode", &fused_short_conv_decode);
}

}  // namespace vllm_mamba
