// One attention block's decode step for a few sequences in one call (`fused_attention_decode`,
// the attention layers of the hybrids: GQA / MQA with optional output gate, per-head q/k norms,
// key multiplier, partial NeoX RoPE): block RMSNorm (optional) -> q, k, v projections -> q/k
// norms, key multiplier, RoPE -> the keys and values into the paged cache -> paged decode
// attention -> sigmoid(gate) -> o_proj (+ the residual when the block norm is given).
//
// Semantics are those of the unfused path: `SelfAttention.forward` with `PagedAttention` and
// the ops `reshape_and_cache` and `paged_decode_attention`, which this kernel calls (through
// the dispatcher) for the cache write and the attention itself. Every row is a decode row: its
// key and value go to its `slot_mapping` slot before any row attends, so rows of one sequence
// (speculative chains) see each other's keys as the unfused layer's do. All intermediates are
// float32; the keys and values are rounded to the cache's dtype and the queries to it too (the
// unfused path's activations are in the model dtype, which the cache shares).
//
// Up to `kGemvMaxBatch` rows the projections stream their weights inside OpenMP regions (q, k
// and v rows split over the threads together); more rows run them as GEMMs. `rows_alone`
// (a step with speculative chains) computes every row's products exactly as a one-row call
// does, at any number of rows, so a chain's states are bit for bit those of one-by-one decoding.
//
// Glossary: B rows, H hidden, Hq / Hkv query / key-value heads of D, R rotated dims per head,
// NQ = Hq D (2 Hq D with the output gate: [query D | gate D] per head), NK = Hkv D.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fused_decode.h"
#include "kernel_math.h"

namespace vllm_mamba {
namespace {

using fused::gemv;
using fused::split;
using fused::Weight;

// Index of each entry of the `params` list (`ATTENTION_PARAMS`, `vllm_mamba/ops/paged_attention.py`).
enum Param : size_t {
  kNormW, kQW, kQB, kKW, kKB, kVW, kVB, kOW, kOB, kQNormW, kKNormW, kQScale, kKScale, kVScale,
  kOScale, kNumParams
};  // clang-format off

struct Dims {
  int64_t batch, hidden, heads, kv_heads, dim, rot, nq, nk, nin;
  bool gate;
};

struct Small {  // float32 parameters; nullptr when absent
  const float *norm_w, *q_b, *k_b, *v_b, *o_b, *q_norm_w, *k_norm_w;
  float norm_eps, qk_eps, key_mult;
  float res_scale;  // the residual multiplier (block mode): hidden + res_scale * o_proj
};

// The rows [lo, hi) of the concatenated [q | k | v] products of `batch` rows of xn (H), into
// qkv (B, NIN): each projection's part of the range.
void qkv_rows(const Dims& d, const Weight* w[3], const float* bias[3], const float* xn,
              float* qkv, int64_t lo, int64_t hi) {
  const int64_t starts[4] = {0, d.nq, d.nq + d.nk, d.nin};
  for (int p = 0; p < 3; ++p) {
    const int64_t a = std::max(lo, starts[p]), b = std::min(hi, starts[p + 1]);
    if (a >= b) continue;
    const int64_t off = starts[p];
    gemv(*w[p], xn, d.hidden, d.batch, a - off, b - off, qkv + a, d.nin);
    if (bias[p]) {
      for (int64_t r = 0; r < d.batch; ++r) {
        for (int64_t i = a; i < b; ++i) qkv[r * d.nin + i] += bias[p][i - off];
      }
    }
  }
}

// RMSNorm of one head's D values in place (weight `w` (D,) or none), then the key multiplier
// `mult` and the NeoX rotation of its first R dims by `cs` (R: cos | sin), when given.
void head_post(float* x, const float* w, float eps, float mult, const float* cs, int64_t dim,
               int64_t rot) {
  if (w) fused::rms_norm_row(x, w, dim, eps, x);
  if (mult != 1.0f) {
    for (int64_t i = 0; i < dim; ++i) x[i] *= mult;
  }
  if (!cs) return;
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[i], s = cs[half + i], a = x[i], b = x[half + i];
    x[i] = a * c - b * s;
    x[half + i] = b * c + a * s;
  }
}

at::Tensor fused_attention_decode(
    const at::Tensor& hidden_in, const c10::List<std::optional<at::Tensor>>& params,
    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const std::optional<at::Tensor>& rope_table, const std::optional<at::Tensor>& rope_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool output_gate, double scale,
    double key_multiplier, double norm_eps, double qk_eps, at::ScalarType out_dtype,
    bool int_dot, bool rows_alone, int64_t sliding_window, double residual_scale) {
  TORCH_CHECK(params.size() == kNumParams, "params must hold ", kNumParams, " entries");
  TORCH_CHECK(hidden_in.dim() == 2, "hidden must be (B, H)");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
              "num_heads must be a positive multiple of num_kv_heads");
  Dims d{};
  d.batch = hidden_in.size(0);
  d.hidden = hidden_in.size(1);
  d.heads = num_heads;
  d.kv_heads = num_kv_heads;
  d.dim = head_dim;
  d.gate = output_gate;
  d.nq = num_heads * head_dim * (output_gate ? 2 : 1);
  d.nk = num_kv_heads * head_dim;
  d.nin = d.nq + 2 * d.nk;
  TORCH_CHECK(rope_table.has_value() == rope_rows.has_value(), "rope_table and rope_rows together");
  const float* table = nullptr;
  const int64_t* rows = nullptr;
  at::Tensor rows_t;
  if (rope_table.has_value()) {
    TORCH_CHECK(rope_table->scalar_type() == at::kFloat && rope_table->is_contiguous() &&
                    rope_table->dim() == 2 && rope_table->size(1) % 2 == 0 &&
                    rope_table->size(1) <= head_dim,
                "rope_table must be contiguous float32 (P, R), R even and at most head_dim");
    d.rot = rope_table->size(1);
    rows_t = as_index(*rope_rows);
    TORCH_CHECK(rows_t.dim() == 1 && rows_t.size(0) == d.batch, "rope_rows must be (B,)");
    const int64_t* r = rows_t.data_ptr<int64_t>();
    for (int64_t b = 0; b < d.batch; ++b) {
      TORCH_CHECK(r[b] >= 0 && r[b] < rope_table->size(0), "rope row ", r[b], " out of range");
    }
    table = rope_table->data_ptr<float>();
    rows = r;
  }
  const Weight q_w = fused::weight_of(params, kQW, kQScale, d.nq, d.hidden, "q_proj weight", int_dot);
  const Weight k_w = fused::weight_of(params, kKW, kKScale, d.nk, d.hidden, "k_proj weight", int_dot);
  const Weight v_w = fused::weight_of(params, kVW, kVScale, d.nk, d.hidden, "v_proj weight", int_dot);
  const Weight o_w = fused::weight_of(params, kOW, kOScale, d.hidden, num_heads * head_dim,
                                      "o_proj weight", int_dot);
  Small s{};
  s.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  s.q_b = fused::param_f32(params, kQB, d.nq, "q_proj bias");
  s.k_b = fused::param_f32(params, kKB, d.nk, "k_proj bias");
  s.v_b = fused::param_f32(params, kVB, d.nk, "v_proj bias");
  s.o_b = fused::param_f32(params, kOB, d.hidden, "o_proj bias");
  s.q_norm_w = fused::param_f32(params, kQNormW, head_dim, "q_norm weight");
  s.k_norm_w = fused::param_f32(params, kKNormW, head_dim, "k_norm weight");
  TORCH_CHECK((s.q_norm_w == nullptr) == (s.k_norm_w == nullptr), "q_norm and k_norm together");
  s.norm_eps = static_cast<float>(norm_eps);
  s.qk_eps = static_cast<float>(qk_eps);
  s.res_scale = static_cast<float>(residual_scale);
  TORCH_CHECK(residual_scale == 1.0 || s.norm_w, "residual_scale needs the block norm");
  s.key_mult = static_cast<float>(key_multiplier);

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const auto f32 = hidden.options();
  at::Tensor xn = s.norm_w ? at::empty({d.batch, d.hidden}, f32) : hidden;
  at::Tensor qkv = at::empty({d.batch, d.nin}, f32);
  const float* hp = hidden.data_ptr<float>();
  float *xp = xn.data_ptr<float>(), *qp = qkv.data_ptr<float>();
  const Weight* ws[3] = {&q_w, &k_w, &v_w};
  const float* bs[3] = {s.q_b, s.k_b, s.v_b};
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        fused::rms_norm_row(hp + b * d.hidden, s.norm_w, d.hidden, s.norm_eps, xp + b * d.hidden);
      }
    });
  }
  if (d.batch <= fused::kGemvMaxBatch || rows_alone) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      int64_t lo, hi;
      split(d.nin, fused::kRowBlock, fused::thread_id(), fused::num_threads(), lo, hi);
      qkv_rows(d, ws, bs, xp, qp, lo, hi);
    }
  } else {
    const int64_t starts[4] = {0, d.nq, d.nq + d.nk, d.nin};
    for (int p = 0; p < 3; ++p) {
      at::Tensor part = at::empty({d.batch, starts[p + 1] - starts[p]}, f32);
      fused::project(xn, *ws[p], part);
      if (bs[p]) part.add_(at::from_blob(const_cast<float*>(bs[p]), {part.size(1)}, f32));
      qkv.narrow(1, starts[p], part.size(1)).copy_(part);
    }
  }
  // q / k heads: norms, key multiplier, rotation (in place in qkv).
  const int64_t q_stride = d.gate ? 2 * d.dim : d.dim;
  at::parallel_for(0, d.batch * (d.heads + d.kv_heads), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / (d.heads + d.kv_heads), h = t % (d.heads + d.kv_heads);
      const float* cs = table ? table + rows[b] * d.rot : nullptr;
      float* row = qp + b * d.nin;
      if (h < d.heads) {
        head_post(row + h * q_stride, s.q_norm_w, s.qk_eps, 1.0f, cs, d.dim, d.rot);
      } else {
        head_post(row + d.nq + (h - d.heads) * d.dim, s.k_norm_w, s.qk_eps, s.key_mult, cs, d.dim,
                  d.rot);
      }
    }
  });
  const auto cache_dtype = k_cache.scalar_type();
  at::Tensor q = qkv.narrow(1, 0, d.nq).view({d.batch, d.heads, q_stride});
  if (d.gate) q = q.narrow(2, 0, d.dim);
  q = q.to(cache_dtype).contiguous();  // (B, Hq, D)
  const at::Tensor k = qkv.narrow(1, d.nq, d.nk).view({d.batch, d.kv_heads, d.dim}).to(cache_dtype);
  const at::Tensor v =
      qkv.narrow(1, d.nq + d.nk, d.nk).view({d.batch, d.kv_heads, d.dim}).to(cache_dtype);
  static const auto cache_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_mamba::reshape_and_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                      const at::Tensor&)>();
  static const auto attend_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_mamba::paged_decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, int64_t,
                            const c10::optional<at::Tensor>&,
                            const c10::optional<at::Tensor>&)>();
  cache_op.call(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping);
  at::Tensor attn = attend_op.call(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                   sliding_window, c10::nullopt, c10::nullopt)
                        .to(at::kFloat)
                        .reshape({d.batch, d.heads * d.dim})
                        .contiguous();  // (B, Hq D)
  float* ap = attn.data_ptr<float>();
  if (d.gate) {
    at::parallel_for(0, d.batch * d.heads, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t b = t / d.heads, h = t % d.heads;
        const float* g = qp + b * d.nin + h * 2 * d.dim + d.dim;
        float* o = ap + b * d.heads * d.dim + h * d.dim;
        for (int64_t i = 0; i < d.dim; ++i) o[i] *= 1.0f / (1.0f + exp_f32(-g[i]));
      }
    });
  }
  at::Tensor mixed = at::empty({d.batch, d.hidden}, f32);
  float* mp = mixed.data_ptr<float>();
  const float* resid = s.norm_w ? hp : nullptr;
  if (d.batch <= fused::kGemvMaxBatch || rows_alone) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      int64_t lo, hi;
      split(d.hidden, fused::kRowBlock, fused::thread_id(), fused::num_threads(), lo, hi);
      gemv(o_w, ap, d.heads * d.dim, d.batch, lo, hi, mp + lo, d.hidden);
      for (int64_t b = 0; b < d.batch; ++b) {
        fused::finish_row(mp + b * d.hidden + lo, s.o_b ? s.o_b + lo : nullptr,
                          resid ? resid + b * d.hidden + lo : nullptr, hi - lo, s.res_scale);
      }
    }
  } else {
    fused::project(attn, o_w, mixed);
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        fused::finish_row(mp + b * d.hidden, s.o_b, resid ? resid + b * d.hidden : nullptr,
                          d.hidden, s.res_scale);
      }
    });
  }
  return mixed.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "fused_attention_decode(Tensor hidden, Tensor?[] params, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor? rope_table, Tensor? rope_rows, int num_heads, int num_kv_heads, int head_dim, "
      "bool output_gate, float scale, float key_multiplier, float norm_eps, float qk_eps, "
      "ScalarType out_dtype, bool int_dot=False, bool rows_alone=False, int sliding_window=0, "
      "float residual_scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("fused_attention_decode", &fused_attention_decode);
}

}  // namespace vllm_mamba
