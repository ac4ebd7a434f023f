// A sparse MoE's routed experts for many rows at once (prefill, mixed and batched steps):
//
//   out (T, H) float32 = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]),
//   expert_e(x) = down_e(act(gate_e(x)) * up_e(x))   (the SwiGLU optionally clipped),
//
// the chosen experts of each row summed in ascending expert id (`layers.moe.dispatch_experts`'
// order), with the experts stacked as `fused_moe_decode` reads them: gate/up (E * 2I, H)
// (expert e's rows [2Ie, 2Ie + I) gate, [2Ie + I, 2I(e + 1)) up) and down (E * H, I).
//
// The (row, choice) pairs ("slots") are sorted by expert, rows ascending within an expert, so
// that each chosen expert's rows lie together. With integer dot products (`int_dot`:
// `quantization="w8a8"` / `"w4a8"` / `"w4a8_k"`) the whole stage is one parallel region: the
// rows are quantised once and each chosen expert's gathered from them (into the GEMM's panels,
// `int_dot_gemm.h`, from `kMinGemmRows` rows, else into `int_dot::QActs` for the
// weight-streaming rows path), then the (expert, block of output channels) tasks of the gate/up
// product are split over the threads by their cost, the activation and the down product's
// quantisation run expert by expert, the down product's tasks likewise, and each row's sum last.
// Both paths give a row the bits `w8a8_linear` / `w4a8_linear` give it (a row's products never
// depend on the batch). The other weights (float32, bfloat16, int8, 4-bit weight-only) run each
// chosen expert's two products as GEMMs through the linear ops (`fused::project`), expert by
// expert, without a Python loop.
//
// All intermediates are float32. `ops.ffn.moe_experts_ref` is the reference.
//
// Glossary: T rows, k experts per row, H hidden, I expert width, E experts, U experts chosen by
// any row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_gemm.h"
#include "ffn_math.h"
#include "fused_decode.h"
#include "int_dot.h"
#include "int_dot_gemm.h"

namespace vllm_mamba {
namespace {

namespace gemm = int_dot::gemm;
using fused::Weight;

enum Param : size_t { kGateUpW, kDownW, kGateUpScale, kDownScale, kNumParams };

// Rows of an expert from which its products take the GEMM (below, the rows path). One expert's
// products at Qwen3.6-35B-A3B's shapes (w4a8, 2 threads of a Zen 5, `benchmarks/
// moe_experts_bench.py --min-gemm-rows`): on AVX-512 (C = 6) the GEMM equals the rows path at
// 4 rows (92 us) and leads from 5 (6 rows: 88 against 137 us; 3 rows: 92 against 77); on AVX2
// (C = 3) from about 5-6.
constexpr int64_t kMinGemmRows = gemm::C >= 6 ? 4 : 6;
constexpr int64_t kRowsTask = 64;  // output channels per task of the rows path, at least

// The slots (row, choice) by expert: expert u of the U chosen (ascending id `expert[u]`) owns
// slots [first[u], first[u + 1]), rows ascending; slot s is row `row[s]`'s choice of weight
// `weight[s]`; row t's k slots are `of_row[t k .. t k + k)`, ascending (ascending expert id).
struct Slots {
  std::vector<int64_t> expert, first, row, of_row;
  std::vector<float> weight;
};

Slots sort_slots(const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t E) {
  Slots s;
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "moe_experts: expert id ", ids[i], " is not in [0, ",
                E, ")");
    ++start[ids[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > 0) s.expert.push_back(e);  // still its count here
    start[e + 1] += start[e];
  }
  for (const int64_t e : s.expert) s.first.push_back(start[e]);
  s.first.push_back(T * k);
  s.row.resize(T * k);
  s.weight.resize(T * k);
  s.of_row.resize(T * k);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = start[ids[t * k + j]]++;
      s.row[slot] = t;
      s.weight[slot] = weights[t * k + j];
      s.of_row[t * k + j] = slot;
    }
    std::sort(s.of_row.begin() + t * k, s.of_row.begin() + (t + 1) * k);
  }
  return s;
}

// A task of a product: the output channels [r0, r1) (of the expert's R) of chosen expert u.
struct Task {
  int64_t u, r0, r1, cost;
};

// The integer-dot products of one stacked weight (R rows per expert, K inputs) for the rows of
// every chosen expert, each expert's inputs quantised in `panels[u]` (GEMM) or `acts[u]`.
struct Product {
  const Weight* w;
  int64_t R, K;
  float* out;  // (slots, R)
  std::vector<Task> tasks;
  std::vector<int64_t> bounds;  // thread i takes tasks [bounds[i], bounds[i + 1])
};

inline bool gemm_rows(int64_t m) { return gemm::kAvailable && m >= kMinGemmRows; }

// The product's tasks: blocks of the GEMM's strips, or of kRowsTask channels, each costed as
// its channels times its rows padded to the path's tile.
void plan_tasks(const Slots& s, Product& p) {
  const int64_t block = gemm::block_strips(p.K) * gemm::kStripRows;
  for (size_t u = 0; u + 1 < s.first.size(); ++u) {
    const int64_t m = s.first[u + 1] - s.first[u];
    const bool g = gemm_rows(m);
    const int64_t step = g ? block : std::max(kRowsTask, block);
    const int64_t rows = g ? (m + gemm::C - 1) / gemm::C * gemm::C : (m + 3) / 4 * 4;
    for (int64_t r0 = 0; r0 < p.R; r0 += step) {
      const int64_t r1 = std::min(p.R, r0 + step);
      p.tasks.push_back({static_cast<int64_t>(u), r0, r1, (r1 - r0) * rows});
    }
  }
}

// Splits p's tasks over `nth` threads in contiguous runs of about equal cost: a task goes to
// the thread whose share holds its cost's midpoint (p: a `Product` or a `Bf16Product`).
template <typename P>
void split_tasks(P& p, int nth) {
  int64_t total = 0;
  for (const Task& t : p.tasks) total += t.cost;
  p.bounds.assign(nth + 1, static_cast<int64_t>(p.tasks.size()));
  p.bounds[0] = 0;
  int64_t acc = 0;
  int next = 1;
  for (size_t i = 0; i < p.tasks.size() && next < nth; ++i) {
    while (next < nth && 2 * acc + p.tasks[i].cost > 2 * total * next / nth) {
      p.bounds[next++] = static_cast<int64_t>(i);
    }
    acc += p.tasks[i].cost;
  }
}

// Each expert's inputs, quantised for its product: `panels` (GEMM rows) or `acts`.
struct Inputs {
  std::vector<gemm::XPanels> panels;
  std::vector<int_dot::QActs> acts;
};

// Quantises chosen expert u's m rows x (m, K) (contiguous) for a weight offset by `shift`.
void quantise(Inputs& in, size_t u, const float* x, int64_t m, int64_t K, int shift) {
  if (gemm_rows(m)) {
    gemm::XPanels& xp = in.panels[u];
    xp.resize(m, K / int_dot::kBlock);
    xp.fill(x, K, shift, 0, xp.groups);
  } else {
    int_dot::quantize(x, K, m, K, in.acts[u]);
  }
}

// Chosen expert u's m rows from the rows already quantised (`xq`; rows `rows_of[0..m)`).
void gather(Inputs& in, size_t u, const int_dot::QActs& xq, const int64_t* rows_of, int64_t m,
            int64_t K, int shift) {
  if (gemm_rows(m)) {
    gemm::XPanels& xp = in.panels[u];
    xp.resize(m, K / int_dot::kBlock);
    xp.fill_from(xq, rows_of, shift, 0, xp.groups);
  } else {
    int_dot::QActs& q = in.acts[u];
    q.resize(m, K);
    for (int64_t b = 0; b < m; ++b) q.copy_row(b, xq, rows_of[b]);
  }
}

// Expert e's rows onward of a stacked int8 / 4-bit weight in the strip layout (R rows per
// expert, whole strips): the weight from its row e R to the end, so that the next task's strips
// (`gemm::Next`) may lie in a later expert.
struct From {
  const Weight& w;
  int64_t row0, n;

  int_dot::I8Rows i8() const {
    return {static_cast<const int8_t*>(w.data) + row0 * w.k, w.scales + row0, w.k, n};
  }
  int_dot::Q4Rows q4() const {
    return {static_cast<const uint8_t*>(w.data) + row0 * w.k / 2,
            w.q4_scales + row0 * (w.k / int_dot::kBlock), w.k, n};
  }
  int_dot::Q4KRows q4k() const {
    return {static_cast<const uint8_t*>(w.data) + row0 * w.k / 2,
            w.q4k_scales + row0 * int_dot::super_blocks(w.k) * int_dot::kSuperBytes, w.k, n};
  }
};

// This thread's tasks of product p.
void run_tasks(const Slots& s, const Inputs& in, const Product& p, int tid) {
  static thread_local std::vector<gemm::Strip> scratch;  // a worker's own
  const Weight& w = *p.w;
  const int64_t rows = w.tensor.size(0);
  const int64_t t0 = p.bounds[tid], t1 = p.bounds[tid + 1];
  for (int64_t t = t0; t < t1; ++t) {
    const Task& task = p.tasks[t];
    const int64_t s0 = s.first[task.u], m = s.first[task.u + 1] - s0;
    const int64_t row0 = s.expert[task.u] * p.R;
    const From from{w, row0, rows - row0};
    float* out = p.out + s0 * p.R;
    if (!gemm_rows(m)) {
      const int_dot::QActs& q = in.acts[task.u];
      float* o = out + task.r0;
      if (w.q4k_scales) {
        int_dot::rows_q4k(from.q4k(), q, task.r0, task.r1, o, p.R);
      } else if (w.dtype == at::kByte) {
        int_dot::rows_q4(from.q4(), q, task.r0, task.r1, o, p.R);
      } else {
        int_dot::rows_i8(from.i8(), q, task.r0, task.r1, o, p.R);
      }
      continue;
    }
    for (auto& st : scratch) st.index = -1;  // strips of another expert's weight
    gemm::Next next;  // the thread's next task's strips, where it is a GEMM task
    if (t + 1 < t1) {
      const Task& after = p.tasks[t + 1];
      if (gemm_rows(s.first[after.u + 1] - s.first[after.u])) {
        const int64_t ahead = (s.expert[after.u] * p.R - row0) / gemm::kStripRows;
        next.s0 = ahead + after.r0 / gemm::kStripRows;
        next.s1 = ahead + (after.r1 + gemm::kStripRows - 1) / gemm::kStripRows;
      }
    }
    const int64_t g0 = task.r0 / gemm::kStripRows;
    const int64_t g1 = (task.r1 + gemm::kStripRows - 1) / gemm::kStripRows;
    const gemm::XPanels& xp = in.panels[task.u];
    if (w.q4k_scales) {
      gemm::block_q4k(from.q4k(), from.n, xp, g0, g1, 0, xp.groups, out, p.R, scratch, next);
    } else if (w.dtype == at::kByte) {
      gemm::block_q4(from.q4(), from.n, xp, g0, g1, 0, xp.groups, out, p.R, scratch, next);
    } else {
      gemm::block_i8(from.i8(), from.n, xp, g0, g1, 0, xp.groups, out, p.R, scratch, next);
    }
  }
}

// What the weights' codes add per product (`gemm::XPanels`' corrections).
inline int shift_of(const Weight& w) {
  if (w.q4k_scales) return 0;
  return w.dtype == at::kByte ? gemm::kQ4Shift : gemm::i8_shift();
}

struct Dims {
  int64_t T, k, H, I, act;
  ffn::Clip clip;
};

// out[t] = sum of row t's slots' weight * d[slot], in ascending expert id.
inline void sum_rows(const Dims& d, const Slots& s, const float* dd, float* out, int64_t t0,
                     int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + t * d.H;
    std::fill(o, o + d.H, 0.0f);
    for (int64_t j = 0; j < d.k; ++j) {
      const int64_t slot = s.of_row[t * d.k + j];
      const float w = s.weight[slot];
      const float* ds = dd + slot * d.H;
#pragma omp simd
      for (int64_t h = 0; h < d.H; ++h) o[h] += ds[h] * w;
    }
  }
}

// The integer-dot stage in one parallel region (see the file comment).
void run_int_dot(const Dims& d, const Slots& s, const Weight& gate_up, const Weight& down,
                 const float* x, float* gu, float* z, float* dd, float* out) {
  const int nth = at::get_num_threads();
  const size_t U = s.expert.size();
  Inputs in{std::vector<gemm::XPanels>(U), std::vector<int_dot::QActs>(U)};
  Product up{&gate_up, 2 * d.I, d.H, gu, {}, {}};
  Product dn{&down, d.H, d.I, dd, {}, {}};
  plan_tasks(s, up);
  plan_tasks(s, dn);
  const int shift_up = shift_of(gate_up), shift_dn = shift_of(down);
  int_dot::QActs xq;
  xq.resize(d.T, d.H);
#pragma omp parallel num_threads(nth)
  {
    const int tid = fused::thread_id();
#pragma omp single
    {
      split_tasks(up, fused::num_threads());  // the team's size (1 in a nested region)
      split_tasks(dn, fused::num_threads());
    }
    // The rows quantised once, then each expert's gathered.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.T; ++t) xq.quantize(t, x + t * d.H, d.H);
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < U; ++u) {
      const int64_t s0 = s.first[u];
      gather(in, u, xq, s.row.data() + s0, s.first[u + 1] - s0, d.H, shift_up);
    }
    run_tasks(s, in, up, tid);
#pragma omp barrier
    // The activation, then the down product's inputs quantised, expert by expert.
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < U; ++u) {
      const int64_t s0 = s.first[u], m = s.first[u + 1] - s0;
      for (int64_t i = s0; i < s0 + m; ++i) {
        const float* g = gu + i * 2 * d.I;
        ffn::gated_row(g, g + d.I, z + i * d.I, 0, d.I, d.act, 1.0f, d.clip);
      }
      quantise(in, u, z + s0 * d.I, m, d.I, shift_dn);
    }
    run_tasks(s, in, dn, tid);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.T; ++t) sum_rows(d, s, dd, out, t, t + 1);
  }
}

// Rows [r0, r0 + rows) of weight w as a Weight of its own (the same dtype and scales).
Weight rows_of(const Weight& w, int64_t r0, int64_t rows) {
  Weight v = w;
  v.tensor = w.tensor.narrow(0, r0, rows);
  if (w.scale.defined()) v.scale = w.scale.narrow(0, r0, rows);
  return v;
}

// The weight-only (and float) stage: each chosen expert's products as GEMMs.
void run_gemms(const Dims& d, const Slots& s, const Weight& gate_up, const Weight& down,
               const at::Tensor& x, at::Tensor& xg, at::Tensor& gu, at::Tensor& z,
               at::Tensor& dd) {
  const float* xp = x.data_ptr<float>();
  float* xgp = xg.data_ptr<float>();
  for (size_t u = 0; u + 1 < s.first.size(); ++u) {
    const int64_t s0 = s.first[u], m = s.first[u + 1] - s0, e = s.expert[u];
    for (int64_t i = s0; i < s0 + m; ++i) {
      std::copy(xp + s.row[i] * d.H, xp + (s.row[i] + 1) * d.H, xgp + i * d.H);
    }
    at::Tensor gu_e = gu.narrow(0, s0, m), z_e = z.narrow(0, s0, m), d_e = dd.narrow(0, s0, m);
    fused::project(xg.narrow(0, s0, m), rows_of(gate_up, e * 2 * d.I, 2 * d.I), gu_e);
    const float* g = gu_e.data_ptr<float>();
    float* zp = z_e.data_ptr<float>();
    at::parallel_for(0, m, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        ffn::gated_row(g + b * 2 * d.I, g + b * 2 * d.I + d.I, zp + b * d.I, 0, d.I, d.act,
                       1.0f, d.clip);
      }
    });
    fused::project(z_e, rows_of(down, e * d.H, d.H), d_e);
  }
}

// Rows of an expert up to which bfloat16 experts take `bf16_gemm` (above, `mm`'s packed GEMM,
// whose weight reorder the rows then amortise).
constexpr int64_t kBf16MaxRows = 64;
constexpr int64_t kBf16TaskRows = bf16_gemm::kTaskRows;

// The bfloat16 products of one stacked weight (R rows per expert, K inputs) for the chosen
// experts of at most kBf16MaxRows rows: expert u's rows are `x[s.first[u] ..)` (bfloat16 rows
// of K), its results `out` (slots, R), rounded to bfloat16.
struct Bf16Product {
  const uint16_t* w;
  int64_t R, K;
  const uint16_t* const* x;
  float* out;
  std::vector<Task> tasks;
  std::vector<int64_t> bounds;
};

void plan_bf16(const Slots& s, Bf16Product& p) {
  for (size_t u = 0; u + 1 < s.first.size(); ++u) {
    const int64_t m = s.first[u + 1] - s.first[u];
    if (m > kBf16MaxRows) continue;
    const int64_t rows = (m + bf16_gemm::kMR - 1) / bf16_gemm::kMR * bf16_gemm::kMR;
    for (int64_t r0 = 0; r0 < p.R; r0 += kBf16TaskRows) {
      const int64_t r1 = std::min(p.R, r0 + kBf16TaskRows);
      p.tasks.push_back({static_cast<int64_t>(u), r0, r1, (r1 - r0) * rows});
    }
  }
}

// This thread's tasks of product p, each prefetching the next one's weight rows.
void run_bf16_tasks(const Slots& s, const Bf16Product& p, int tid) {
  const int64_t t0 = p.bounds[tid], t1 = p.bounds[tid + 1];
  auto rows_of = [&](const Task& t) { return p.w + (s.expert[t.u] * p.R + t.r0) * p.K; };
  for (int64_t t = t0; t < t1; ++t) {
    const Task& task = p.tasks[t];
    const int64_t s0 = s.first[task.u], m = s.first[task.u + 1] - s0;
    bf16_gemm::block(p.x + s0, m, rows_of(task), task.r1 - task.r0, p.K,
                     p.out + s0 * p.R + task.r0, p.R,
                     t + 1 < t1 ? rows_of(p.tasks[t + 1]) : nullptr);
  }
}

// The bfloat16 stage on a CPU with AVX512-BF16: the rows rounded to bfloat16 once; experts of
// up to kBf16MaxRows rows through `bf16_gemm` in one parallel region per product (tasks split
// by cost as the integer-dot stage's), the others through `mm` (`fused::project`); the same
// roundings as `run_gemms` (bfloat16 products of bfloat16 inputs).
void run_bf16(const Dims& d, const Slots& s, const Weight& gate_up, const Weight& down,
              const at::Tensor& x, at::Tensor& gu, at::Tensor& z, at::Tensor& dd) {
  const int64_t slots = d.T * d.k;
  const at::Tensor xb = x.to(at::kBFloat16);  // (T, H)
  at::Tensor zb = at::empty({slots, d.I}, xb.options());
  const auto* xbp = static_cast<const uint16_t*>(xb.data_ptr());
  const auto* zbp = static_cast<const uint16_t*>(zb.data_ptr());
  std::vector<const uint16_t*> xrows(slots), zrows(slots);
  for (int64_t i = 0; i < slots; ++i) {
    xrows[i] = xbp + s.row[i] * d.H;
    zrows[i] = zbp + i * d.I;
  }
  Bf16Product up{static_cast<const uint16_t*>(gate_up.data), 2 * d.I, d.H, xrows.data(),
                 gu.data_ptr<float>(), {}, {}};
  Bf16Product dn{static_cast<const uint16_t*>(down.data), d.H, d.I, zrows.data(),
                 dd.data_ptr<float>(), {}, {}};
  plan_bf16(s, up);
  plan_bf16(s, dn);
  const int nth = at::get_num_threads();
  auto run = [&](Bf16Product& p) {
    if (p.tasks.empty()) return;
#pragma omp parallel num_threads(nth)
    {
#pragma omp single
      split_tasks(p, fused::num_threads());
      run_bf16_tasks(s, p, fused::thread_id());
    }
  };
  // The experts of many rows, one packed GEMM each.
  auto big = [&](const at::Tensor& in, bool gather, const Weight& w, int64_t R, at::Tensor& o) {
    for (size_t u = 0; u + 1 < s.first.size(); ++u) {
      const int64_t s0 = s.first[u], m = s.first[u + 1] - s0;
      if (m <= kBf16MaxRows) continue;
      const at::Tensor rows =
          gather ? in.index_select(0, at::from_blob(const_cast<int64_t*>(s.row.data() + s0),
                                                    {m}, at::kLong))
                 : in.narrow(0, s0, m);
      at::Tensor o_e = o.narrow(0, s0, m);
      fused::project(rows, rows_of(w, s.expert[u] * R, R), o_e);
    }
  };
  run(up);
  big(xb, true, gate_up, 2 * d.I, gu);
  const float* g = gu.data_ptr<float>();
  float* zp = z.data_ptr<float>();
  at::parallel_for(0, slots, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      ffn::gated_row(g + b * 2 * d.I, g + b * 2 * d.I + d.I, zp + b * d.I, 0, d.I, d.act, 1.0f,
                     d.clip);
    }
  });
  zb.copy_(z);
  run(dn);
  big(zb, false, down, d.H, dd);
}

at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& weights_in,
                       const at::Tensor& ids_in, const c10::List<std::optional<at::Tensor>>& params,
                       int64_t act, bool int_dot, double clip, bool clip_before_act) {
  TORCH_CHECK(params.size() == kNumParams, "moe_experts: params must hold ", kNumParams,
              " entries");
  TORCH_CHECK(x_in.dim() == 2, "moe_experts: x must be (T, H)");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0) && ids_in.size(1) >= 1,
              "moe_experts: ids must be (T, k)");
  TORCH_CHECK(weights_in.sizes() == ids_in.sizes(), "moe_experts: weights must be (T, k)");
  TORCH_CHECK(act >= ffn::kSilu && act <= ffn::kRelu2, "moe_experts: act must be 0..4");
  TORCH_CHECK(clip >= 0.0, "moe_experts: the SwiGLU clip must be >= 0 (0: none)");
  Dims d{x_in.size(0), ids_in.size(1), x_in.size(1), 0, act,
         ffn::Clip{static_cast<float>(clip), clip_before_act}};
  const std::optional<at::Tensor> gu_t = params.get(kGateUpW), dn_t = params.get(kDownW);
  TORCH_CHECK(dn_t.has_value() && dn_t->dim() == 2 && dn_t->size(0) % d.H == 0 &&
                  dn_t->size(0) > 0,
              "moe_experts: down_w is required, (E * H, I)");
  const int64_t E = dn_t->size(0) / d.H;
  TORCH_CHECK(gu_t.has_value() && gu_t->dim() == 2 && gu_t->size(0) % (2 * E) == 0,
              "moe_experts: gate_up_w is required, (E * 2I, H)");
  d.I = gu_t->size(0) / (2 * E);
  const Weight gate_up =
      fused::weight_of(params, kGateUpW, kGateUpScale, E * 2 * d.I, d.H, "gate_up_w", int_dot);
  const Weight down = fused::weight_of(params, kDownW, kDownScale, E * d.H, d.I, "down_w", int_dot);
  TORCH_CHECK(gate_up.int_dot == down.int_dot, "moe_experts: both weights must take integer "
              "dot products, or neither");
  if (gate_up.int_dot) {
    TORCH_CHECK(d.H % int_dot::kBlock == 0 && d.I % int_dot::kBlock == 0 &&
                    (2 * d.I) % int_dot::kLanes == 0 && d.H % int_dot::kLanes == 0,
                "moe_experts: integer-dot experts need H and I multiples of 32 and whole strips "
                "of ", int_dot::kLanes, " rows");
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();
  const auto f32 = x.options();
  at::Tensor out = at::empty({d.T, d.H}, f32);
  if (d.T == 0) return out;
  const Slots s = sort_slots(ids.data_ptr<int64_t>(), weights.data_ptr<float>(), d.T, d.k, E);
  const int64_t slots = d.T * d.k;
  at::Tensor gu = at::empty({slots, 2 * d.I}, f32);
  at::Tensor z = at::empty({slots, d.I}, f32);
  at::Tensor dd = at::empty({slots, d.H}, f32);
  if (gate_up.int_dot) {
    run_int_dot(d, s, gate_up, down, x.data_ptr<float>(), gu.data_ptr<float>(),
                z.data_ptr<float>(), dd.data_ptr<float>(), out.data_ptr<float>());
    return out;
  }
  if (gate_up.dtype == at::kBFloat16 && down.dtype == at::kBFloat16 &&
      bf16_gemm::available()) {
    run_bf16(d, s, gate_up, down, x, gu, z, dd);
  } else {
    at::Tensor xg = at::empty({slots, d.H}, f32);
    run_gemms(d, s, gate_up, down, x, xg, gu, z, dd);
  }
  const float* ddp = dd.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, d.T, 1, [&](int64_t t0, int64_t t1) { sum_rows(d, s, ddp, o, t0, t1); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor?[] params, int act, "
      "bool int_dot=False, float clip=0.0, bool clip_before_act=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("moe_experts", &moe_experts); }

}  // namespace vllm_mamba
