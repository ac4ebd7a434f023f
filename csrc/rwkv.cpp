// The RWKV wkv ops on the CPU: RWKV-7's generalised delta rule (the op family `rwkv7`) and
// RWKV-4's max-stabilised weighted average (`rwkv4`), each over a packed varlen batch and as a
// one-token update. `vllm_mamba/ops/rwkv7.py` and `vllm_mamba/ops/rwkv4.py` have the references
// and the semantics; these kernels follow them exactly (same math in float32, same rounding of
// the outputs and states, same handling of padding rows, empty sequences and tokens past
// `query_start_loc[-1]`). Inputs may be float32 or bfloat16, each tensor its own dtype (read
// per token row into float32 buffers); a slot index of -1 marks a padding row whose slot is
// neither read nor written (its outputs are those of a zero / fresh state).
//
// RWKV-7: per token and head, each value row i of the (Dv, Dk) state evolves on its own:
//   sa = s_i . a;  s_i = s_i * exp(w) + sa * b + v_i * k;  o_i = s_i . r
// A task is (sequence, head, block of value rows): its rows live in a float32 buffer (L1) for
// the whole sequence; per token the five Dk vectors (exp(w) once, a, b, k, r) are read once
// into zero-padded float32 rows, then each state row is updated with `vec.h` vectors along Dk
// (the vector count a template argument up to 16, so the coefficients stay in registers where
// they fit). Rows of a head are split into blocks only when there are fewer (sequence, head)
// pairs than threads: rows are independent, so the split is exact. Tasks are handed out
// longest first from a shared counter (sequences of very different lengths balance).
// The update op is the same task with one token per row, from the slot's state.
//
// RWKV-4: per channel (vectorised along C by `#pragma omp simd` over `math.h`'s exp_f32), a
// task is (sequence, block of kChannels4 channels) with its (num, den, max) in float32 arrays.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernel_math.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

using vec::Vf;
constexpr int64_t L = vec::kLanes;
constexpr int64_t kMaxTemplateNV = 16;  // vectors per state row handled by the unrolled code
constexpr int64_t kMinRows = 8;         // value rows per RWKV-7 task at least, when splitting
constexpr int64_t kChannels4 = 64;      // channels per RWKV-4 task
constexpr float kMaxInit = -1e38f;      // RWKV-4's running maximum of a fresh state

// ---- float32 / bfloat16 rows, the dtype chosen at run time ----------------------------------

inline Vf vload(const float* p, int64_t n) {
  return n == L ? vec::load(p) : vec::load_n(p, static_cast<int>(n));
}
inline Vf vload(const at::BFloat16* p, int64_t n) {
  const auto* q = reinterpret_cast<const vec::bf16_t*>(p);
  return n == L ? vec::load(q) : vec::load_n(q, static_cast<int>(n));
}
inline void vstore(float* p, Vf v, int64_t n) {
  if (n == L) {
    vec::store(p, v);
  } else {
    vec::store_n(p, v, static_cast<int>(n));
  }
}
inline void vstore(at::BFloat16* p, Vf v, int64_t n) {
  if (n == L) {
    vec::store(reinterpret_cast<vec::bf16_t*>(p), v);
    return;
  }
  float buf[L];
  vec::store(buf, v);
  for (int64_t j = 0; j < n; ++j) {
    p[j] = at::BFloat16(vec::f32_to_bf16(buf[j]), at::BFloat16::from_bits());
  }
}

// y[0:n] = x[0:n] converted (bfloat16 rounded to nearest even).
template <typename X, typename Y>
void convert(const X* x, Y* y, int64_t n) {
  for (int64_t j = 0; j < n; j += L) {
    const int64_t m = std::min(L, n - j);
    vstore(y + j, vload(x + j, m), m);
  }
}

// A float32 or bfloat16 tensor's data, rows `stride` elements apart.
struct Data {
  void* ptr = nullptr;
  bool bf16 = false;
  int64_t stride = 0;

  // dst[0:n] = row t, elements [off, off + n), as float32.
  void load(int64_t t, int64_t off, float* dst, int64_t n) const {
    const int64_t pos = t * stride + off;
    if (bf16) {
      convert(static_cast<const at::BFloat16*>(ptr) + pos, dst, n);
    } else {
      std::memcpy(dst, static_cast<const float*>(ptr) + pos, n * sizeof(float));
    }
  }
  // Row t, elements [off, off + n) = src[0:n], rounded to the tensor's dtype.
  void store(int64_t t, int64_t off, const float* src, int64_t n) const {
    const int64_t pos = t * stride + off;
    if (bf16) {
      convert(src, static_cast<at::BFloat16*>(ptr) + pos, n);
    } else {
      std::memcpy(static_cast<float*>(ptr) + pos, src, n * sizeof(float));
    }
  }
};

bool is_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16;
}

// A (T, ...) activation whose dims after the first are contiguous (token stride free), else a
// contiguous copy.
at::Tensor rows_contiguous(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return t.contiguous();
    expected *= t.size(d);
  }
  return t;
}

Data data_of(const at::Tensor& t, const char* what) {
  const bool bf16 = is_bf16(t, what);
  return Data{t.data_ptr(), bf16, t.dim() > 0 ? t.stride(0) : 0};
}

// The varlen metadata as int64 / bool: sequence b owns tokens [qsl[b], qsl[b + 1]).
struct Seqs {
  at::Tensor qsl_t, slots_t, init_t;
  const int64_t* qsl;
  const int64_t* slots;
  const bool* has_init;  // nullptr: every sequence with a slot starts from it (the update ops)
  int64_t batch;
};

Seqs varlen_seqs(const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                 const at::Tensor& has_initial_state, int64_t tokens) {
  const int64_t batch = state_indices.numel();
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  Seqs s;
  s.qsl_t = as_index(query_start_loc).reshape({batch + 1});
  s.slots_t = as_index(state_indices).reshape({batch});
  s.init_t = has_initial_state.to(at::kBool).contiguous().reshape({batch});
  s.qsl = s.qsl_t.data_ptr<int64_t>();
  s.slots = s.slots_t.data_ptr<int64_t>();
  s.has_init = s.init_t.data_ptr<bool>();
  s.batch = batch;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(s.qsl[b] >= 0 && s.qsl[b] <= s.qsl[b + 1] && s.qsl[b + 1] <= tokens,
                "query_start_loc must be non-decreasing within [0, T]");
  }
  return s;
}

// One token per row: row b is sequence [b, b + 1), from its slot's state.
Seqs update_seqs(const at::Tensor& state_indices, int64_t rows) {
  const int64_t batch = state_indices.numel();
  TORCH_CHECK(batch == rows, "state_indices must have one entry per row, got ", batch, " for ",
              rows, " rows");
  Seqs s;
  s.qsl_t = at::arange(batch + 1, at::TensorOptions().dtype(at::kLong));
  s.slots_t = as_index(state_indices).reshape({batch});
  s.qsl = s.qsl_t.data_ptr<int64_t>();
  s.slots = s.slots_t.data_ptr<int64_t>();
  s.has_init = nullptr;
  s.batch = batch;
  return s;
}

// Runs fn(i, scratch) for every task i in [0, n), taking them in order from a shared counter
// (the caller orders them longest first), on torch's intra-op threads; each worker makes its
// scratch with make_scratch() once.
template <typename MakeScratch, typename Fn>
void run_tasks(int64_t n, MakeScratch&& make_scratch, Fn&& fn) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, scratch);
  });
}

// Sequence indices longest first, without padding rows that have no tokens (nothing to compute
// or write).
std::vector<int64_t> task_order(const Seqs& s) {
  std::vector<int64_t> order;
  for (int64_t b = 0; b < s.batch; ++b) {
    if (s.slots[b] >= 0 || s.qsl[b + 1] > s.qsl[b]) order.push_back(b);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return s.qsl[x + 1] - s.qsl[x] > s.qsl[y + 1] - s.qsl[y];
  });
  return order;
}

// Output of shape `sizes` in `like`'s dtype; zeros where no sequence covers a token (as the
// references), else uninitialised.
at::Tensor make_out(at::IntArrayRef sizes, const at::Tensor& like, const Seqs& s) {
  int64_t covered = 0;
  for (int64_t b = 0; b < s.batch; ++b) covered += s.qsl[b + 1] - s.qsl[b];
  const bool full = covered == sizes[0] && (s.batch == 0 || s.qsl[0] == 0);
  return full ? at::empty(sizes, like.options()) : at::zeros(sizes, like.options());
}

// ---- RWKV-7 ----------------------------------------------------------------------------------

struct Wkv7 {
  int64_t heads, dk, dv;
  int64_t nv;   // vectors per state row
  int64_t dkp;  // nv * L: padded row length of the float32 buffers
  Data r, w, k, v, a, b;
  Data states;  // (S, H, Dv, Dk), contiguous
  Data out;     // (T, H, Dv) in r's dtype
};

// Per-task float32 buffers.
struct Scratch7 {
  std::vector<float> coef;   // (5, dkp): exp(w), a, b, k, r of the token, zero past Dk
  std::vector<float> state;  // (rows, dkp): the task's state rows, zero past Dk
  std::vector<float> v, o;   // (rows,)
  Scratch7(int64_t dkp, int64_t rows)
      : coef(5 * dkp, 0.0f), state(rows * dkp, 0.0f), v(rows), o(rows) {}
};

// Rows [0, rows) of `s` (row stride NV * L) advanced by one token; o[i] = s_i . r.
template <int64_t NV>
void step_rows(const float* coef, float* s, int64_t rows, const float* v, float* o) {
  constexpr int64_t P = NV * L;
  Vf ew[NV], a[NV], b[NV], k[NV], r[NV];
  for (int64_t j = 0; j < NV; ++j) {
    ew[j] = vec::load(coef + j * L);
    a[j] = vec::load(coef + P + j * L);
    b[j] = vec::load(coef + 2 * P + j * L);
    k[j] = vec::load(coef + 3 * P + j * L);
    r[j] = vec::load(coef + 4 * P + j * L);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* si = s + i * P;
    Vf x[NV];
    Vf acc = vec::zero();
    for (int64_t j = 0; j < NV; ++j) {
      x[j] = vec::load(si + j * L);
      acc = vec::fma(x[j], a[j], acc);
    }
    const Vf sa = vec::set1(vec::sum(acc));
    const Vf vi = vec::set1(v[i]);
    Vf out = vec::zero();
    for (int64_t j = 0; j < NV; ++j) {
      x[j] = vec::fma(x[j], ew[j], vec::fma(sa, b[j], vec::mul(vi, k[j])));
      vec::store(si + j * L, x[j]);
      out = vec::fma(x[j], r[j], out);
    }
    o[i] = vec::sum(out);
  }
}

// The same for any vector count (rows longer than the unrolled code handles).
void step_rows_any(const float* coef, int64_t nv, float* s, int64_t rows, const float* v,
                   float* o) {
  const int64_t P = nv * L;
  const float *ew = coef, *a = coef + P, *b = coef + 2 * P, *k = coef + 3 * P, *r = coef + 4 * P;
  for (int64_t i = 0; i < rows; ++i) {
    float* si = s + i * P;
    Vf acc = vec::zero();
    for (int64_t j = 0; j < P; j += L) acc = vec::fma(vec::load(si + j), vec::load(a + j), acc);
    const Vf sa = vec::set1(vec::sum(acc));
    const Vf vi = vec::set1(v[i]);
    Vf out = vec::zero();
    for (int64_t j = 0; j < P; j += L) {
      const Vf upd = vec::fma(sa, vec::load(b + j), vec::mul(vi, vec::load(k + j)));
      const Vf x = vec::fma(vec::load(si + j), vec::load(ew + j), upd);
      vec::store(si + j, x);
      out = vec::fma(x, vec::load(r + j), out);
    }
    o[i] = vec::sum(out);
  }
}

using StepFn = void (*)(const float*, float*, int64_t, const float*, float*);

// The unrolled step for nv vectors per row, or nullptr (then step_rows_any).
template <int64_t... NV>
StepFn pick_step(int64_t nv, std::integer_sequence<int64_t, NV...>) {
  StepFn fn = nullptr;
  ((nv == NV + 1 ? (fn = &step_rows<NV + 1>, 0) : 0), ...);
  return fn;
}

struct Task7 {
  int64_t seq, head, row0, rows;
};

// Sequence t.seq, head t.head, value rows [row0, row0 + rows): its tokens from the slot's state
// (or zeros), the final rows written back to the slot.
void wkv7_task(const Wkv7& p, const Seqs& s, const Task7& task, StepFn step, Scratch7& w) {
  const int64_t dk = p.dk, dkp = p.dkp, rows = task.rows;
  const int64_t slot = s.slots[task.seq];
  const bool from_slot = slot >= 0 && (s.has_init == nullptr || s.has_init[task.seq]);
  // Element offset of row row0 of (slot, head) in the states.
  const int64_t st0 = slot >= 0 ? ((slot * p.heads + task.head) * p.dv + task.row0) * dk : 0;
  float* state = w.state.data();
  for (int64_t i = 0; i < rows; ++i) {
    float* si = state + i * dkp;
    if (from_slot) {
      p.states.load(0, st0 + i * dk, si, dk);
    } else {
      std::fill(si, si + dk, 0.0f);
    }
  }
  float* coef = w.coef.data();
  float* ew = coef;
  const int64_t hk = task.head * dk, hv = task.head * p.dv + task.row0;
  for (int64_t t = s.qsl[task.seq]; t < s.qsl[task.seq + 1]; ++t) {
    p.w.load(t, hk, ew, dk);
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) ew[d] = exp_f32(ew[d]);
    p.a.load(t, hk, coef + dkp, dk);
    p.b.load(t, hk, coef + 2 * dkp, dk);
    p.k.load(t, hk, coef + 3 * dkp, dk);
    p.r.load(t, hk, coef + 4 * dkp, dk);
    p.v.load(t, hv, w.v.data(), rows);
    if (step != nullptr) {
      step(coef, state, rows, w.v.data(), w.o.data());
    } else {
      step_rows_any(coef, p.nv, state, rows, w.v.data(), w.o.data());
    }
    p.out.store(t, hv, w.o.data(), rows);
  }
  if (slot < 0) return;
  for (int64_t i = 0; i < rows; ++i) p.states.store(0, st0 + i * dk, state + i * dkp, dk);
}

void wkv7_run(const Wkv7& p, const Seqs& s) {
  // Tasks longest first; rows split into blocks only when (sequence, head) pairs are fewer
  // than the threads.
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = s.batch * p.heads;
  int64_t blocks = 1;
  if (pairs > 0 && pairs < threads) {
    const int64_t max_blocks = std::max<int64_t>(1, p.dv / kMinRows);
    blocks = std::min(max_blocks, (threads + pairs - 1) / pairs);
  }
  const int64_t block_rows = (p.dv + blocks - 1) / blocks;
  std::vector<Task7> tasks;
  for (int64_t b : task_order(s)) {
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t r0 = 0; r0 < p.dv; r0 += block_rows) {
        tasks.push_back({b, h, r0, std::min(block_rows, p.dv - r0)});
      }
    }
  }
  const StepFn step = pick_step(p.nv, std::make_integer_sequence<int64_t, kMaxTemplateNV>{});
  run_tasks(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch7(p.dkp, block_rows); },
      [&](int64_t i, Scratch7& w) { wkv7_task(p, s, tasks[i], step, w); });
}

// Checks the RWKV-7 arguments; returns the problem (the activations made row-contiguous are
// kept alive in `keep`).
Wkv7 wkv7_problem(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& states, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(r.dim() == 3, "r must be (T, H, Dk)");
  for (const at::Tensor* t : {&w, &k, &a, &b}) {
    TORCH_CHECK(t->sizes() == r.sizes(), "r, w, k, a and b must all be (T, H, Dk)");
  }
  TORCH_CHECK(v.dim() == 3 && v.size(0) == r.size(0) && v.size(1) == r.size(1),
              "v must be (T, H, Dv)");
  const int64_t heads = r.size(1), dk = r.size(2), dv = v.size(2);
  TORCH_CHECK(dk > 0 && dv > 0, "head sizes must be positive");
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == dv &&
                  states.size(3) == dk,
              "states must be (S, H, Dv, Dk) = (S, ", heads, ", ", dv, ", ", dk, "), got ",
              states.sizes());
  TORCH_CHECK(states.is_contiguous(), "rwkv7: states must be contiguous (updated in place)");
  for (const at::Tensor* t : {&r, &w, &k, &v, &a, &b}) keep.push_back(rows_contiguous(*t));
  Wkv7 p;
  p.heads = heads;
  p.dk = dk;
  p.dv = dv;
  p.nv = (dk + L - 1) / L;
  p.dkp = p.nv * L;
  p.r = data_of(keep[0], "r");
  p.w = data_of(keep[1], "w");
  p.k = data_of(keep[2], "k");
  p.v = data_of(keep[3], "v");
  p.a = data_of(keep[4], "a");
  p.b = data_of(keep[5], "b");
  p.states = data_of(states, "states");
  return p;
}

at::Tensor rwkv7_varlen(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
                        at::Tensor states, const at::Tensor& query_start_loc,
                        const at::Tensor& state_indices, const at::Tensor& has_initial_state) {
  std::vector<at::Tensor> keep;
  Wkv7 p = wkv7_problem(r, w, k, v, a, b, states, keep);
  const Seqs s = varlen_seqs(query_start_loc, state_indices, has_initial_state, r.size(0));
  at::Tensor out = make_out({v.size(0), p.heads, p.dv}, r, s);  // (T, H, Dv) in r's dtype
  p.out = data_of(out, "r");
  wkv7_run(p, s);
  return out;
}

at::Tensor rwkv7_update(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
                        at::Tensor states, const at::Tensor& state_indices) {
  std::vector<at::Tensor> keep;
  Wkv7 p = wkv7_problem(r, w, k, v, a, b, states, keep);
  const Seqs s = update_seqs(state_indices, r.size(0));
  at::Tensor out = at::empty({v.size(0), p.heads, p.dv}, r.options());  // (B, H, Dv)
  p.out = data_of(out, "r");
  wkv7_run(p, s);
  return out;
}

// ---- RWKV-4 ----------------------------------------------------------------------------------

struct Wkv4 {
  int64_t channels;
  const float* w;  // (C,) -exp(time_decay)
  const float* u;  // (C,) time_first
  Data k, v, out;  // (T, C)
  float *num, *den, *mx;  // (S, C) each
};

// Sequence b, channels [c0, c0 + n), n <= kChannels4.
void wkv4_task(const Wkv4& p, const Seqs& s, int64_t b, int64_t c0, int64_t n) {
  alignas(64) float num[kChannels4], den[kChannels4], mx[kChannels4];
  alignas(64) float kb[kChannels4], vb[kChannels4], ob[kChannels4];
  const int64_t slot = s.slots[b];
  const bool from_slot = slot >= 0 && (s.has_init == nullptr || s.has_init[b]);
  const int64_t st = slot * p.channels + c0;
  for (int64_t c = 0; c < n; ++c) {
    num[c] = from_slot ? p.num[st + c] : 0.0f;
    den[c] = from_slot ? p.den[st + c] : 0.0f;
    mx[c] = from_slot ? p.mx[st + c] : kMaxInit;
  }
  const float* w = p.w + c0;
  const float* u = p.u + c0;
  for (int64_t t = s.qsl[b]; t < s.qsl[b + 1]; ++t) {
    p.k.load(t, c0, kb, n);
    p.v.load(t, c0, vb, n);
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      const float kc = kb[c], vc = vb[c], m = mx[c];
      const float uk = u[c] + kc;
      const float q = select_f32(m > uk, m, uk);  // max(max, u + k)
      float e1 = exp_f32(m - q), e2 = exp_f32(uk - q);
      ob[c] = (e1 * num[c] + e2 * vc) / (e1 * den[c] + e2);
      const float mw = m + w[c];
      const float pm = select_f32(mw > kc, mw, kc);  // max(max + w, k)
      e1 = exp_f32(mw - pm);
      e2 = exp_f32(kc - pm);
      num[c] = e1 * num[c] + e2 * vc;
      den[c] = e1 * den[c] + e2;
      mx[c] = pm;
    }
    p.out.store(t, c0, ob, n);
  }
  if (slot < 0) return;
  std::memcpy(p.num + st, num, n * sizeof(float));
  std::memcpy(p.den + st, den, n * sizeof(float));
  std::memcpy(p.mx + st, mx, n * sizeof(float));
}

void wkv4_run(const Wkv4& p, const Seqs& s) {
  const std::vector<int64_t> seqs = task_order(s);
  const int64_t chunks = (p.channels + kChannels4 - 1) / kChannels4;
  run_tasks(
      static_cast<int64_t>(seqs.size()) * chunks, [] { return 0; },
      [&](int64_t i, int) {
        const int64_t c0 = (i % chunks) * kChannels4;
        wkv4_task(p, s, seqs[i / chunks], c0, std::min(kChannels4, p.channels - c0));
      });
}

// Checks the RWKV-4 arguments; returns the problem (converted tensors kept alive in `keep`).
Wkv4 wkv4_problem(const at::Tensor& w, const at::Tensor& u, const at::Tensor& k,
                  const at::Tensor& v, at::Tensor& num, at::Tensor& den, at::Tensor& mx,
                  std::vector<at::Tensor>& keep) {
  TORCH_CHECK(k.dim() == 2 && v.sizes() == k.sizes(), "k and v must be (T, C)");
  const int64_t channels = k.size(1);
  TORCH_CHECK(w.numel() == channels && u.numel() == channels, "w and u must be (C,)");
  for (const at::Tensor* t : {&num, &den, &mx}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == channels && t->size(0) == num.size(0),
                "num_states, den_states and max_states must be (S, C)");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "rwkv4: the states must be float32, got ",
                t->scalar_type());
    TORCH_CHECK(t->is_contiguous(), "rwkv4: the states must be contiguous (updated in place)");
  }
  keep.push_back(w.to(at::kFloat).reshape({channels}).contiguous());
  keep.push_back(u.to(at::kFloat).reshape({channels}).contiguous());
  keep.push_back(rows_contiguous(k));
  keep.push_back(rows_contiguous(v));
  Wkv4 p;
  p.channels = channels;
  p.w = keep[0].data_ptr<float>();
  p.u = keep[1].data_ptr<float>();
  p.k = data_of(keep[2], "k");
  p.v = data_of(keep[3], "v");
  p.num = num.data_ptr<float>();
  p.den = den.data_ptr<float>();
  p.mx = mx.data_ptr<float>();
  return p;
}

at::Tensor rwkv4_varlen(const at::Tensor& w, const at::Tensor& u, const at::Tensor& k,
                        const at::Tensor& v, at::Tensor num_states, at::Tensor den_states,
                        at::Tensor max_states, const at::Tensor& query_start_loc,
                        const at::Tensor& state_indices, const at::Tensor& has_initial_state) {
  std::vector<at::Tensor> keep;
  Wkv4 p = wkv4_problem(w, u, k, v, num_states, den_states, max_states, keep);
  const Seqs s = varlen_seqs(query_start_loc, state_indices, has_initial_state, k.size(0));
  at::Tensor out = make_out(v.sizes(), v, s);  // (T, C) in v's dtype
  p.out = data_of(out, "v");
  wkv4_run(p, s);
  return out;
}

at::Tensor rwkv4_update(const at::Tensor& w, const at::Tensor& u, const at::Tensor& k,
                        const at::Tensor& v, at::Tensor num_states, at::Tensor den_states,
                        at::Tensor max_states, const at::Tensor& state_indices) {
  std::vector<at::Tensor> keep;
  Wkv4 p = wkv4_problem(w, u, k, v, num_states, den_states, max_states, keep);
  const Seqs s = update_seqs(state_indices, k.size(0));
  at::Tensor out = at::empty(v.sizes(), v.options());  // (B, C)
  p.out = data_of(out, "v");
  wkv4_run(p, s);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("rwkv7_varlen", &rwkv7_varlen);
  m.impl("rwkv7_update", &rwkv7_update);
  m.impl("rwkv4_varlen", &rwkv4_varlen);
  m.impl("rwkv4_update", &rwkv4_update);
}

}  // namespace vllm_mamba
