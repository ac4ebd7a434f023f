// One Mamba2 layer's decode step for a few sequences in one call (`fused_mamba2_decode`):
// block RMSNorm (optional) -> in_proj -> causal conv + SiLU over x, B and C -> SSD state
// update per head (dt bias and softplus, grouped B and C, D skip) -> gated RMSNorm ->
// out_proj (+ the residual when the block norm is given).
//
// Semantics are those of the unfused path: `Mamba2Mixer.forward` with the ops
// `causal_conv1d_update`, `ssd_state_update` (no dt clamp in decode, like transformers and
// mamba-ssm) and `gated_rms_norm`; a slot index of -1 marks a padding row, computed from a
// zero history and state and never written. All intermediates stay float32 (the unfused path
// rounds them to the model dtype between ops; in float32 the two agree to rounding).
//
// Up to `kGemvMaxBatch` rows, one OpenMP region per call: the in_proj rows (with the conv
// fused per channel), then the (sequence, head) pairs of the SSD update, then the (sequence,
// group) pairs of the norm, then the out_proj rows are split over the threads, with a barrier
// between the stages. More rows run the projections as GEMMs between parallel stages.
//
// `int_dot` (`quantization="w8a8"` / `"w4a8"`): the int8 / 4-bit projections quantise their
// inputs to int8 blocks of 32 and multiply in integers (`fused::gemv`, `fused::project`).
//
// Glossary: B batch rows, H hidden, I = NH * P inner channels, NH heads of P, G groups,
// N state size, CD = I + 2 G N conv channels, K conv width, NIN = I + CD + NH in_proj rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "fused_decode.h"
#include "kernel_math.h"

namespace vllm_mamba {
namespace {

using fused::gemv;
using fused::split;
using fused::Weight;

// Index of each entry of the `params` list (see `vllm_mamba/ops/fused_decode.py`).
enum Param : size_t {
  kNormW, kInW, kInB, kConvW, kConvB, kDtBias, kA, kD, kGateW, kOutW, kOutB, kInScale,
  kOutScale, kNumParams
};

struct Dims {
  int64_t batch, hidden, inter, conv_dim, heads, head_dim, groups, nstate, kernel, nin,
      group_size;
};

struct Small {  // float32 parameters; nullptr when absent
  const float *norm_w, *in_b, *conv_w, *conv_b, *dt_bias, *A, *D, *gate_w, *out_b;
  float norm_eps, gate_eps;
  float res_scale;  // the residual multiplier (block mode): hidden + res_scale * out_proj
};

// C: the conv states' dtype; S: the SSM states' (each float32 or bfloat16).
template <typename C, typename S>
struct Io {
  const Weight *in_w, *out_w;
  C* conv_states;     // (S, CD, K - 1)
  S* ssm_states;      // (S, NH, P, N)
  const int64_t* slots;
  const int64_t* src_slots;  // where row b's state is read from (nullptr: `slots`)
  const float* hidden;  // (B, H)
  float *xn, *zx, *y, *mixed;  // (B, H), (B, NIN), (B, I), (B, H) scratch
};

// Conv + SiLU of channels [c0, c1) of batch row b (values in place in zx), shifting their
// histories; the SiLU runs as a second, vectorised pass.
template <typename C, typename S>
inline void conv_rows(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t c0,
                      int64_t c1) {
  float* v = io.zx + b * d.nin + d.inter;
  const int64_t slot = io.slots[b], width = d.kernel - 1;
  C* hist = slot >= 0 ? io.conv_states + slot * d.conv_dim * width : nullptr;
  const C* from = hist && io.src_slots  // a chain: from the row before
                      ? io.conv_states + io.src_slots[b] * d.conv_dim * width
                      : hist;
  fused::conv_update(v, hist, s.conv_w, s.conv_b, d.kernel, c0, c1, true, from);
}

template <typename C, typename S>
void in_proj_and_conv(const Dims& d, const Small& s, const Io<C, S>& io, int tid, int nth) {
  int64_t lo, hi;
  split(d.nin, fused::kRowBlock, tid, nth, lo, hi);
  gemv(*io.in_w, io.xn, d.hidden, d.batch, lo, hi, io.zx + lo, d.nin);
  for (int64_t b = 0; b < d.batch; ++b) {
    if (s.in_b) {
      for (int64_t r = lo; r < hi; ++r) io.zx[b * d.nin + r] += s.in_b[r];
    }
    const int64_t c0 = std::max(lo, d.inter) - d.inter;
    const int64_t c1 = std::min(hi, d.inter + d.conv_dim) - d.inter;
    if (c0 < c1) conv_rows(d, s, io, b, c0, c1);
  }
}

// SSD update of head h of batch row b: h = exp(dt A) h + dt x B^T, y = h C + D x.
// `zero_state` (N zeros) stands for a padding row's state; `scratch` (N) holds a bfloat16
// state row widened.
template <typename C, typename S>
void ssd_head(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t h,
              float* zero_state, float* scratch) {
  const float* row = io.zx + b * d.nin;
  float dt = row[d.inter + d.conv_dim + h] + (s.dt_bias ? s.dt_bias[h] : 0.0f);
  dt = softplus_f32(dt);
  const float dA = exp_f32(dt * s.A[h]);
  const int64_t g = h / (d.heads / d.groups), P = d.head_dim, N = d.nstate;
  const float* x = row + d.inter + h * P;
  const float* Bv = row + 2 * d.inter + g * N;
  const float* Cv = row + 2 * d.inter + d.groups * N + g * N;
  const int64_t slot = io.slots[b];
  S* st = slot >= 0 ? io.ssm_states + (slot * d.heads + h) * P * N : nullptr;
  if (st && io.src_slots && io.src_slots[b] != slot) {
    const S* from = io.ssm_states + (io.src_slots[b] * d.heads + h) * P * N;
    std::copy(from, from + P * N, st);
  }
  const float skip = s.D ? s.D[h] : 0.0f;
  for (int64_t p = 0; p < P; ++p) {
    const float xdt = x[p] * dt;
    float acc = 0.0f;
    if (st) {
      float* sp = fused::load_state(st + p * N, scratch, N);
#pragma omp simd reduction(+ : acc)
      for (int64_t n = 0; n < N; ++n) {
        const float v = sp[n] * dA + xdt * Bv[n];
        sp[n] = v;
        acc += v * Cv[n];
      }
      fused::store_state(sp, st + p * N, N);
    } else {
#pragma omp simd reduction(+ : acc)
      for (int64_t n = 0; n < N; ++n) acc += (zero_state[n] * dA + xdt * Bv[n]) * Cv[n];
    }
    io.y[b * d.inter + h * P + p] = acc + skip * x[p];
  }
}

// Gated RMSNorm of group g of batch row b, in place in y: w * rms(y * silu(z)).
template <typename C, typename S>
void gate_group(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t g) {
  const int64_t gs = d.group_size, off = g * gs;
  float* y = io.y + b * d.inter + off;
  const float* z = io.zx + b * d.nin + off;
  float ss = 0.0f;
  for (int64_t i = 0; i < gs; ++i) {
    y[i] = y[i] * silu_f32(z[i]);
    ss += y[i] * y[i];
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(gs) + s.gate_eps);
#pragma omp simd
  for (int64_t i = 0; i < gs; ++i) y[i] = s.gate_w[off + i] * (y[i] * r);
}

template <typename C, typename S>
void run_layer(const Dims& d, const Small& s, const Io<C, S>& io) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
    std::vector<float> zero_state(d.nstate, 0.0f), scratch(d.nstate);
    if (s.norm_w) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < d.batch; ++b) {
        fused::rms_norm_row(io.hidden + b * d.hidden, s.norm_w, d.hidden, s.norm_eps,
                            io.xn + b * d.hidden);
      }
    }
    in_proj_and_conv(d, s, io, tid, nth);
#pragma omp barrier
    int64_t lo, hi;
    if (io.src_slots) {  // chains: each head's rows in order on one thread
      split(d.heads, 1, tid, nth, lo, hi);
      for (int64_t h = lo; h < hi; ++h) {
        for (int64_t b = 0; b < d.batch; ++b) {
          ssd_head(d, s, io, b, h, zero_state.data(), scratch.data());
        }
      }
    } else {
      split(d.batch * d.heads, 1, tid, nth, lo, hi);
      for (int64_t t = lo; t < hi; ++t) {
        ssd_head(d, s, io, t / d.heads, t % d.heads, zero_state.data(), scratch.data());
      }
    }
#pragma omp barrier
    const int64_t ngroups = d.inter / d.group_size;
    split(d.batch * ngroups, 1, tid, nth, lo, hi);
    for (int64_t t = lo; t < hi; ++t) gate_group(d, s, io, t / ngroups, t % ngroups);
#pragma omp barrier
    split(d.hidden, fused::kRowBlock, tid, nth, lo, hi);
    gemv(*io.out_w, io.y, d.inter, d.batch, lo, hi, io.mixed + lo, d.hidden);
    for (int64_t b = 0; b < d.batch; ++b) {
      fused::finish_row(io.mixed + b * d.hidden + lo, s.out_b ? s.out_b + lo : nullptr,
                        s.norm_w ? io.hidden + b * d.hidden + lo : nullptr, hi - lo, s.res_scale);
    }
  }
}

// The same layer for more rows than `kGemvMaxBatch`: the projections run as GEMMs (torch's,
// between the parallel stages) instead of weight-streaming products.
template <typename C, typename S>
void run_layer_gemm(const Dims& d, const Small& s, const Io<C, S>& io, const at::Tensor& xn,
                    at::Tensor& zx, const at::Tensor& y, at::Tensor& mixed) {
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        fused::rms_norm_row(io.hidden + b * d.hidden, s.norm_w, d.hidden, s.norm_eps,
                            io.xn + b * d.hidden);
      }
    });
  }
  fused::project(xn, *io.in_w, zx);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (s.in_b) {
        for (int64_t r = 0; r < d.nin; ++r) io.zx[b * d.nin + r] += s.in_b[r];
      }
      conv_rows(d, s, io, b, 0, d.conv_dim);
    }
  });
  at::parallel_for(0, d.batch * d.heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> zero_state(d.nstate, 0.0f), scratch(d.nstate);
    for (int64_t t = lo; t < hi; ++t) {
      ssd_head(d, s, io, t / d.heads, t % d.heads, zero_state.data(), scratch.data());
    }
  });
  const int64_t ngroups = d.inter / d.group_size;
  at::parallel_for(0, d.batch * ngroups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) gate_group(d, s, io, t / ngroups, t % ngroups);
  });
  fused::project(y, *io.out_w, mixed);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) fused::finish_row(io.mixed + b * d.hidden, s.out_b,
        s.norm_w ? io.hidden + b * d.hidden : nullptr, d.hidden, s.res_scale);
  });
}

Dims check_dims(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& params,
                const at::Tensor& conv_states, const at::Tensor& ssm_states,
                const at::Tensor& slots, int64_t n_groups, int64_t group_size) {
  TORCH_CHECK(params.size() == kNumParams, "params must hold ", kNumParams, " entries");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.is_contiguous(),
              "ssm_states must be contiguous (S, NH, P, N)");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.is_contiguous(),
              "conv_states must be contiguous (S, CD, K - 1)");
  Dims d{};
  d.batch = hidden.size(0);
  d.hidden = hidden.size(1);
  d.heads = ssm_states.size(1);
  d.head_dim = ssm_states.size(2);
  d.nstate = ssm_states.size(3);
  d.groups = n_groups;
  d.inter = d.heads * d.head_dim;
  d.conv_dim = d.inter + 2 * d.groups * d.nstate;
  d.kernel = conv_states.size(2) + 1;
  d.nin = d.inter + d.conv_dim + d.heads;
  d.group_size = group_size;
  TORCH_CHECK(n_groups > 0 && d.heads % n_groups == 0, "n_groups must divide the heads");
  TORCH_CHECK(group_size > 0 && d.inter % group_size == 0, "group_size must divide NH * P");
  TORCH_CHECK(conv_states.size(1) == d.conv_dim, "conv_states must have NH P + 2 G N channels");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == d.batch, "state_indices must be (B,)");
  return d;
}

at::Tensor fused_mamba2_decode(const at::Tensor& hidden_in,
                               const c10::List<std::optional<at::Tensor>>& params,
                               at::Tensor& conv_states, at::Tensor& ssm_states,
                               const at::Tensor& state_indices, int64_t n_groups,
                               int64_t group_size, double norm_eps, double gate_eps,
                               at::ScalarType out_dtype,
                               const std::optional<at::Tensor>& src_state_indices,
                               bool int_dot, double residual_scale) {
  const Dims d = check_dims(hidden_in, params, conv_states, ssm_states, state_indices, n_groups,
                            group_size);
  const at::Tensor src = fused::src_slots(src_state_indices, d.batch);
  // int_dot: the int8 / 4-bit projections multiply int8-quantised rows (`int_dot.h`)
  const Weight in_w =
      fused::weight_of(params, kInW, kInScale, d.nin, d.hidden, "in_proj weight", int_dot);
  const Weight out_w = fused::weight_of(params, kOutW, kOutScale, d.hidden, d.inter,
                                        "out_proj weight", int_dot);
  Small s{};
  s.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  s.in_b = fused::param_f32(params, kInB, d.nin, "in_proj bias");
  s.conv_w = fused::param_f32(params, kConvW, d.conv_dim * d.kernel, "conv weight");
  s.conv_b = fused::param_f32(params, kConvB, d.conv_dim, "conv bias");
  s.dt_bias = fused::param_f32(params, kDtBias, d.heads, "dt_bias");
  s.A = fused::param_f32(params, kA, d.heads, "A");
  s.D = fused::param_f32(params, kD, d.heads, "D");
  s.gate_w = fused::param_f32(params, kGateW, d.inter, "gated norm weight");
  s.out_b = fused::param_f32(params, kOutB, d.hidden, "out_proj bias");
  TORCH_CHECK(s.conv_w && s.A && s.gate_w, "conv weight, A and the gated norm weight are required");
  s.norm_eps = static_cast<float>(norm_eps);
  s.gate_eps = static_cast<float>(gate_eps);
  s.res_scale = static_cast<float>(residual_scale);
  TORCH_CHECK(residual_scale == 1.0 || s.norm_w, "residual_scale needs the block norm");

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const at::Tensor slots = as_index(state_indices);
  const auto f32 = hidden.options();
  at::Tensor xn = s.norm_w ? at::empty({d.batch, d.hidden}, f32) : hidden;
  at::Tensor zx = at::empty({d.batch, d.nin}, f32);
  at::Tensor y = at::empty({d.batch, d.inter}, f32);
  at::Tensor mixed = at::empty({d.batch, d.hidden}, f32);
  auto run = [&](auto* c_tag, auto* s_tag) {
    using C = std::remove_pointer_t<decltype(c_tag)>;
    using S = std::remove_pointer_t<decltype(s_tag)>;
    Io<C, S> io{&in_w, &out_w, conv_states.data_ptr<C>(),
                ssm_states.data_ptr<S>(), slots.data_ptr<int64_t>(),
                src.defined() ? src.data_ptr<int64_t>() : nullptr, hidden.data_ptr<float>(),
                xn.data_ptr<float>(), zx.data_ptr<float>(), y.data_ptr<float>(),
                mixed.data_ptr<float>()};
    if (d.batch <= fused::kGemvMaxBatch || io.src_slots != nullptr) {  // chains: rows in order
      run_layer(d, s, io);
    } else {
      run_layer_gemm(d, s, io, xn, zx, y, mixed);
    }
  };
  dispatch_float_bf16(conv_states, "conv_states", [&](auto* c_tag) {
    dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* s_tag) { run(c_tag, s_tag); });
  });
  return mixed.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "fused_mamba2_decode(Tensor hidden, Tensor?[] params, Tensor(a!) conv_states, "
      "Tensor(b!) ssm_states, Tensor state_indices, int n_groups, int group_size, "
      "float norm_eps, float gate_eps, ScalarType out_dtype, Tensor? src_state_indices=None, "
      "bool int_dot=False, float residual_scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("fused_mamba2_decode", &fused_mamba2_decode); }

}  // namespace vllm_mamba
