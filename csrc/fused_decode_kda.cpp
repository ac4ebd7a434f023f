// One Kimi Delta Attention (KDA) layer's decode step for a few sequences in one call
// (`fused_kda_decode`): block RMSNorm (optional) -> the input projections, whose concatenated
// outputs are [q | k | v | f_a | g_a | b] -> causal conv + SiLU over q, k and v -> the low-rank
// second stages f_b(f_a) (the forget gate's input a) and g_b(g_a) (the output gate) -> the KDA
// rule per value head (L2 norms, per-channel decay, beta, the state update and read-out) -> the
// per-head sigmoid-gated RMSNorm -> o_proj (+ the residual when the block norm is given).
// Single-stage gates (Ling 3's full-rank f_proj and g_proj): f_b and g_b absent (None in
// `params`, with their scales), the input projections' outputs are [q | k | v | a | gate | b]
// (a of AD, the gate of VD) and the rule reads a and the gate from them directly.
//
// Semantics are those of the unfused path (`vllm_mamba/layers/kimi_delta_attention.py`) with
// the ops `causal_conv1d_update`, `kda.update` and `kda.norm_gate` (`vllm_mamba/ops/kda.py` has
// the math): per value head h, reading key head h / (Hv / Hk), with q and k L2-normalised
// (eps 1e-6) and q scaled by Dk^-1/2,
//   g = -exp(A_log[h]) softplus(a[h] + dt_bias[h])  ((Dk,): a decay per key channel;
//       softplus(x) = x above 20; Kimi's gate, lower_bound == 0), or
//   g = lower_bound sigmoid(exp(A_log[h]) (a[h] + dt_bias[h]))  (the safe gate,
//       lower_bound < 0; a positive lower_bound is refused), beta = sigmoid(b[h]),
//   S = diag(exp(g)) S, S += k (beta (v - S^T k))^T, o = S^T q,
//   y = o_norm_w * rmsnorm(o) * sigmoid(gate[h]),
// computed as the `kda_update` kernel does: one read pass over the state for (D S)^T k and
// (D S)^T q (D = diag(exp(g))), o = (D S)^T q + (k . q) delta, one read-write pass
// S = D S + k delta^T. A slot index of -1 marks a padding row: its history and state are
// neither read nor written and its rule output is zero (as the reference's). All
// intermediates stay float32 (the unfused path rounds them to the model dtype between ops; in
// float32 the two agree to rounding).
//
// Speculative chains (`src_state_indices`): row b reads the state of slot src[b] and writes
// slot dst[b], the rows in order, so a chain's positions run in one call, each streaming the
// weights once for all rows, each row's products summed exactly as a one-row call sums them
// (`gemv::dot_tile`): a chain's states are bit for bit those of decoding one by one.
// The recurrent state is read from src and written to dst in the same pass; the conv history
// (K - 1 values per channel) is copied first and shifted in place.
//
// Up to `kGemvMaxBatch` rows, or a chain of any length, one OpenMP region per call: the rows of
// all input projections (one range over their concatenated outputs, with the conv fused per
// channel), then the rows of f_b and g_b (two-stage gates), then the value heads (with the
// gated norm), then the o_proj rows are split over the threads, with a barrier between the
// stages. More rows without chains run the projections as GEMMs (`fused::project`) between
// parallel stages.
//
// Glossary: B batch rows, H hidden, Hk / Hv key / value heads of Dk / Dv, KD = Hk Dk,
// VD = Hv Dv, CD = 2 KD + VD conv channels, K conv width, R the gates' low rank (0 for
// single-stage gates), AD = Hv Dk forget-gate channels, NG = AD + VD gate values per row,
// NIN = CD + 2 R + Hv first-stage outputs per row (CD + NG + Hv single-stage), S state slots.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fused_decode.h"
#include "fused_decode_delta.h"
#include "kernel_math.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

using fused::split;
using fused::Weight;

// Index of each entry of the `params` list (`vllm_mamba/ops/kda.py`: KDA_DECODE_PARAMS), then
// one (weight, scale) pair per input projection, in the order of their outputs
// ([q | k | v | f_a | g_a | b] concatenated; [q | k | v | a | gate | b] without kFbW, kGbW).
enum Param : size_t {
  kNormW,
  kConvW,
  kALog,
  kDtBias,
  kGateW,
  kOutW,
  kOutScale,
  kFbW,
  kFbScale,
  kGbW,
  kGbScale,
  kFirstIn
};
constexpr float kSoftplusThreshold = 20.0f;

// `delta::Dims`, plus R the gates' low rank (0: single-stage gates), AD = Hv Dk the decay
// gate's width, NG = AD + VD the gate values [a | gate] of a row and gate_stride the distance
// between two rows' (NG in the second stages' scratch, NIN in the first stage's outputs).
struct Dims : delta::Dims {
  int64_t rank, a_dim, ngate, gate_stride;
};

struct Small {  // float32 parameters; nullptr when absent
  const float *norm_w, *conv_w, *A_log, *dt_bias, *gate_w;
  float norm_eps, gate_eps;
  float lower_bound;  // 0: the softplus gate; < 0: the safe gate
};

// C: the conv states' dtype; S: the recurrent states' (each float32 or bfloat16).
template <typename C, typename S>
struct Io {
  const Weight* in_w;     // n_in input projections
  const int64_t* in_off;  // (n_in + 1,) first output of each in the concatenation
  int64_t n_in;
  const Weight *fb_w, *gb_w, *out_w;  // (AD, R), (VD, R) (nullptr: single-stage), (H, VD)
  C* conv_states;                     // (S, CD, K - 1)
  S* ssm_states;                      // (S, Hv, Dk, Dv)
  const int64_t* slots;               // (B,) where row b writes its state
  const int64_t* src_slots;           // where row b's state is read from (nullptr: `slots`)
  const float* hidden;                // (B, H)
  float *xn, *proj, *y, *mixed;       // (B, H), (B, NIN), (B, VD), (B, H) scratch
  // Row b's gate values [a (AD) | gate (VD)] at gates + b * gate_stride: the second stages'
  // (B, NG) scratch, or (single-stage) the first stage's outputs after the conv channels.
  float* gates;
};

// Outputs [lo, hi) of the second stage [f_b(f_a) (AD) | g_b(g_a) (VD)] for every row (into
// io.gates), reading the first stage's f_a and g_a outputs from io.proj (two-stage gates).
template <typename C, typename S>
void gate_rows(const Dims& d, const Io<C, S>& io, int64_t lo, int64_t hi) {
  const float* fa = io.proj + d.conv_dim;
  fused::gemv(*io.fb_w, fa, d.nin, d.batch, lo, std::min(hi, d.a_dim), io.gates + lo, d.ngate);
  const int64_t g0 = std::max(lo, d.a_dim);
  fused::gemv(*io.gb_w, fa + d.rank, d.nin, d.batch, g0 - d.a_dim, hi - d.a_dim, io.gates + g0,
              d.ngate);
}

// Scratch of one thread for `kda_head`.
struct HeadScratch {
  std::vector<float> buf;
  float *kn, *qn, *decay, *kv, *in_row, *out_row;
  HeadScratch(int64_t dk, int64_t dv) : buf(3 * dk + 3 * dv) {
    kn = buf.data();
    qn = kn + dk;
    decay = qn + dk;
    kv = decay + dk;
    in_row = kv + dv;
    out_row = in_row + dv;
  }
};

// The KDA rule of value head h of batch row b, then its gated RMSNorm:
// y[b, h] = gate_w * rmsnorm(o) * sigmoid(gate) with o the rule's read-out (zeros for a
// padding row). kSafeGate: the safe gate (s.lower_bound < 0), else Kimi's softplus gate (one
// instantiation each, so the gate loop has no branch).
template <bool kSafeGate, typename C, typename S>
void kda_head(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t h,
              HeadScratch& w) {
  const int64_t dk = d.dk, dv = d.dv;
  const float* row = io.proj + b * d.nin;
  const float* grow = io.gates + b * d.gate_stride;
  float* o = io.y + b * d.value_dim + h * dv;
  const int64_t slot = io.slots[b];
  if (slot < 0) {
    std::fill(o, o + dv, 0.0f);
  } else {
    const int64_t kh = h / (d.v_heads / d.k_heads);
    delta::l2norm(row + d.key_dim + kh * dk, dk, 1.0f, w.kn);
    delta::l2norm(row + kh * dk, dk, 1.0f / std::sqrt(static_cast<float>(dk)), w.qn);
    const float* v = row + 2 * d.key_dim + h * dv;
    const float bv = row[d.nin - d.v_heads + h];
    const float beta = 1.0f / (1.0f + std::exp(-bv));
    const float* a = grow + h * dk;
    const float* bias = s.dt_bias + h * dk;
    float kq = 0.0f;
    if constexpr (kSafeGate) {
      const float rate = std::exp(s.A_log[h]);
      const float bound = s.lower_bound;
#pragma omp simd reduction(+ : kq)
      for (int64_t i = 0; i < dk; ++i) {
        // sigmoid as torch computes it in float32: 1 / (1 + exp(-z)).
        const float sig = 1.0f / (1.0f + exp_f32(-(rate * (a[i] + bias[i]))));
        w.decay[i] = exp_f32(bound * sig);
        kq += w.kn[i] * w.qn[i];
      }
    } else {
      const float rate = -std::exp(s.A_log[h]);
#pragma omp simd reduction(+ : kq)
      for (int64_t i = 0; i < dk; ++i) {
        const float x = a[i] + bias[i];
        const float g = rate * select_f32(x > kSoftplusThreshold, x, softplus_f32(x));
        w.decay[i] = exp_f32(g);
        kq += w.kn[i] * w.qn[i];
      }
    }
    const int64_t src_slot = io.src_slots ? io.src_slots[b] : slot;
    S* src = io.ssm_states + (src_slot * d.v_heads + h) * dk * dv;
    S* dst = io.ssm_states + (slot * d.v_heads + h) * dk * dv;
    float* kv = w.kv;  // (D S)^T k, then delta
    std::fill(kv, kv + dv, 0.0f);
    std::fill(o, o + dv, 0.0f);  // (D S)^T q, then the read-out
    for (int64_t i = 0; i < dk; ++i) {
      const float* sr = fused::load_state(src + i * dv, w.in_row, dv);
      const float ki = w.kn[i] * w.decay[i], qi = w.qn[i] * w.decay[i];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        kv[j] += sr[j] * ki;
        o[j] += sr[j] * qi;
      }
    }
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      const float delta = beta * (v[j] - kv[j]);
      kv[j] = delta;
      o[j] += kq * delta;
    }
    for (int64_t i = 0; i < dk; ++i) {
      const float* sr = fused::load_state(src + i * dv, w.in_row, dv);
      float* nr = w.out_row;
      if constexpr (std::is_same_v<S, float>) nr = dst + i * dv;
      const float di = w.decay[i], ki = w.kn[i];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) nr[j] = di * sr[j] + ki * kv[j];
      fused::store_state(nr, dst + i * dv, dv);
    }
  }
  const float* gate = grow + d.a_dim + h * dv;
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(dv) + s.gate_eps);
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) o[j] = s.gate_w[j] * (o[j] * r) / (1.0f + exp_f32(-gate[j]));
}

// `kda_head` with the layer's gate.
template <typename C, typename S>
inline void run_head(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t h,
                     HeadScratch& w) {
  if (s.lower_bound < 0.0f) {
    kda_head<true>(d, s, io, b, h, w);
  } else {
    kda_head<false>(d, s, io, b, h, w);
  }
}

template <typename C, typename S>
void run_layer(const Dims& d, const Small& s, const Io<C, S>& io) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
    HeadScratch scratch(d.dk, d.dv);
    if (s.norm_w) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < d.batch; ++b) delta::norm_row(d, s.norm_w, s.norm_eps, io, b);
    }
    int64_t lo, hi;
    split(d.nin, fused::kRowBlock, tid, nth, lo, hi);
    delta::project_rows(d, io, lo, hi);
    const int64_t c1 = std::min(hi, d.conv_dim);
    for (int64_t b = 0; lo < c1 && b < d.batch; ++b) delta::conv_rows(d, s.conv_w, io, b, lo, c1);
#pragma omp barrier
    if (io.fb_w) {
      split(d.ngate, fused::kRowBlock, tid, nth, lo, hi);
      gate_rows(d, io, lo, hi);
#pragma omp barrier
    }
    if (io.src_slots) {  // chains: each head's rows in order on one thread
      split(d.v_heads, 1, tid, nth, lo, hi);
      for (int64_t h = lo; h < hi; ++h) {
        for (int64_t b = 0; b < d.batch; ++b) run_head(d, s, io, b, h, scratch);
      }
    } else {
      split(d.batch * d.v_heads, 1, tid, nth, lo, hi);
      for (int64_t t = lo; t < hi; ++t) run_head(d, s, io, t / d.v_heads, t % d.v_heads, scratch);
    }
#pragma omp barrier
    split(d.hidden, fused::kRowBlock, tid, nth, lo, hi);
    fused::gemv(*io.out_w, io.y, d.value_dim, d.batch, lo, hi, io.mixed + lo, d.hidden);
    for (int64_t b = 0; b < d.batch && s.norm_w; ++b) {
      float* m = io.mixed + b * d.hidden;
      const float* res = io.hidden + b * d.hidden;
      for (int64_t r = lo; r < hi; ++r) m[r] += res[r];
    }
  }
}

// The same layer for more rows than `kGemvMaxBatch` (no chains): the projections run as GEMMs
// (torch's, between the parallel stages) instead of weight-streaming products.
template <typename C, typename S>
void run_layer_gemm(const Dims& d, const Small& s, const Io<C, S>& io, const at::Tensor& xn,
                    at::Tensor& proj, at::Tensor& gates, const at::Tensor& y, at::Tensor& mixed) {
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) delta::norm_row(d, s.norm_w, s.norm_eps, io, b);
    });
  }
  // out[:, first : first + w's rows] = x @ w^T
  auto project_into = [](const at::Tensor& x, const Weight& w, at::Tensor& out, int64_t first) {
    const int64_t rows = w.tensor.size(0);
    at::Tensor part = at::empty({x.size(0), rows}, out.options());
    fused::project(x, w, part);
    out.narrow(1, first, rows).copy_(part);
  };
  for (int64_t i = 0; i < io.n_in; ++i) project_into(xn, io.in_w[i], proj, io.in_off[i]);
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) delta::conv_rows(d, s.conv_w, io, b, 0, d.conv_dim);
  });
  if (io.fb_w) {
    project_into(proj.narrow(1, d.conv_dim, d.rank).contiguous(), *io.fb_w, gates, 0);
    project_into(proj.narrow(1, d.conv_dim + d.rank, d.rank).contiguous(), *io.gb_w, gates,
                 d.a_dim);
  }
  at::parallel_for(0, d.batch * d.v_heads, 1, [&](int64_t lo, int64_t hi) {
    HeadScratch scratch(d.dk, d.dv);
    for (int64_t t = lo; t < hi; ++t) run_head(d, s, io, t / d.v_heads, t % d.v_heads, scratch);
  });
  fused::project(y, *io.out_w, mixed);
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        fused::finish_row(io.mixed + b * d.hidden, nullptr, io.hidden + b * d.hidden, d.hidden);
      }
    });
  }
}

Dims check_dims(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& params,
                const at::Tensor& conv_states, const at::Tensor& ssm_states,
                const at::Tensor& slots) {
  Dims d{};
  static_cast<delta::Dims&>(d) = delta::check_dims(hidden, params.size(), kFirstIn, conv_states,
                                                   ssm_states, slots);
  d.a_dim = d.v_heads * d.dk;
  d.ngate = d.a_dim + d.value_dim;
  return d;
}

at::Tensor fused_kda_decode(const at::Tensor& hidden_in,
                            const c10::List<std::optional<at::Tensor>>& params,
                            at::Tensor& conv_states, at::Tensor& ssm_states,
                            const at::Tensor& state_indices, double norm_eps, double gate_eps,
                            at::ScalarType out_dtype,
                            const std::optional<at::Tensor>& src_state_indices, bool int_dot,
                            double lower_bound) {
  // A ValueError in Python; NaN fails the check too.
  TORCH_CHECK_VALUE(lower_bound <= 0.0,
                    "lower_bound must be 0 (softplus gate) or negative, got ", lower_bound);
  Dims d = check_dims(hidden_in, params, conv_states, ssm_states, state_indices);
  const at::Tensor src = fused::src_slots(src_state_indices, d.batch);
  const int64_t n_in = static_cast<int64_t>(params.size() - kFirstIn) / 2;
  std::vector<Weight> in_w;
  std::vector<int64_t> in_off(1, 0);
  for (int64_t i = 0; i < n_in; ++i) {
    const size_t at = kFirstIn + 2 * static_cast<size_t>(i);
    const std::optional<at::Tensor> t = params.get(at);
    TORCH_CHECK(t.has_value() && t->dim() == 2, "input projection ", i,
                " must be a (rows, H) weight");
    const int64_t rows = t->size(0);
    in_w.push_back(fused::weight_of(params, at, at + 1, rows, d.hidden, "input projection weight",
                                    int_dot));
    in_off.push_back(in_off.back() + rows);
  }
  d.nin = in_off.back();
  const bool two_stage = params.get(kFbW).has_value();
  TORCH_CHECK(two_stage == params.get(kGbW).has_value(),
              "f_b_proj and g_b_proj weights must both be given (two-stage gates) or both be "
              "None (single-stage gates)");
  Weight fb_w, gb_w;
  if (two_stage) {
    const int64_t low_rank2 = d.nin - d.conv_dim - d.v_heads;  // 2 R
    TORCH_CHECK(low_rank2 > 0 && low_rank2 % 2 == 0,
                "the input projections must have 2 Hk Dk + Hv Dv + 2 R + Hv rows together ([q "
                "| k | v | f_a | g_a | b], R > 0 the gates' rank), got ",
                d.nin, " with 2 Hk Dk + Hv Dv + Hv = ", d.conv_dim + d.v_heads);
    d.rank = low_rank2 / 2;
    d.gate_stride = d.ngate;
    fb_w = fused::weight_of(params, kFbW, kFbScale, d.a_dim, d.rank, "f_b_proj weight", int_dot);
    gb_w = fused::weight_of(params, kGbW, kGbScale, d.value_dim, d.rank, "g_b_proj weight",
                            int_dot);
  } else {
    TORCH_CHECK(!params.get(kFbScale).has_value() && !params.get(kGbScale).has_value(),
                "single-stage gates (no f_b_proj, g_b_proj weights) take no f_b / g_b scales");
    TORCH_CHECK(d.nin == d.conv_dim + d.ngate + d.v_heads,
                "with single-stage gates the input projections must have 2 Hk Dk + Hv Dv + "
                "Hv Dk + Hv Dv + Hv rows together ([q | k | v | a | gate | b]), got ",
                d.nin, ", want ", d.conv_dim + d.ngate + d.v_heads);
    d.rank = 0;
    d.gate_stride = d.nin;
  }
  const Weight out_w =
      fused::weight_of(params, kOutW, kOutScale, d.hidden, d.value_dim, "o_proj weight", int_dot);
  Small s{};
  s.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  s.conv_w = fused::param_f32(params, kConvW, d.conv_dim * d.kernel, "conv weight");
  s.A_log = fused::param_f32(params, kALog, d.v_heads, "A_log");
  s.dt_bias = fused::param_f32(params, kDtBias, d.a_dim, "dt_bias");
  s.gate_w = fused::param_f32(params, kGateW, d.dv, "gated norm weight");
  TORCH_CHECK(s.conv_w && s.A_log && s.dt_bias && s.gate_w,
              "conv weight, A_log, dt_bias and the gated norm weight are required");
  s.norm_eps = static_cast<float>(norm_eps);
  s.gate_eps = static_cast<float>(gate_eps);
  s.lower_bound = static_cast<float>(lower_bound);

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const at::Tensor slots = as_index(state_indices);
  delta::check_slots(slots, conv_states.size(0), "state_indices");
  if (src.defined()) delta::check_slots(src, conv_states.size(0), "src_state_indices");
  const auto f32 = hidden.options();
  at::Tensor xn = s.norm_w ? at::empty({d.batch, d.hidden}, f32) : hidden;
  at::Tensor proj = at::empty({d.batch, d.nin}, f32);
  at::Tensor gates = at::empty({d.batch, two_stage ? d.ngate : 0}, f32);
  at::Tensor y = at::empty({d.batch, d.value_dim}, f32);
  at::Tensor mixed = at::empty({d.batch, d.hidden}, f32);
  if (d.batch == 0) return mixed.to(out_dtype);
  auto run = [&](auto* c_tag, auto* s_tag) {
    using C = std::remove_pointer_t<decltype(c_tag)>;
    using S = std::remove_pointer_t<decltype(s_tag)>;
    float* gate_values = two_stage ? gates.data_ptr<float>() : proj.data_ptr<float>() + d.conv_dim;
    Io<C, S> io{in_w.data(), in_off.data(), n_in, two_stage ? &fb_w : nullptr,
                two_stage ? &gb_w : nullptr, &out_w, conv_states.data_ptr<C>(),
                ssm_states.data_ptr<S>(), slots.data_ptr<int64_t>(),
                src.defined() ? src.data_ptr<int64_t>() : nullptr, hidden.data_ptr<float>(),
                xn.data_ptr<float>(), proj.data_ptr<float>(), y.data_ptr<float>(),
                mixed.data_ptr<float>(), gate_values};
    if (d.batch <= fused::kGemvMaxBatch || io.src_slots != nullptr) {  // chains: rows in order
      run_layer(d, s, io);
    } else {
      run_layer_gemm(d, s, io, xn, proj, gates, y, mixed);
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
      "fused_kda_decode(Tensor hidden, Tensor?[] params, Tensor(a!) conv_states, "
      "Tensor(b!) ssm_states, Tensor state_indices, float norm_eps, float gate_eps, "
      "ScalarType out_dtype, Tensor? src_state_indices=None, bool int_dot=False, "
      "float lower_bound=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("fused_kda_decode", &fused_kda_decode); }

}  // namespace vllm_mamba
