// One Mamba (S6) layer's decode step for a few sequences in one call (`fused_mamba_decode`):
// block RMSNorm (optional) -> in_proj -> causal conv + SiLU -> x_proj (FalconMamba: weightless
// RMS norms of dt, B and C) -> dt_proj -> selective state update (dt bias and softplus, D skip)
// -> gate by silu(z) -> out_proj (+ the residual when the block norm is given).
//
// Semantics are those of the unfused path: `MambaMixer.forward` with the ops
// `causal_conv1d_update` and `selective_state_update`; a slot index of -1 marks a padding row,
// computed from a zero history and state and never written. Intermediates stay float32.
//
// With `src_state_indices`, row b reads its state from slot `src[b]` and writes it to slot
// `slots[b]`: rows that read the slot an earlier row wrote form a chain (speculative
// decoding's last token and drafts), each position's state kept in its own slot. Rows run in
// order within each thread's channels (chains always take the row-by-row layer below, whatever
// their number of rows), so a chain is exact.
//
// Up to `kGemvMaxBatch` rows, one OpenMP region per call: in_proj rows (conv fused per
// channel), x_proj rows, then channels (dt_proj, state update, gate), then out_proj rows are
// split over the threads, with a barrier between the stages. More rows run the projections as
// GEMMs between parallel stages.
//
// `int_dot` (`quantization="w8a8"` / `"w4a8"`): the int8 / 4-bit projections quantise their
// inputs to int8 blocks of 32 and multiply in integers (`fused::gemv`, `fused::project`).
//
// Glossary: B batch rows, H hidden, I inner channels, N state size, R time-step rank,
// K conv width, XP = R + 2 N x_proj rows.
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
  kNormW, kInW, kInB, kConvW, kConvB, kXW, kDtW, kDtB, kA, kD, kOutW, kOutB,
  kInScale, kXScale, kDtScale, kOutScale, kNumParams
};

struct Dims {
  int64_t batch, hidden, inter, nstate, rank, kernel, xp;
};

struct Small {  // float32 parameters; nullptr when absent
  const float *norm_w, *in_b, *conv_w, *conv_b, *dt_b, *A, *D, *out_b;
  float norm_eps, mixer_eps;  // mixer_eps < 0: no normalisation of dt, B, C
};

// C: the conv states' dtype; S: the SSM states' (each float32 or bfloat16).
template <typename C, typename S>
struct Io {
  const Weight *in_w, *x_w, *dt_w, *out_w;
  C* conv_states;  // (S, I, K - 1)
  S* ssm_states;   // (S, I, N)
  const int64_t* slots;
  const int64_t* src_slots;  // where row b's state is read from (nullptr: `slots`)
  const float* hidden;  // (B, H)
  float *xn, *xz, *dbc, *y, *mixed;  // (B, H), (B, 2 I), (B, XP), (B, I), (B, H) scratch
};

// Conv + SiLU of channels [c0, c1) of batch row b (values in place in xz), shifting their
// histories.
template <typename C, typename S>
inline void conv_rows(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t c0,
                      int64_t c1) {
  const int64_t slot = io.slots[b], width = d.kernel - 1;
  C* hist = slot >= 0 ? io.conv_states + slot * d.inter * width : nullptr;
  const C* from = hist && io.src_slots  // a chain: from the row before
                      ? io.conv_states + io.src_slots[b] * d.inter * width
                      : hist;
  fused::conv_update(io.xz + b * 2 * d.inter, hist, s.conv_w, s.conv_b, d.kernel, c0, c1, true, from);
}

// in_proj rows, then conv + SiLU of the x rows. Each thread takes a share of the x rows and
// one of the z rows, so that the conv work is split evenly too.
template <typename C, typename S>
void in_proj_and_conv(const Dims& d, const Small& s, const Io<C, S>& io, int tid, int nth) {
  const int64_t n = 2 * d.inter;
  int64_t lo, hi;
  split(d.inter, fused::kRowBlock, tid, nth, lo, hi);
  for (const int64_t base : {int64_t{0}, d.inter}) {  // x rows, then z rows
    gemv(*io.in_w, io.xn, d.hidden, d.batch, base + lo, base + hi, io.xz + base + lo, n);
    if (s.in_b) {
      for (int64_t b = 0; b < d.batch; ++b) {
        for (int64_t r = base + lo; r < base + hi; ++r) io.xz[b * n + r] += s.in_b[r];
      }
    }
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    if (lo < hi) conv_rows(d, s, io, b, lo, hi);
  }
}

// x / sqrt(mean(x^2) + eps) in place (FalconMamba's weightless norm).
inline void weightless_rms(float* x, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// x_proj output row b normalised in place (FalconMamba: dt, B and C each).
inline void norm_ssm_params(float* row, const Dims& d, float eps) {
  weightless_rms(row, d.rank, eps);
  weightless_rms(row + d.rank, d.nstate, eps);
  weightless_rms(row + d.rank + d.nstate, d.nstate, eps);
}

// dt_proj, state update and gate of channels [lo, hi) of batch row b; `row` is its
// (normalised) x_proj output (R + 2 N); `dt_row` its dt_proj output (I), or nullptr to
// compute it here.
template <typename C, typename S>
void channels(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, const float* row,
              const float* dt_row, int64_t lo, int64_t hi) {
  const int64_t N = d.nstate, slot = io.slots[b];
  const float* Bv = row + d.rank;
  const float* Cv = row + d.rank + N;
  const float* u = io.xz + b * 2 * d.inter;
  const float* z = u + d.inter;
  float dt[fused::kRowBlock], gate[fused::kRowBlock];
  float acc[fused::kRowBlock];
  std::vector<float> scratch(N);  // a bfloat16 state row, widened
  for (int64_t c0 = lo; c0 < hi; c0 += fused::kRowBlock) {
    const int64_t nc = std::min(fused::kRowBlock, hi - c0);
    if (dt_row) {
      std::copy(dt_row + c0, dt_row + c0 + nc, dt);
    } else {
      gemv(*io.dt_w, row, d.rank, 1, c0, c0 + nc, dt, fused::kRowBlock);
    }
    // The per-channel scalars of the block, vectorised across its channels.
#pragma omp simd
    for (int64_t j = 0; j < nc; ++j) {
      dt[j] = softplus_f32(dt[j] + (s.dt_b ? s.dt_b[c0 + j] : 0.0f));  // delta
      gate[j] = silu_f32(z[c0 + j]);
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c = c0 + j;
      const float delta = dt[j], uc = u[c];
      const float* a = s.A + c * N;
      S* st = slot >= 0 ? io.ssm_states + (slot * d.inter + c) * N : nullptr;
      if (st && io.src_slots && io.src_slots[b] != slot) {
        const S* from = io.ssm_states + (io.src_slots[b] * d.inter + c) * N;
        std::copy(from, from + N, st);
      }
      float sum = 0.0f;
      if (st) {
        float* sf = fused::load_state(st, scratch.data(), N);
#pragma omp simd reduction(+ : sum)
        for (int64_t n = 0; n < N; ++n) {
          const float v = sf[n] * exp_f32(delta * a[n]) + (delta * Bv[n]) * uc;
          sf[n] = v;
          sum += v * Cv[n];
        }
        fused::store_state(sf, st, N);
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t n = 0; n < N; ++n) sum += (delta * Bv[n]) * uc * Cv[n];
      }
      acc[j] = sum;
    }
#pragma omp simd
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c = c0 + j;
      io.y[b * d.inter + c] = (acc[j] + (s.D ? s.D[c] * u[c] : 0.0f)) * gate[j];
    }
  }
}

template <typename C, typename S>
void run_layer(const Dims& d, const Small& s, const Io<C, S>& io) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
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
    split(d.xp, fused::kRowBlock, tid, nth, lo, hi);
    gemv(*io.x_w, io.xz, 2 * d.inter, d.batch, lo, hi, io.dbc + lo, d.xp);
#pragma omp barrier
    std::vector<float> row(d.xp);
    split(d.inter, fused::kRowBlock, tid, nth, lo, hi);
    for (int64_t b = 0; b < d.batch; ++b) {
      std::copy(io.dbc + b * d.xp, io.dbc + (b + 1) * d.xp, row.begin());
      if (s.mixer_eps >= 0.0f) norm_ssm_params(row.data(), d, s.mixer_eps);
      channels(d, s, io, b, row.data(), nullptr, lo, hi);
    }
#pragma omp barrier
    split(d.hidden, fused::kRowBlock, tid, nth, lo, hi);
    gemv(*io.out_w, io.y, d.inter, d.batch, lo, hi, io.mixed + lo, d.hidden);
    for (int64_t b = 0; b < d.batch; ++b) {
      float* m = io.mixed + b * d.hidden;
      for (int64_t r = lo; r < hi; ++r) {
        m[r] += (s.out_b ? s.out_b[r] : 0.0f) + (s.norm_w ? io.hidden[b * d.hidden + r] : 0.0f);
      }
    }
  }
}

// The same layer for more rows than `kGemvMaxBatch`: the projections run as GEMMs (torch's,
// between the parallel stages) instead of weight-streaming products.
template <typename C, typename S>
void run_layer_gemm(const Dims& d, const Small& s, const Io<C, S>& io, const at::Tensor& xn,
                    at::Tensor& xz, at::Tensor& dbc, const at::Tensor& y,
                    at::Tensor& mixed) {
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        fused::rms_norm_row(io.hidden + b * d.hidden, s.norm_w, d.hidden, s.norm_eps,
                            io.xn + b * d.hidden);
      }
    });
  }
  fused::project(xn, *io.in_w, xz);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (s.in_b) {
        for (int64_t r = 0; r < 2 * d.inter; ++r) io.xz[b * 2 * d.inter + r] += s.in_b[r];
      }
      conv_rows(d, s, io, b, 0, d.inter);
    }
  });
  fused::project(xz.narrow(1, 0, d.inter), *io.x_w, dbc);
  if (s.mixer_eps >= 0.0f) {
    for (int64_t b = 0; b < d.batch; ++b) norm_ssm_params(io.dbc + b * d.xp, d, s.mixer_eps);
  }
  at::Tensor dt = at::empty({d.batch, d.inter}, xz.options());
  fused::project(dbc.narrow(1, 0, d.rank), *io.dt_w, dt);
  const int64_t blocks = (d.inter + fused::kRowBlock - 1) / fused::kRowBlock;
  at::parallel_for(0, d.batch * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / blocks, c0 = (t % blocks) * fused::kRowBlock;
      channels(d, s, io, b, io.dbc + b * d.xp, dt.data_ptr<float>() + b * d.inter, c0,
               std::min(d.inter, c0 + fused::kRowBlock));
    }
  });
  fused::project(y, *io.out_w, mixed);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) fused::finish_row(io.mixed + b * d.hidden, s.out_b,
        s.norm_w ? io.hidden + b * d.hidden : nullptr, d.hidden);
  });
}

Dims check_dims(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& params,
                const at::Tensor& conv_states, const at::Tensor& ssm_states,
                const at::Tensor& slots) {
  TORCH_CHECK(params.size() == kNumParams, "params must hold ", kNumParams, " entries");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(ssm_states.dim() == 3 && ssm_states.is_contiguous(),
              "ssm_states must be contiguous (S, I, N)");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.is_contiguous(),
              "conv_states must be contiguous (S, I, K - 1)");
  const std::optional<at::Tensor> dt_w = params.get(kDtW);
  TORCH_CHECK(dt_w.has_value() && dt_w->dim() == 2, "dt_proj weight must be (I, R)");
  Dims d{};
  d.batch = hidden.size(0);
  d.hidden = hidden.size(1);
  d.inter = ssm_states.size(1);
  d.nstate = ssm_states.size(2);
  d.rank = dt_w->size(1);
  d.kernel = conv_states.size(2) + 1;
  d.xp = d.rank + 2 * d.nstate;
  TORCH_CHECK(conv_states.size(1) == d.inter, "conv_states must have I channels");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == d.batch, "state_indices must be (B,)");
  return d;
}

at::Tensor fused_mamba_decode(const at::Tensor& hidden_in,
                              const c10::List<std::optional<at::Tensor>>& params,
                              at::Tensor& conv_states, at::Tensor& ssm_states,
                              const at::Tensor& state_indices, double norm_eps,
                              double mixer_eps, at::ScalarType out_dtype,
                              const std::optional<at::Tensor>& src_state_indices,
                              bool int_dot) {
  const Dims d = check_dims(hidden_in, params, conv_states, ssm_states, state_indices);
  const at::Tensor src = fused::src_slots(src_state_indices, d.batch);
  // int_dot: the int8 / 4-bit projections multiply int8-quantised rows (`int_dot.h`)
  const Weight in_w = fused::weight_of(params, kInW, kInScale, 2 * d.inter, d.hidden,
                                       "in_proj weight", int_dot);
  const Weight x_w =
      fused::weight_of(params, kXW, kXScale, d.xp, d.inter, "x_proj weight", int_dot);
  const Weight dt_w =
      fused::weight_of(params, kDtW, kDtScale, d.inter, d.rank, "dt_proj weight", int_dot);
  const Weight out_w = fused::weight_of(params, kOutW, kOutScale, d.hidden, d.inter,
                                        "out_proj weight", int_dot);
  Small s{};
  s.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  s.in_b = fused::param_f32(params, kInB, 2 * d.inter, "in_proj bias");
  s.conv_w = fused::param_f32(params, kConvW, d.inter * d.kernel, "conv weight");
  s.conv_b = fused::param_f32(params, kConvB, d.inter, "conv bias");
  s.dt_b = fused::param_f32(params, kDtB, d.inter, "dt_proj bias");
  s.A = fused::param_f32(params, kA, d.inter * d.nstate, "A");
  s.D = fused::param_f32(params, kD, d.inter, "D");
  s.out_b = fused::param_f32(params, kOutB, d.hidden, "out_proj bias");
  TORCH_CHECK(s.conv_w && s.A, "conv weight and A are required");
  s.norm_eps = static_cast<float>(norm_eps);
  s.mixer_eps = static_cast<float>(mixer_eps);

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const at::Tensor slots = as_index(state_indices);
  const auto f32 = hidden.options();
  at::Tensor xn = s.norm_w ? at::empty({d.batch, d.hidden}, f32) : hidden;
  at::Tensor xz = at::empty({d.batch, 2 * d.inter}, f32);
  at::Tensor dbc = at::empty({d.batch, d.xp}, f32);
  at::Tensor y = at::empty({d.batch, d.inter}, f32);
  at::Tensor mixed = at::empty({d.batch, d.hidden}, f32);
  auto run = [&](auto* c_tag, auto* s_tag) {
    using C = std::remove_pointer_t<decltype(c_tag)>;
    using S = std::remove_pointer_t<decltype(s_tag)>;
    Io<C, S> io{&in_w,           &x_w,      &dt_w, &out_w, conv_states.data_ptr<C>(),
                ssm_states.data_ptr<S>(), slots.data_ptr<int64_t>(),
                src.defined() ? src.data_ptr<int64_t>() : nullptr, hidden.data_ptr<float>(),
                xn.data_ptr<float>(),     xz.data_ptr<float>(),      dbc.data_ptr<float>(),
                y.data_ptr<float>(),      mixed.data_ptr<float>()};
    if (d.batch <= fused::kGemvMaxBatch || io.src_slots != nullptr) {  // chains: rows in order
      run_layer(d, s, io);
    } else {
      run_layer_gemm(d, s, io, xn, xz, dbc, y, mixed);
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
      "fused_mamba_decode(Tensor hidden, Tensor?[] params, Tensor(a!) conv_states, "
      "Tensor(b!) ssm_states, Tensor state_indices, float norm_eps, float mixer_eps, "
      "ScalarType out_dtype, Tensor? src_state_indices=None, "
      "bool int_dot=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("fused_mamba_decode", &fused_mamba_decode); }

}  // namespace vllm_mamba
