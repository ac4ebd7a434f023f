// One RWKV-7 decoder layer's decode step for a few sequences in one call
// (`fused_rwkv7_decode`): the layer-0 pre-norm, the time mix with its norm and residual, and
// the channel mix with its norm and residual (`vllm_mamba/layers/rwkv7.py`,
// `vllm_mamba/models/rwkv7.py`).
//
// Decode with a few sequences reads every weight once per token; the unfused layer runs about
// forty Python-level ops per layer around its projections, which at one sequence cost as much
// as the weights' streaming. Here the projections are weight-streaming matrix-vector products
// (`gemv.h`, float32, bfloat16, int8 or 4-bit weights), the independent ones of a stage in one
// parallel region with each weight's rows split over the threads:
//
//   stage A: r, k, v and the four LoRAs' first matrices (w, a, g, and v after layer 0)
//   stage B: the LoRAs' second matrices
//   the glue around the wkv rule: the `rwkv7_fused_update` op (`rwkv.cpp`)
//   o_proj, then the channel mix's key and value
//
// The norms, shift mixes and activations run between them in float32, and each value is rounded
// to the model dtype where the unfused layer holds it as a tensor of that dtype (the norms'
// outputs, the mixes, each projection's output, the LoRAs' activations, the squared ReLU, the
// residual stream), so that a bfloat16 model decodes as the unfused layer does up to orders of
// summation. The token shifts go through the `rwkv7_shift_mix` op, so the shift states keep
// their own dtype rules. Speculative chains (`src_state_indices`: row b reads the states of slot
// src[b], writes slot state_indices[b]) pass through to the two stateful ops, which run the
// rows in order; the products stream the weights once for every row, each row's bits a one-row
// call's (`gemv.h`), so a chain's states equal its tokens decoded one by one. Up to `kMaxRows`
// rows (and chains of any length) the projections stream the weights; more rows run them as
// GEMMs (`fused::project`: oneDNN for float32, bfloat16 GEMMs where the CPU has bfloat16
// instructions, the int8 / 4-bit ops), with the elementwise stages over the threads.
//
// Glossary: B rows, H hidden, C = NH * Dk keys, CV values, F the channel mix's width, r* the
// LoRA ranks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "fused_decode.h"
#include "math.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kMaxRows = fused::kGemvMaxBatch;

// The order of `params` (`vllm_mamba/ops/fused_decode.py`: RWKV7_PARAMS). Norm weights and
// biases, the mixes and the LoRA biases are float32; k_k, k_a, r_k and the group norm's
// weights are in the model dtype (read by `rwkv7_fused_update`); the mixes `(6, 1, H)` and the
// channel mix's `x_k (H,)` in the model dtype (read by `rwkv7_shift_mix`). Each projection
// weight has its int8 / 4-bit scale in the matching `*_S` entry (None for a float weight).
enum Param : size_t {
  kPreW, kPreB, kAttnW, kAttnB, kMixes,
  kRW, kKW, kVW, kOW,
  kW1, kW2, kW2B, kA1, kA2, kA2B, kG1, kG2, kV1, kV2, kV2B,
  kKk, kKa, kRk, kGnW, kGnB,
  kFfnW, kFfnB, kCmXk, kKeyW, kValW,
  kRS, kKS, kVS, kOS, kW1S, kW2S, kA1S, kA2S, kG1S, kG2S, kV1S, kV2S, kKeyS, kValS,
  kNumParams
};

using Params = c10::List<std::optional<at::Tensor>>;

at::Tensor tensor_of(const Params& params, size_t i, const char* what) {
  const std::optional<at::Tensor> t = params.get(i);
  TORCH_CHECK(t.has_value(), what, " is required");
  return *t;
}

// x rounded to bfloat16 in place (and widened back) when `round`.
inline void round_all(float* x, int64_t n, bool round) {
  if (!round) return;
  for (int64_t i = 0; i < n; ++i) x[i] = vec::bf16_to_f32(vec::f32_to_bf16(x[i]));
}

// out = (x - mean) / sqrt(var + eps) * w + b over one row (`nn.LayerNorm`), float32.
void layer_norm_row(const float* x, const float* w, const float* b, int64_t n, float eps,
                    float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += (x[i] - mean) * (x[i] - mean);
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * rstd * w[i] + (b ? b[i] : 0.0f);
}

// fn(r) for rows r in [0, rows), over the threads when there are many (many-stream decode).
template <typename Fn>
void each_row(int64_t rows, Fn&& fn) {
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) fn(r);
  });
}

// Every row of x (B, n) through a LayerNorm into out, rounded to the model dtype.
void layer_norm(const float* x, const Params& params, size_t wi, size_t bi, int64_t rows,
                int64_t n, float eps, bool round, float* out) {
  const float* w = fused::param_f32(params, wi, n, "a norm weight");
  TORCH_CHECK(w != nullptr, "the layer's norm weights are required");
  const float* b = fused::param_f32(params, bi, n, "a norm bias");
  each_row(rows, [&](int64_t r) {
    layer_norm_row(x + r * n, w, b, n, eps, out + r * n);
    round_all(out + r * n, n, round);
  });
}

// h += y over (B, n), rounded to the model dtype: a residual add.
void add_rows(float* h, const float* y, int64_t rows, int64_t n, bool round) {
  each_row(rows, [&](int64_t r) {
    float* hr = h + r * n;
    const float* yr = y + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) hr[i] += yr[i];
    round_all(hr, n, round);
  });
}

// One projection of a stage: out (B, rows) = x (B, k) @ w^T, then + bias, rounded.
struct Proj {
  fused::Weight w;
  at::Tensor x;    // (B, k) float32, contiguous
  at::Tensor out;  // (B, rows) float32, contiguous
  const float* bias;
};

// The projections of one stage; biases added and the outputs rounded after. Up to `kMaxRows`
// rows, and a speculative chain's rows (`chain`: each row's bits a one-row call's), they run in
// one parallel region, each weight's rows split over the threads (in whole blocks of `gemv.h`'s
// rows); more rows run each projection as a GEMM (`fused::project`).
void project_stage(const std::vector<Proj>& stage, int64_t batch, bool round, bool chain) {
  if (batch > kMaxRows && !chain) {
    for (const Proj& p : stage) {
      at::Tensor out = p.out;
      fused::project(p.x, p.w, out);
    }
    at::parallel_for(0, static_cast<int64_t>(stage.size()) * batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const Proj& p = stage[t / batch];
        const int64_t n = p.out.size(1);
        float* o = p.out.data_ptr<float>() + (t % batch) * n;
        if (p.bias) {
          for (int64_t r = 0; r < n; ++r) o[r] += p.bias[r];
        }
        round_all(o, n, round);
      }
    });
    return;
  }
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
    for (const Proj& p : stage) {
      const int64_t rows = p.out.size(1);
      int64_t lo, hi;
      fused::split(rows, fused::kRowBlock, tid, nth, lo, hi);
      if (lo >= hi) continue;
      float* out = p.out.data_ptr<float>();
      fused::gemv(p.w, p.x.data_ptr<float>(), p.w.k, batch, lo, hi, out + lo, rows);
      for (int64_t b = 0; b < batch; ++b) {
        float* o = out + b * rows;
        if (p.bias) {
          for (int64_t r = lo; r < hi; ++r) o[r] += p.bias[r];
        }
        if (round) round_all(o + lo, hi - lo, true);
      }
    }
  }
}

at::Tensor shift_mix(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& slots,
                     const at::Tensor& mixes, const std::optional<at::Tensor>& src) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_mamba::rwkv7_shift_mix", "")
          .typed<at::Tensor(const at::Tensor&, at::Tensor, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&)>();
  return op.call(x, shift, slots, mixes, src);
}

std::tuple<at::Tensor, at::Tensor> fused_rwkv7_decode(
    const at::Tensor& hidden, const Params& params, at::Tensor tm_shift, at::Tensor wkv_states,
    at::Tensor cm_shift, const at::Tensor& state_indices, const std::optional<at::Tensor>& v_first,
    double norm_eps, double gn_eps, const std::optional<at::Tensor>& src_state_indices) {
  TORCH_CHECK(params.size() == kNumParams, "params must hold ", kNumParams, " entries");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be (B, H)");
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "hidden must be float32 or bfloat16");
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t batch = hidden.size(0), hid = hidden.size(1);
  TORCH_CHECK(batch >= 1, "fused_rwkv7_decode needs at least one row");
  TORCH_CHECK(wkv_states.dim() == 4, "wkv_states must be (S, NH, Dv, Dk)");
  const int64_t heads = wkv_states.size(1), dv = wkv_states.size(2), dk = wkv_states.size(3);
  const int64_t keys = heads * dk, values = heads * dv;
  const bool first_layer = !v_first.has_value();
  const bool chain = src_state_indices.has_value();
  const float eps = static_cast<float>(norm_eps);
  auto weight = [&](size_t i, size_t si, int64_t rows, int64_t cols, const char* what) {
    return fused::weight_of(params, i, si, rows, cols, what);
  };
  auto rank_of = [&](size_t i, const char* what) { return tensor_of(params, i, what).size(0); };
  const int64_t rw = rank_of(kW1, "w_lora.0"), ra = rank_of(kA1, "a_lora.0");
  const int64_t rg = rank_of(kG1, "g_lora.0");
  const int64_t rv = first_layer ? 0 : rank_of(kV1, "v_lora.0");
  const int64_t ffn = rank_of(kKeyW, "ffn.key");
  const auto f32 = at::TensorOptions().dtype(at::kFloat);

  // The residual stream, float32 (holding model-dtype values).
  at::Tensor h = hidden.to(at::kFloat).contiguous().clone();
  float* hp = h.data_ptr<float>();
  if (params.get(kPreW).has_value()) {  // layer 0: pre_norm, the stream from then on
    at::Tensor pre = at::empty({batch, hid}, f32);
    layer_norm(hp, params, kPreW, kPreB, batch, hid, eps, bf16, pre.data_ptr<float>());
    h = pre;
    hp = h.data_ptr<float>();
  }
  at::Tensor x = at::empty({batch, hid}, f32);
  layer_norm(hp, params, kAttnW, kAttnB, batch, hid, eps, bf16, x.data_ptr<float>());
  const at::Tensor mixed =
      shift_mix(x.to(dtype), tm_shift, state_indices, tensor_of(params, kMixes, "mixes"),
                src_state_indices)
          .to(at::kFloat)
          .contiguous();  // (6, B, H): x_r, x_w, x_k, x_v, x_a, x_g
  auto mix = [&](int m) { return mixed.select(0, m); };

  // Stage A: r, k, v and the LoRAs' first matrices.
  at::Tensor r = at::empty({batch, keys}, f32), k = at::empty({batch, keys}, f32);
  at::Tensor v = at::empty({batch, values}, f32);
  at::Tensor wd = at::empty({batch, rw}, f32), ad = at::empty({batch, ra}, f32);
  at::Tensor gd = at::empty({batch, rg}, f32), vd = at::empty({batch, std::max<int64_t>(rv, 1)}, f32);
  std::vector<Proj> stage{
      {weight(kRW, kRS, keys, hid, "r_proj"), mix(0), r, nullptr},
      {weight(kKW, kKS, keys, hid, "k_proj"), mix(2), k, nullptr},
      {weight(kVW, kVS, values, hid, "v_proj"), mix(3), v, nullptr},
      {weight(kW1, kW1S, rw, hid, "w_lora.0"), mix(1), wd, nullptr},
      {weight(kA1, kA1S, ra, hid, "a_lora.0"), mix(4), ad, nullptr},
      {weight(kG1, kG1S, rg, hid, "g_lora.0"), mix(5), gd, nullptr},
  };
  if (!first_layer) stage.push_back({weight(kV1, kV1S, rv, hid, "v_lora.0"), mix(3), vd, nullptr});
  project_stage(stage, batch, bf16, chain);
  {
    float* p = wd.data_ptr<float>();
    for (int64_t i = 0; i < batch * rw; ++i) p[i] = std::tanh(p[i]);
    round_all(p, batch * rw, bf16);
    p = gd.data_ptr<float>();
    for (int64_t i = 0; i < batch * rg; ++i) p[i] = 1.0f / (1.0f + exp_f32(-p[i]));
    round_all(p, batch * rg, bf16);
  }

  // Stage B: the LoRAs' second matrices (raw: the glue applies the sigmoids).
  at::Tensor w = at::empty({batch, keys}, f32), a = at::empty({batch, keys}, f32);
  at::Tensor g = at::empty({batch, values}, f32), vg = at::empty({batch, values}, f32);
  stage = {
      {weight(kW2, kW2S, keys, rw, "w_lora.2"), wd, w,
       fused::param_f32(params, kW2B, keys, "w_lora.2.bias")},
      {weight(kA2, kA2S, keys, ra, "a_lora.2"), ad, a,
       fused::param_f32(params, kA2B, keys, "a_lora.2.bias")},
      {weight(kG2, kG2S, values, rg, "g_lora.2"), gd, g, nullptr},
  };
  if (!first_layer) {
    stage.push_back({weight(kV2, kV2S, values, rv, "v_lora.2"), vd, vg,
                     fused::param_f32(params, kV2B, values, "v_lora.2.bias")});
  }
  project_stage(stage, batch, bf16, chain);

  // The glue around the rule, in the model dtype.
  static const auto glue =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_mamba::rwkv7_fused_update", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, at::Tensor,
                            const at::Tensor&, const std::optional<at::Tensor>&)>();
  const at::Tensor v_model = v.to(dtype);
  std::optional<at::Tensor> gate;
  if (!first_layer) gate = vg.to(dtype);
  const at::Tensor o = glue.call(
      r.to(dtype), w.to(dtype), k.to(dtype), v_model, a.to(dtype), g.to(dtype), v_first, gate,
      tensor_of(params, kKk, "k_k"), tensor_of(params, kKa, "k_a"), tensor_of(params, kRk, "r_k"),
      tensor_of(params, kGnW, "g_norm.weight"), tensor_of(params, kGnB, "g_norm.bias"), gn_eps,
      wkv_states, state_indices, src_state_indices);
  const at::Tensor of = o.to(at::kFloat).contiguous();

  // o_proj and the residual.
  at::Tensor out = at::empty({batch, hid}, f32);
  project_stage({{weight(kOW, kOS, hid, values, "o_proj"), of, out, nullptr}},
                batch, bf16, chain);
  const float* op = out.data_ptr<float>();
  add_rows(hp, op, batch, hid, bf16);

  // The channel mix: value(relu(key(x + (x' - x) * x_k)) ** 2), and the residual.
  at::Tensor y = at::empty({batch, hid}, f32);
  layer_norm(hp, params, kFfnW, kFfnB, batch, hid, eps, bf16, y.data_ptr<float>());
  const at::Tensor xk =
      shift_mix(y.to(dtype), cm_shift, state_indices, tensor_of(params, kCmXk, "ffn.x_k"),
                src_state_indices)
          .to(at::kFloat)
          .contiguous();  // (B, H)
  at::Tensor key = at::empty({batch, ffn}, f32);
  project_stage({{weight(kKeyW, kKeyS, ffn, hid, "ffn.key"), xk, key, nullptr}},
                batch, bf16, chain);
  float* kp = key.data_ptr<float>();
  each_row(batch, [&](int64_t r) {
    float* kr = kp + r * ffn;
    for (int64_t i = 0; i < ffn; ++i) {
      const float relu = kr[i] > 0.0f ? kr[i] : 0.0f;
      kr[i] = relu * relu;
    }
    round_all(kr, ffn, bf16);
  });
  project_stage({{weight(kValW, kValS, hid, ffn, "ffn.value"), key, out, nullptr}},
                batch, bf16, chain);
  add_rows(hp, op, batch, hid, bf16);
  return {h.to(dtype), v_model};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "fused_rwkv7_decode(Tensor hidden, Tensor?[] params, Tensor(a!) tm_shift, "
      "Tensor(b!) wkv_states, Tensor(c!) cm_shift, Tensor state_indices, Tensor? v_first, "
      "float norm_eps, float gn_eps, Tensor? src_state_indices=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("fused_rwkv7_decode", &fused_rwkv7_decode); }

}  // namespace vllm_mamba
