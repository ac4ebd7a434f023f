// One decoder layer's feed-forward stage for a few rows in one call:
// `out = h + rm * ffn(rms_norm(h))`, with `ffn` a gated MLP (`fused_mlp_decode`) or a sparse
// mixture of experts with an optional shared expert (`fused_moe_decode`; inside a layer's
// residual streams either may run without the norm and return `rm * ffn(h)` alone,
// `residual`), the SwiGLUs optionally clipped (`Clip`).
//
// Gated MLP: down(act(gate(x) * gm) * up(x)) * dm. The gate and up products are separate
// weights (`layers.mlp.GatedMLP`'s gate_proj / up_proj, nothing copied at load) or one merged
// [gate | up] weight (up_w absent: Granite's shared MLP): either way a thread computes the
// gate rows [i0, i1) and the up rows [i0, i1) of the same channels, so it applies the
// activation to its own channels and one barrier separates them from the down product.
//
// MoE: the router (logits by a weight-streaming product whose rows' bits do not depend on the
// batch), the top-k in C++, each chosen expert's gate/up and down products, the weighted sum in
// ascending expert id (the order `layers.moe.dispatch_experts` adds them in), the shared
// expert (times sigmoid(shared gate) when it has one), the residual. The experts are stacked:
// gate/up (E * 2I, H) (expert e's rows [2Ie, 2Ie + I) gate, [2Ie + I, 2I(e + 1)) up) and down
// (E * H, I): `layers.moe` stacks a list of expert Linears at plan time. With several rows,
// each expert chosen by any row streams its weights once for the rows that chose it (their
// normed inputs copied together, at most kGemvMaxBatch of them).
//
// Routers (`kind`):
//   0 softmax: softmax of the logits, top-k by logit, weights p / sum(top-k p) when
//     `renormalize` (Qwen3-Next, Qwen3.5-MoE; also Granite's top-k-then-softmax, the same
//     weights), else p / sum(p);
//   1 sigmoid: s = sigmoid(logits), chosen by s + bias (the bias optional, only selecting)
//     among the best `topk_group` of `n_group` groups (a group scored by its two best;
//     n_group = 1: all), weights s, divided by (sum + renorm_eps) when `renormalize`, times
//     `scaling` (LFM2-MoE, DeepSeek-V3-style routers).
// Top-k ties: the larger value first, equal values in ascending expert (group) id
// (torch.topk leaves the order of ties unspecified).
//
// All intermediates are float32 (the unfused path rounds to the model dtype between ops; in
// float32 the two agree to rounding). Up to `kGemvMaxBatch` rows; more run unfused.
//
// Glossary: B rows, H hidden, I expert (or MLP) width, S shared-expert width, E experts,
// k experts per token.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ffn_math.h"
#include "fused_decode.h"
#include "kernel_math.h"

namespace vllm_mamba {
namespace {

using fused::gemv;
using fused::split;
using fused::Weight;

using ffn::Clip;
using ffn::kSilu;
using ffn::kRelu2;

// A gated MLP's weights: gate rows [0, I) of `gate` (from `gate_row0`), up rows [0, I) of `up`
// (from `up_row0`; for a merged weight the same Weight at row I), down (H, I) from `down_row0`.
struct Gated {
  const Weight* gate = nullptr;
  const Weight* up = nullptr;
  const Weight* down = nullptr;
  int64_t inter = 0;
};

// z[b, i] = act(gate_b[i] * gm) * up_b[i] (clipped by `clip`) for channels [i0, i1) of expert
// rows starting at gate_row0 / up_row0 of the weights; x (m, H) row stride ldx; g, u scratch
// (m, ldz).
inline void gate_up_rows(const Weight& gw, int64_t gate_row0, const Weight& uw,
                         int64_t up_row0, const float* x, int64_t ldx, int64_t m, int64_t i0,
                         int64_t i1, float* g, float* u, float* z, int64_t ldz, int64_t act,
                         float gm, Clip clip = Clip{}) {
  if (i0 >= i1) return;
  gemv(gw, x, ldx, m, gate_row0 + i0, gate_row0 + i1, g + i0, ldz);
  gemv(uw, x, ldx, m, up_row0 + i0, up_row0 + i1, u + i0, ldz);
  for (int64_t b = 0; b < m; ++b) {
    ffn::gated_row(g + b * ldz, u + b * ldz, z + b * ldz, i0, i1, act, gm, clip);
  }
}

// ---------------------------------------------------------------------------------------------
// Dense gated MLP.

enum MlpParam : size_t { kMNormW, kMGateW, kMUpW, kMDownW, kMGateScale, kMUpScale, kMDownScale,
                         kMNumParams };

struct MlpArgs {
  int64_t batch, hidden, inter, act;
  float eps, gm, dm, rm;
  const float* norm_w;  // null: no norm (the stage's input is already normed)
  bool residual;        // false: out = rm * mlp, without h (a stage inside residual streams)
  Clip clip;
};

void run_mlp(const MlpArgs& a, const Gated& w, const float* h, float* xn, float* g, float* u,
             float* z, float* d, float* out) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
#pragma omp for schedule(static)
    for (int64_t b = 0; b < a.batch; ++b) {
      if (a.norm_w) {
        fused::rms_norm_row(h + b * a.hidden, a.norm_w, a.hidden, a.eps, xn + b * a.hidden);
      } else {
        std::copy(h + b * a.hidden, h + (b + 1) * a.hidden, xn + b * a.hidden);
      }
    }
    int64_t lo, hi;
    const int64_t up0 = w.up == w.gate ? a.inter : 0;
    split(a.inter, fused::kRowBlock, tid, nth, lo, hi);
    gate_up_rows(*w.gate, 0, *w.up, up0, xn, a.hidden, a.batch, lo, hi, g, u, z, a.inter, a.act,
                 a.gm, a.clip);
#pragma omp barrier
    split(a.hidden, fused::kRowBlock, tid, nth, lo, hi);
    if (lo < hi) gemv(*w.down, z, a.inter, a.batch, lo, hi, d + lo, a.hidden);
    for (int64_t b = 0; b < a.batch; ++b) {
      const float* hb = h + b * a.hidden;
      const float* db = d + b * a.hidden;
      float* ob = out + b * a.hidden;
      for (int64_t r = lo; r < hi; ++r) {
        const float y = a.dm == 1.0f ? db[r] : db[r] * a.dm;
        const float s = a.rm == 1.0f ? y : y * a.rm;
        ob[r] = a.residual ? hb[r] + s : s;
      }
    }
  }
}

at::Tensor fused_mlp_decode(const at::Tensor& hidden_in,
                            const c10::List<std::optional<at::Tensor>>& params, double norm_eps,
                            int64_t act, double gate_multiplier, double down_multiplier,
                            double residual_multiplier, at::ScalarType out_dtype, bool int_dot,
                            bool residual, double clip, bool clip_before_act) {
  TORCH_CHECK(params.size() == kMNumParams, "params must hold ", kMNumParams, " entries");
  TORCH_CHECK(hidden_in.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(hidden_in.size(0) <= fused::kGemvMaxBatch, "fused_mlp_decode takes at most ",
              fused::kGemvMaxBatch, " rows");
  TORCH_CHECK(act >= kSilu && act <= kRelu2, "act must be 0..4 (silu, gelu_tanh, gelu, relu, "
              "relu2)");
  const std::optional<at::Tensor> gate_t = params.get(kMGateW);
  TORCH_CHECK(gate_t.has_value() && gate_t->dim() == 2, "gate_w is required, (I, H)");
  const bool merged = !params.get(kMUpW).has_value();
  MlpArgs a{};
  a.batch = hidden_in.size(0);
  a.hidden = hidden_in.size(1);
  a.inter = merged ? gate_t->size(0) / 2 : gate_t->size(0);
  TORCH_CHECK(a.inter > 0 && (!merged || gate_t->size(0) % 2 == 0),
              "gate_w must have I rows (2I merged with up)");
  a.act = act;
  a.eps = static_cast<float>(norm_eps);
  a.gm = static_cast<float>(gate_multiplier);
  a.dm = static_cast<float>(down_multiplier);
  a.rm = static_cast<float>(residual_multiplier);
  a.norm_w = fused::param_f32(params, kMNormW, a.hidden, "norm weight");
  a.residual = residual;
  TORCH_CHECK(clip >= 0.0, "the SwiGLU clip must be >= 0 (0: none)");
  a.clip = Clip{static_cast<float>(clip), clip_before_act};
  const Weight gate = fused::weight_of(params, kMGateW, kMGateScale,
                                       merged ? 2 * a.inter : a.inter, a.hidden, "gate_w", int_dot);
  const Weight up = merged ? gate
                           : fused::weight_of(params, kMUpW, kMUpScale, a.inter, a.hidden,
                                              "up_w", int_dot);
  const Weight down =
      fused::weight_of(params, kMDownW, kMDownScale, a.hidden, a.inter, "down_w", int_dot);
  const Gated w{&gate, merged ? &gate : &up, &down, a.inter};

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const auto f32 = hidden.options();
  at::Tensor xn = at::empty({a.batch, a.hidden}, f32);
  at::Tensor gu = at::empty({3, a.batch, a.inter}, f32);
  at::Tensor d = at::empty({a.batch, a.hidden}, f32);
  at::Tensor out = at::empty({a.batch, a.hidden}, f32);
  float* g = gu.data_ptr<float>();
  run_mlp(a, w, hidden.data_ptr<float>(), xn.data_ptr<float>(), g, g + a.batch * a.inter,
          g + 2 * a.batch * a.inter, d.data_ptr<float>(), out.data_ptr<float>());
  return out.to(out_dtype);
}

// ---------------------------------------------------------------------------------------------
// Sparse MoE.

enum MoeParam : size_t {
  kNormW, kRouterW, kRouterBias, kExpGateUpW, kExpDownW, kShGateW, kShUpW, kShDownW, kShGateProjW,
  kRouterScale, kExpGateUpScale, kExpDownScale, kShGateScale, kShUpScale, kShDownScale,
  kShGateProjScale, kNumMoeParams
};

struct Router {
  int64_t kind, top_k, n_group, topk_group;
  bool renormalize;
  float scaling, renorm_eps;
  const float* bias;  // (E,) or nullptr
};

// The larger value first, ties in ascending index.
inline bool before(const float* v, int64_t i, int64_t j) {
  return v[i] > v[j] || (v[i] == v[j] && i < j);
}

// Row `logits (E,)` -> `ids (k,)` and float32 `weights (k,)` (see the module comment);
// `scratch` holds 2E + E floats / ints.
void route_row(const Router& r, int64_t E, const float* logits, int64_t* ids, float* weights,
               std::vector<float>& vals, std::vector<int64_t>& order) {
  const int64_t k = r.top_k;
  vals.resize(E);
  order.resize(E);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (r.kind == 0) {
    const float* v = logits;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t i, int64_t j) { return before(v, i, j); });
    const float m = *std::max_element(logits, logits + E);
    float total = 0.0f, top = 0.0f;
    for (int64_t e = 0; e < E; ++e) total += std::exp(logits[e] - m);
    for (int64_t j = 0; j < k; ++j) {
      ids[j] = order[j];
      weights[j] = std::exp(logits[order[j]] - m);
      top += weights[j];
    }
    const float denom = r.renormalize ? top : total;
    for (int64_t j = 0; j < k; ++j) weights[j] /= denom;
    return;
  }
  // sigmoid: scores s, choice s + bias
  std::vector<float> scores(E);
  for (int64_t e = 0; e < E; ++e) {
    scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    vals[e] = scores[e] + (r.bias ? r.bias[e] : 0.0f);
  }
  if (r.n_group > 1) {
    const int64_t per = E / r.n_group;
    std::vector<float> gscore(r.n_group);
    for (int64_t gi = 0; gi < r.n_group; ++gi) {
      const float* v = vals.data() + gi * per;
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int64_t j = 0; j < per; ++j) {
        if (v[j] > b1) {
          b2 = b1;
          b1 = v[j];
        } else if (v[j] > b2) {
          b2 = v[j];
        }
      }
      gscore[gi] = b1 + b2;
    }
    std::vector<int64_t> gorder(r.n_group);
    std::iota(gorder.begin(), gorder.end(), int64_t{0});
    std::partial_sort(gorder.begin(), gorder.begin() + r.topk_group, gorder.end(),
                      [&](int64_t i, int64_t j) { return before(gscore.data(), i, j); });
    std::vector<char> keep(r.n_group, 0);
    for (int64_t j = 0; j < r.topk_group; ++j) keep[gorder[j]] = 1;
    for (int64_t e = 0; e < E; ++e) {
      if (!keep[e / per]) vals[e] = -INFINITY;
    }
  }
  const float* v = vals.data();
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t i, int64_t j) { return before(v, i, j); });
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = order[j];
    weights[j] = scores[order[j]];
    sum += weights[j];
  }
  for (int64_t j = 0; j < k; ++j) {
    if (r.renormalize) weights[j] /= (sum + r.renorm_eps);
    weights[j] *= r.scaling;
  }
}

struct MoeDims {
  int64_t batch, hidden, inter, experts, shared;  // shared: S, 0 without a shared expert
  int64_t act;
  float eps, rm;
  const float* norm_w;  // null: no norm (the stage's input is already normed)
  bool residual;        // false: out = rm * ffn, without h (a stage inside residual streams)
  Clip clip, shared_clip;  // the routed and the shared experts' SwiGLU clips
};

// The experts chosen by any row, ascending, each with the rows that chose it.
struct Chosen {
  int64_t count = 0;
  std::vector<int64_t> expert;    // (U,)
  std::vector<int64_t> first;     // (U + 1,): rows of expert u are slots [first[u], first[u+1])
  std::vector<int64_t> row;       // (slots,) the batch row of each slot
  std::vector<float> weight;      // (slots,) its routing weight
};

void collect(const MoeDims& d, int64_t k, const int64_t* ids, const float* weights, Chosen& c) {
  std::vector<int64_t> flat(ids, ids + d.batch * k);
  std::vector<int64_t> uniq = flat;
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
  c.count = static_cast<int64_t>(uniq.size());
  c.expert = uniq;
  c.first.assign(c.count + 1, 0);
  c.row.clear();
  c.weight.clear();
  for (int64_t u = 0; u < c.count; ++u) {
    c.first[u] = static_cast<int64_t>(c.row.size());
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t j = 0; j < k; ++j) {
        if (ids[b * k + j] == uniq[u]) {
          c.row.push_back(b);
          c.weight.push_back(weights[b * k + j]);
        }
      }
    }
  }
  c.first[c.count] = static_cast<int64_t>(c.row.size());
}

struct MoeIo {
  const Weight *router, *gate_up, *down;
  Gated shared;
  const Weight* shared_gate;  // (1, H) or nullptr
  const float* h;             // (B, H)
  float* xn;                  // (B, H)
  float* logits;              // (B, E)
  int64_t* ids;               // (B, k)
  float* weights;             // (B, k)
  float* xg;                  // (slots, H) the chosen rows' inputs, expert by expert
  float *g, *u, *z;           // (slots, I) each
  float* d;                   // (slots, H)
  float *sg, *su, *sz;        // (B, S) each
  float* sd;                  // (B, H)
  float* sgate;               // (B,)
  float* out;                 // (B, H)
};

void run_moe(const MoeDims& d, const Router& r, const MoeIo& io) {
  Chosen c;
  const int64_t k = r.top_k, I = d.inter, H = d.hidden;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
#pragma omp for schedule(static)
    for (int64_t b = 0; b < d.batch; ++b) {
      if (d.norm_w) {
        fused::rms_norm_row(io.h + b * H, d.norm_w, H, d.eps, io.xn + b * H);
      } else {
        std::copy(io.h + b * H, io.h + (b + 1) * H, io.xn + b * H);
      }
    }
    // The router's rows, the shared expert's gate/up channels and its gate's row.
    int64_t lo, hi;
    split(d.experts, fused::kRowBlock, tid, nth, lo, hi);
    if (lo < hi) gemv(*io.router, io.xn, H, d.batch, lo, hi, io.logits + lo, d.experts);
    if (d.shared) {
      const Gated& s = io.shared;
      split(d.shared, fused::kRowBlock, tid, nth, lo, hi);
      gate_up_rows(*s.gate, 0, *s.up, s.up == s.gate ? d.shared : 0, io.xn, H, d.batch, lo, hi,
                   io.sg, io.su, io.sz, d.shared, d.act, 1.0f, d.shared_clip);
      if (io.shared_gate && tid == nth - 1) {
        gemv(*io.shared_gate, io.xn, H, d.batch, 0, 1, io.sgate, 1);
      }
    }
#pragma omp barrier
#pragma omp single
    {
      std::vector<float> vals;
      std::vector<int64_t> order;
      for (int64_t b = 0; b < d.batch; ++b) {
        route_row(r, d.experts, io.logits + b * d.experts, io.ids + b * k, io.weights + b * k,
                  vals, order);
      }
      collect(d, k, io.ids, io.weights, c);
      if (d.batch > 1) {  // the rows of each expert together
        for (size_t s = 0; s < c.row.size(); ++s) {
          std::copy(io.xn + c.row[s] * H, io.xn + (c.row[s] + 1) * H, io.xg + s * H);
        }
      }
    }  // implicit barrier
    // Gate/up of every chosen expert: (expert, channel) pairs split over the threads.
    const int64_t pairs = c.count * I;
    split(pairs, fused::kRowBlock, tid, nth, lo, hi);
    for (int64_t u = lo / I; u < c.count && u * I < hi; ++u) {
      const int64_t i0 = std::max(lo, u * I) - u * I, i1 = std::min(hi, (u + 1) * I) - u * I;
      const int64_t s0 = c.first[u], m = c.first[u + 1] - s0, e = c.expert[u];
      const float* x = d.batch > 1 ? io.xg + s0 * H : io.xn;
      gate_up_rows(*io.gate_up, e * 2 * I, *io.gate_up, e * 2 * I + I, x, H, m, i0, i1,
                   io.g + s0 * I, io.u + s0 * I, io.z + s0 * I, I, d.act, 1.0f, d.clip);
    }
#pragma omp barrier
    // Down rows [lo, hi) of every chosen expert and of the shared expert, then the sums.
    split(H, fused::kRowBlock, tid, nth, lo, hi);
    if (lo < hi) {
      for (int64_t u = 0; u < c.count; ++u) {
        const int64_t s0 = c.first[u], m = c.first[u + 1] - s0, e = c.expert[u];
        gemv(*io.down, io.z + s0 * I, I, m, e * H + lo, e * H + hi, io.d + s0 * H + lo, H);
      }
      if (d.shared) {
        gemv(*io.shared.down, io.sz, d.shared, d.batch, lo, hi, io.sd + lo, H);
      }
      std::vector<float> acc(hi - lo);
      for (int64_t b = 0; b < d.batch; ++b) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t u = 0; u < c.count; ++u) {  // ascending expert id
          for (int64_t s = c.first[u]; s < c.first[u + 1]; ++s) {
            if (c.row[s] != b) continue;
            const float w = c.weight[s];
            const float* ds = io.d + s * H;
            for (int64_t r2 = lo; r2 < hi; ++r2) acc[r2 - lo] += ds[r2] * w;
          }
        }
        if (d.shared) {
          const float* sd = io.sd + b * H;
          if (io.shared_gate) {
            const float gate = 1.0f / (1.0f + std::exp(-io.sgate[b]));
            for (int64_t r2 = lo; r2 < hi; ++r2) acc[r2 - lo] += gate * sd[r2];
          } else {
            for (int64_t r2 = lo; r2 < hi; ++r2) acc[r2 - lo] += sd[r2];
          }
        }
        const float* hb = io.h + b * H;
        float* ob = io.out + b * H;
        for (int64_t r2 = lo; r2 < hi; ++r2) {
          const float y = d.rm == 1.0f ? acc[r2 - lo] : acc[r2 - lo] * d.rm;
          ob[r2] = d.residual ? hb[r2] + y : y;
        }
      }
    }
  }
}

at::Tensor fused_moe_decode(
    const at::Tensor& hidden_in, const c10::List<std::optional<at::Tensor>>& params,
    int64_t top_k, int64_t router_kind, bool renormalize, int64_t n_group, int64_t topk_group,
    double scaling, double renorm_eps, double norm_eps, int64_t act, double residual_multiplier,
    at::ScalarType out_dtype, bool int_dot, bool residual, double clip, double shared_clip,
    bool clip_before_act) {
  TORCH_CHECK(params.size() == kNumMoeParams, "params must hold ", kNumMoeParams, " entries");
  TORCH_CHECK(hidden_in.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(hidden_in.size(0) <= fused::kGemvMaxBatch, "fused_moe_decode takes at most ",
              fused::kGemvMaxBatch, " rows");
  TORCH_CHECK(act >= kSilu && act <= kRelu2, "act must be 0..4");
  TORCH_CHECK(router_kind == 0 || router_kind == 1, "router_kind must be 0 (softmax) or 1 "
              "(sigmoid)");
  MoeDims d{};
  d.batch = hidden_in.size(0);
  d.hidden = hidden_in.size(1);
  const std::optional<at::Tensor> rw = params.get(kRouterW);
  TORCH_CHECK(rw.has_value() && rw->dim() == 2, "router_w is required, (E, H)");
  d.experts = rw->size(0);
  const std::optional<at::Tensor> down_t = params.get(kExpDownW);
  TORCH_CHECK(down_t.has_value() && down_t->dim() == 2 && down_t->size(0) % d.experts == 0,
              "experts_down_w is required, (E * H, I)");
  const std::optional<at::Tensor> gu_t = params.get(kExpGateUpW);
  TORCH_CHECK(gu_t.has_value() && gu_t->dim() == 2 && gu_t->size(0) % (2 * d.experts) == 0,
              "experts_gate_up_w is required, (E * 2I, H)");
  d.inter = gu_t->size(0) / (2 * d.experts);
  TORCH_CHECK(top_k >= 1 && top_k <= d.experts, "top_k must be in [1, ", d.experts, "]");
  TORCH_CHECK(n_group >= 1 && d.experts % n_group == 0 && topk_group >= 1 &&
                  topk_group <= n_group && (n_group == 1 || d.experts / n_group >= 2),
              "n_group must divide the experts (groups of at least 2) and topk_group be in "
              "[1, n_group]");
  TORCH_CHECK(n_group == 1 || router_kind == 1, "groups need the sigmoid router");
  d.act = act;
  d.eps = static_cast<float>(norm_eps);
  d.rm = static_cast<float>(residual_multiplier);
  d.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  d.residual = residual;
  TORCH_CHECK(clip >= 0.0 && shared_clip >= 0.0, "the SwiGLU clips must be >= 0 (0: none)");
  d.clip = Clip{static_cast<float>(clip), clip_before_act};
  d.shared_clip = Clip{static_cast<float>(shared_clip), clip_before_act};
  Router r{};
  r.kind = router_kind;
  r.top_k = top_k;
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.renormalize = renormalize;
  r.scaling = static_cast<float>(scaling);
  r.renorm_eps = static_cast<float>(renorm_eps);
  r.bias = fused::param_f32(params, kRouterBias, d.experts, "router bias");

  const Weight router =
      fused::weight_of(params, kRouterW, kRouterScale, d.experts, d.hidden, "router_w", int_dot);
  const Weight gate_up = fused::weight_of(params, kExpGateUpW, kExpGateUpScale,
                                          d.experts * 2 * d.inter, d.hidden, "experts_gate_up_w",
                                          int_dot);
  const Weight down = fused::weight_of(params, kExpDownW, kExpDownScale, d.experts * d.hidden,
                                       d.inter, "experts_down_w", int_dot);
  Weight sh_gate, sh_up, sh_down, sh_gate_proj;
  Gated shared{};
  const std::optional<at::Tensor> sg_t = params.get(kShGateW);
  if (sg_t.has_value()) {
    TORCH_CHECK(sg_t->dim() == 2, "shared_gate_w must be (S, H)");
    const bool merged = !params.get(kShUpW).has_value();
    d.shared = merged ? sg_t->size(0) / 2 : sg_t->size(0);
    sh_gate = fused::weight_of(params, kShGateW, kShGateScale, merged ? 2 * d.shared : d.shared,
                               d.hidden, "shared_gate_w", int_dot);
    if (!merged) {
      sh_up = fused::weight_of(params, kShUpW, kShUpScale, d.shared, d.hidden, "shared_up_w",
                               int_dot);
    }
    sh_down = fused::weight_of(params, kShDownW, kShDownScale, d.hidden, d.shared,
                               "shared_down_w", int_dot);
    shared = Gated{&sh_gate, merged ? &sh_gate : &sh_up, &sh_down, d.shared};
  } else {
    TORCH_CHECK(!params.get(kShGateProjW).has_value(), "a shared expert gate needs the shared "
                "expert");
  }
  const bool gated = params.get(kShGateProjW).has_value();
  if (gated) {
    sh_gate_proj = fused::weight_of(params, kShGateProjW, kShGateProjScale, 1, d.hidden,
                                    "shared_gate_proj_w", int_dot);
  }

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const auto f32 = hidden.options();
  const int64_t B = d.batch, H = d.hidden, slots = B * top_k, S = std::max<int64_t>(d.shared, 1);
  at::Tensor xn = at::empty({B, H}, f32);
  at::Tensor logits = at::empty({B, d.experts}, f32);
  at::Tensor ids = at::empty({B, top_k}, f32.dtype(at::kLong));
  at::Tensor weights = at::empty({B, top_k}, f32);
  at::Tensor xg = at::empty({B > 1 ? slots : 1, H}, f32);
  at::Tensor guz = at::empty({3, slots, d.inter}, f32);
  at::Tensor dd = at::empty({slots, H}, f32);
  at::Tensor sguz = at::empty({3, B, S}, f32);
  at::Tensor sd = at::empty({B, H}, f32);
  at::Tensor sgate = at::empty({B}, f32);
  at::Tensor out = at::empty({B, H}, f32);
  float* g = guz.data_ptr<float>();
  float* sg = sguz.data_ptr<float>();
  MoeIo io{&router, &gate_up, &down, shared, gated ? &sh_gate_proj : nullptr,
           hidden.data_ptr<float>(), xn.data_ptr<float>(), logits.data_ptr<float>(),
           ids.data_ptr<int64_t>(), weights.data_ptr<float>(), xg.data_ptr<float>(), g,
           g + slots * d.inter, g + 2 * slots * d.inter, dd.data_ptr<float>(), sg, sg + B * S,
           sg + 2 * B * S, sd.data_ptr<float>(), sgate.data_ptr<float>(), out.data_ptr<float>()};
  run_moe(d, r, io);
  return out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "fused_mlp_decode(Tensor hidden, Tensor?[] params, float norm_eps, int act, "
      "float gate_multiplier, float down_multiplier, float residual_multiplier, "
      "ScalarType out_dtype, bool int_dot=False, bool residual=True, float clip=0.0, "
      "bool clip_before_act=False) -> Tensor");
  m.def(
      "fused_moe_decode(Tensor hidden, Tensor?[] params, int top_k, int router_kind, "
      "bool renormalize, int n_group, int topk_group, float scaling, float renorm_eps, "
      "float norm_eps, int act, float residual_multiplier, ScalarType out_dtype, "
      "bool int_dot=False, bool residual=True, float clip=0.0, float shared_clip=0.0, "
      "bool clip_before_act=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("fused_mlp_decode", &fused_mlp_decode);
  m.impl("fused_moe_decode", &fused_moe_decode);
}

}  // namespace vllm_mamba
