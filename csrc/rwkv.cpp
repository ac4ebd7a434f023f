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
// the whole sequence. Sequences of at least kMinTransposedTokens tokens keep the block
// transposed (Dk x rows; transposed when loaded from and stored to the (S, H, Dv, Dk) state), so
// that each token is axpys along the value rows with the Dk coefficients broadcast, and no
// horizontal sums: `s[j][:] = s[j][:] * exp(w[j]) + sa[:] * b[j] + v[:] * k[j]`,
// `o[:] += s[j][:] * r[j]`, and the next token's removal `sa[:] += s[j][:] * a'[j]` in the
// same pass (the state read and written once per token). Shorter sequences (and the update op)
// go row by row: per token the five Dk vectors (exp(w) once, a, b, k, r) are read once into
// zero-padded float32 rows, then each state row is updated with `vec.h` vectors along Dk (the
// vector count a template argument up to 16, so the coefficients stay in registers where they
// fit), with two horizontal sums per row. The two paths sum the dot products in different
// orders (results agree to float32 rounding); within a path a sequence cut anywhere and
// continued from its saved float32 state gives the same bits as one call. Rows of a head are
// split into blocks of whole vectors when there are fewer (sequence, head) pairs than threads,
// and into blocks of at most kMaxColVecs vectors: rows are independent, so the split is exact.
// Tasks are handed out longest first from a shared counter (sequences of very different lengths
// balance).
// The update op is the same task with one token per row, from the slot's state.
//
// RWKV-4: per channel (vectorised along C by `#pragma omp simd` over `math.h`'s exp_f32), a
// task is (sequence, block of kChannels4 channels) with its (num, den, max) in float32 arrays.
//
// RWKV-7's decode glue (`rwkv7_shift_mix`, `rwkv7_fused_update`): see their section below.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
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
  std::vector<float> coef;   // (6, dkp): exp(w), a, b, k, r of the token, a of the next, zero
                             // past Dk
  std::vector<float> state;  // (rows, dkp) row-major, or (Dk, rows_p) transposed
  std::vector<float> v, o, sa;  // (rows_p,): the token's values, outputs, the removal S a
  Scratch7(int64_t dk, int64_t dkp, int64_t rows)
      : coef(6 * dkp, 0.0f),
        state(std::max(rows * dkp, dk * round_up(rows))),
        v(round_up(rows), 0.0f),
        o(round_up(rows), 0.0f),
        sa(round_up(rows), 0.0f) {}
  static int64_t round_up(int64_t n) { return (n + L - 1) / L * L; }
};

// Rows [0, rows) of `s` (row stride NV * L) advanced by one token; o[i] = s_i . r.
//
// Each row's removal and readout end in a horizontal sum, whose latency one row at a time
// leaves the vector units idle: groups of G rows interleave their independent chains (each row's
// sums in the same order as alone, so the results do not depend on the grouping).
template <int64_t NV>
void step_rows(const float* coef, float* s, int64_t rows, const float* v, float* o) {
  constexpr int64_t P = NV * L;
  constexpr int64_t G = NV <= 4 ? 4 : 2;  // rows in flight: their vectors fit the registers
  Vf ew[NV], a[NV], b[NV], k[NV], r[NV];
  for (int64_t j = 0; j < NV; ++j) {
    ew[j] = vec::load(coef + j * L);
    a[j] = vec::load(coef + P + j * L);
    b[j] = vec::load(coef + 2 * P + j * L);
    k[j] = vec::load(coef + 3 * P + j * L);
    r[j] = vec::load(coef + 4 * P + j * L);
  }
  auto group = [&](auto rows_in_flight, int64_t i0) {
    constexpr int64_t N = decltype(rows_in_flight)::value;
    Vf x[N][NV];
    float sa[N];
    for (int64_t g = 0; g < N; ++g) {
      const float* si = s + (i0 + g) * P;
      Vf acc = vec::zero();
      for (int64_t j = 0; j < NV; ++j) {
        x[g][j] = vec::load(si + j * L);
        acc = vec::fma(x[g][j], a[j], acc);
      }
      sa[g] = vec::sum(acc);
    }
    for (int64_t g = 0; g < N; ++g) {
      float* si = s + (i0 + g) * P;
      const Vf sav = vec::set1(sa[g]);
      const Vf vi = vec::set1(v[i0 + g]);
      Vf out = vec::zero();
      for (int64_t j = 0; j < NV; ++j) {
        x[g][j] = vec::fma(x[g][j], ew[j], vec::fma(sav, b[j], vec::mul(vi, k[j])));
        vec::store(si + j * L, x[g][j]);
        out = vec::fma(x[g][j], r[j], out);
      }
      o[i0 + g] = vec::sum(out);
    }
  };
  int64_t i = 0;
  for (; i + G <= rows; i += G) group(std::integral_constant<int64_t, G>{}, i);
  for (; i < rows; ++i) group(std::integral_constant<int64_t, 1>{}, i);
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

// ---- the transposed state of a long sequence: axpys along the value rows ----
//
// `st (Dk, NR * L)`: column j of the task's rows (st[j][i] = s_i[j]), zero past the rows. Per
// token every operation is an axpy along the rows, with the coefficient of column j broadcast:
//   s_i[j] = s_i[j] * exp(w[j]) + sa_i * b[j] + v_i * k[j];  o_i += s_i[j] * r[j]
// and the next token's removal sa_i = sum_j s_i[j] * a'[j] accumulated in the same pass (so
// the state is read and written once per token). No horizontal sums.

// sa[0:NR*L] = sum_j st[j] * a[j], the first token's removal, summed over j in the order that
// cols_step sums the next token's (so a sequence cut anywhere continues bit for bit).
template <int64_t NR>
void cols_removal(const float* a, int64_t dk, const float* st, float* sa) {
  constexpr int64_t P = NR * L;
  Vf acc[NR];
  for (int64_t n = 0; n < NR; ++n) acc[n] = vec::zero();
  for (int64_t j = 0; j < dk; ++j) {
    const Vf aj = vec::set1(a[j]);
    for (int64_t n = 0; n < NR; ++n) acc[n] = vec::fma(vec::load(st + j * P + n * L), aj, acc[n]);
  }
  for (int64_t n = 0; n < NR; ++n) vec::store(sa + n * L, acc[n]);
}

// One token on the transposed state: reads sa (this token's removal), writes o and, when
// `a_next` is given, sa = the next token's removal.
template <int64_t NR, bool kNext>
void cols_step(const float* coef, int64_t dkp, int64_t dk, float* st, const float* v, float* sa_io,
               float* o) {
  constexpr int64_t P = NR * L;
  const float *ew = coef, *b = coef + 2 * dkp, *k = coef + 3 * dkp, *r = coef + 4 * dkp;
  const float* an = coef + 5 * dkp;
  Vf sa[NR], vv[NR], out[NR], nsa[NR];
  for (int64_t n = 0; n < NR; ++n) {
    sa[n] = vec::load(sa_io + n * L);
    vv[n] = vec::load(v + n * L);
    out[n] = vec::zero();
    nsa[n] = vec::zero();
  }
  for (int64_t j = 0; j < dk; ++j) {
    const Vf ewj = vec::set1(ew[j]), bj = vec::set1(b[j]), kj = vec::set1(k[j]);
    const Vf rj = vec::set1(r[j]);
    float* sj = st + j * P;
    for (int64_t n = 0; n < NR; ++n) {
      const Vf upd = vec::fma(sa[n], bj, vec::mul(vv[n], kj));
      const Vf x = vec::fma(vec::load(sj + n * L), ewj, upd);
      vec::store(sj + n * L, x);
      out[n] = vec::fma(x, rj, out[n]);
      if constexpr (kNext) nsa[n] = vec::fma(x, vec::set1(an[j]), nsa[n]);
    }
  }
  for (int64_t n = 0; n < NR; ++n) {
    vec::store(o + n * L, out[n]);
    if constexpr (kNext) vec::store(sa_io + n * L, nsa[n]);
  }
}

// Vectors per task along the value rows in the transposed layout: the row block's sa, v, o and
// next sa stay in registers (4 x NR of 32 on AVX-512, of 16 below).
constexpr int64_t kMaxColVecs = L >= 16 ? 4 : 2;
// Sequences of at least this many tokens run on the transposed state (the transposes at the
// start and the end cost about a few tokens' steps); shorter ones row by row.
constexpr int64_t kMinTransposedTokens = 8;

struct ColFns {
  void (*removal)(const float*, int64_t, const float*, float*);
  void (*step)(const float*, int64_t, int64_t, float*, const float*, float*, float*);
  void (*last)(const float*, int64_t, int64_t, float*, const float*, float*, float*);
};

template <int64_t NR>
ColFns col_fns() {
  return {&cols_removal<NR>, &cols_step<NR, true>, &cols_step<NR, false>};
}

ColFns pick_cols(int64_t nr) {
  switch (nr) {
    case 1: return col_fns<1>();
    case 2: return col_fns<2>();
    case 3: return col_fns<std::min<int64_t>(3, kMaxColVecs)>();
    default: return col_fns<kMaxColVecs>();
  }
}

struct Task7 {
  int64_t seq, head, row0, rows;
};

// Sequence t.seq, head t.head, value rows [row0, row0 + rows) on the transposed state.
void wkv7_task_cols(const Wkv7& p, const Seqs& s, const Task7& task, Scratch7& w) {
  const int64_t dk = p.dk, dkp = p.dkp, rows = task.rows;
  const int64_t nr = (rows + L - 1) / L, P = nr * L;
  const ColFns fns = pick_cols(nr);
  const int64_t slot = s.slots[task.seq];
  const bool from_slot = slot >= 0 && (s.has_init == nullptr || s.has_init[task.seq]);
  const int64_t st0 = slot >= 0 ? ((slot * p.heads + task.head) * p.dv + task.row0) * dk : 0;
  float* st = w.state.data();
  std::fill(st, st + dk * P, 0.0f);
  if (from_slot) {
    if (p.states.bf16) {
      const auto* src = static_cast<const vec::bf16_t*>(p.states.ptr) + st0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < dk; ++j) st[j * P + i] = vec::bf16_to_f32(src[i * dk + j].bits);
      }
    } else {
      const float* src = static_cast<const float*>(p.states.ptr) + st0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < dk; ++j) st[j * P + i] = src[i * dk + j];
      }
    }
  }
  float* coef = w.coef.data();
  float *v = w.v.data(), *o = w.o.data(), *sa = w.sa.data();
  const int64_t hk = task.head * dk, hv = task.head * p.dv + task.row0;
  const int64_t start = s.qsl[task.seq], end = s.qsl[task.seq + 1];
  p.a.load(start, hk, coef + 5 * dkp, dk);
  fns.removal(coef + 5 * dkp, dk, st, sa);
  for (int64_t t = start; t < end; ++t) {
    float* ew = coef;
    p.w.load(t, hk, ew, dk);
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) ew[d] = exp_f32(ew[d]);
    p.b.load(t, hk, coef + 2 * dkp, dk);
    p.k.load(t, hk, coef + 3 * dkp, dk);
    p.r.load(t, hk, coef + 4 * dkp, dk);
    p.v.load(t, hv, v, rows);
    if (t + 1 < end) {
      p.a.load(t + 1, hk, coef + 5 * dkp, dk);
      fns.step(coef, dkp, dk, st, v, sa, o);
    } else {
      fns.last(coef, dkp, dk, st, v, sa, o);
    }
    p.out.store(t, hv, o, rows);
  }
  if (slot < 0) return;
  if (p.states.bf16) {
    auto* dst = static_cast<at::BFloat16*>(p.states.ptr) + st0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < dk; ++j) {
        dst[i * dk + j] =
            at::BFloat16(vec::f32_to_bf16(st[j * P + i]), at::BFloat16::from_bits());
      }
    }
  } else {
    float* dst = static_cast<float*>(p.states.ptr) + st0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < dk; ++j) dst[i * dk + j] = st[j * P + i];
    }
  }
}

// Sequence t.seq, head t.head, value rows [row0, row0 + rows): its tokens from the slot's state
// (or zeros), the final rows written back to the slot. Row by row (horizontal sums along Dk)
// for short sequences, on the transposed state for long ones.
void wkv7_task(const Wkv7& p, const Seqs& s, const Task7& task, StepFn step, Scratch7& w) {
  if (s.qsl[task.seq + 1] - s.qsl[task.seq] >= kMinTransposedTokens) {
    wkv7_task_cols(p, s, task, w);
    return;
  }
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
    std::fill(si + dk, si + dkp, 0.0f);
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
  // Tasks longest first; rows split into blocks of whole vectors when (sequence, head) pairs
  // are fewer than the threads, and into blocks of at most kMaxColVecs vectors (the transposed
  // step's register budget).
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = s.batch * p.heads;
  int64_t blocks = 1;
  if (pairs > 0 && pairs < threads) {
    const int64_t max_blocks = std::max<int64_t>(1, p.dv / kMinRows);
    blocks = std::min(max_blocks, (threads + pairs - 1) / pairs);
  }
  int64_t block_rows = Scratch7::round_up((p.dv + blocks - 1) / blocks);
  block_rows = std::min(block_rows, kMaxColVecs * L);
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
      static_cast<int64_t>(tasks.size()), [&] { return Scratch7(p.dk, p.dkp, block_rows); },
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

// ---- RWKV-7 decode glue: token shift + mixes, and the time mix between its projections ----
//
// `rwkv7_shift_mix` (see `shift_mix_ref`): per decode row, the slot's saved input x' (zeros for
// a padding row) is read and x saved in its place, then out[m] = x + (x' - x) * mixes[m] for the
// M mixes; tasks are (row, block of kShiftChannels channels).
//
// Speculative chains (`src_state_indices`, both ops): row b reads the state of slot src[b] and
// writes slot state_indices[b], the rows in order (a task takes every row of its channels, or of
// its head), so a chain's positions run in one call, each reading what the position before
// wrote, and each row's arithmetic is a one-row call's.
//
// `rwkv7_fused_update` (see `fused_update_ref`): one task per (row, head) does everything for its
// head: the decay exp(-exp(-0.5) sigmoid(w_raw)), sigmoid(a_raw), kk = l2norm(k * k_k), the k_a
// update of k, the v_first lerp, the wkv one-token update (the same row-by-row step as
// `rwkv7_update`), the head's group norm, the bonus sum(r * k * r_k) v and the gate g. Math in
// float32; the inputs are read in their own dtypes (float32 or bfloat16), the output rounded to
// g's dtype. Where the reference's tensor ops round an intermediate to a bfloat16 input's dtype
// (the rate, kk, the k_a update, b, the v_first lerp, the rule's output), so does the kernel,
// so that bfloat16 models decode as the reference does (to an ulp where orders of summation
// differ).

constexpr int64_t kShiftChannels = 256;     // channels per shift_mix task
constexpr int64_t kShiftParallelWork = 1 << 16;  // element-mixes per call below which one thread
constexpr double kDecayScale = 0.60653065971263342;  // exp(-0.5), rwkv7.DECAY_SCALE

// A (B,) slot index tensor read as int32 or int64 without a conversion (else converted).
struct SlotIndex {
  at::Tensor keep;
  const int32_t* i32 = nullptr;
  const int64_t* i64 = nullptr;
  int64_t operator[](int64_t b) const { return i32 != nullptr ? i32[b] : i64[b]; }
};

SlotIndex slot_index(const at::Tensor& t, int64_t rows) {
  TORCH_CHECK(t.numel() == rows, "state_indices must have one entry per row, got ", t.numel(),
              " for ", rows, " rows");
  SlotIndex s;
  s.keep = t.is_contiguous() ? t : t.contiguous();
  if (s.keep.scalar_type() == at::kInt) {
    s.i32 = s.keep.data_ptr<int32_t>();
  } else {
    if (s.keep.scalar_type() != at::kLong) s.keep = s.keep.to(at::kLong);
    s.i64 = s.keep.data_ptr<int64_t>();
  }
  return s;
}

// A parameter of `n` elements as a contiguous float32 / bfloat16 row.
Data param_of(const at::Tensor& t, int64_t n, const char* what, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(t.numel() == n, what, " must have ", n, " elements, got ", t.numel());
  keep.push_back(t.is_contiguous() ? t : t.contiguous());
  return Data{keep.back().data_ptr(), is_bf16(t, what), 0};
}

// A (B, n) activation with a free row stride.
Data rows_of(const at::Tensor& t, int64_t rows, int64_t n, const char* what,
             std::vector<at::Tensor>& keep) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == n, what, " must be (", rows, ", ",
              n, "), got ", t.sizes());
  keep.push_back(rows_contiguous(t));
  return data_of(keep.back(), what);
}

// The source slots of a call's rows (`src_state_indices`): every live row's (slots[b] >= 0) a
// slot of the state; absent: none.
std::optional<SlotIndex> source_slots(const std::optional<at::Tensor>& src, const SlotIndex& slots,
                                      int64_t rows, int64_t num_slots) {
  if (!src.has_value()) return std::nullopt;
  SlotIndex s = slot_index(*src, rows);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(slots[b] < 0 || (s[b] >= 0 && s[b] < num_slots), "src_state_indices[", b,
                "] = ", s[b], " is not a slot of the state");
  }
  return s;
}

at::Tensor rwkv7_shift_mix(const at::Tensor& x, at::Tensor shift, const at::Tensor& state_indices,
                           const at::Tensor& mixes,
                           const std::optional<at::Tensor>& src_state_indices) {
  TORCH_CHECK(x.dim() == 2, "x must be (B, H)");
  const int64_t batch = x.size(0), chans = x.size(1);
  TORCH_CHECK(shift.dim() == 2 && shift.size(1) == chans, "shift must be (S, ", chans, ")");
  TORCH_CHECK(shift.is_contiguous(), "rwkv7_shift_mix: shift must be contiguous (in place)");
  TORCH_CHECK(chans > 0 && mixes.numel() % chans == 0 &&
                  (mixes.dim() == 1 || (mixes.dim() == 3 && mixes.size(1) == 1 &&
                                        mixes.size(2) == chans)),
              "mixes must be (M, 1, H) or (H,), got ", mixes.sizes());
  const int64_t m_count = mixes.numel() / chans;
  std::vector<at::Tensor> keep;
  const Data xd = rows_of(x, batch, chans, "x", keep);
  Data md = param_of(mixes, m_count * chans, "mixes", keep);
  md.stride = chans;  // row m: mix m
  const Data sd = data_of(shift, "shift");
  const SlotIndex slots = slot_index(state_indices, batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slots[b] < shift.size(0), "state index ", slots[b], " out of range");
  }
  const std::optional<SlotIndex> src =
      source_slots(src_state_indices, slots, batch, shift.size(0));
  at::Tensor out = mixes.dim() == 1 ? at::empty({batch, chans}, x.options())
                                    : at::empty({m_count, batch, chans}, x.options());
  Data od = data_of(out, "x");
  od.stride = chans;  // row m * B + b
  const int64_t chunks = (chans + kShiftChannels - 1) / kShiftChannels;
  const int64_t work = kShiftChannels * (m_count + 2);
  const int64_t grain = std::max<int64_t>(1, kShiftParallelWork / work);
  // One (row, block of channels) piece, with the thread's buffers.
  auto piece = [&](int64_t b, int64_t c0, float* xb, float* pb, float* mb, float* ob) {
    const int64_t n = std::min(kShiftChannels, chans - c0);
    const int64_t slot = slots[b];
    xd.load(b, c0, xb, n);
    if (slot >= 0) {
      sd.load(src ? (*src)[b] : slot, c0, pb, n);
      // x' in x's dtype, as the reference reads it.
      if (xd.bf16 && !sd.bf16) {
        convert(pb, reinterpret_cast<at::BFloat16*>(ob), n);
        convert(reinterpret_cast<const at::BFloat16*>(ob), pb, n);
      }
      sd.store(slot, c0, xb, n);
    } else {
      std::fill(pb, pb + n, 0.0f);
    }
    for (int64_t j = 0; j < n; j += L) {  // pb = x' - x
      const int64_t w = std::min(L, n - j);
      vstore(pb + j, vec::fma(vload(xb + j, w), vec::set1(-1.0f), vload(pb + j, w)), w);
    }
    if (xd.bf16) {  // x' - x in x's dtype, as the reference computes it
      convert(pb, reinterpret_cast<at::BFloat16*>(ob), n);
      convert(reinterpret_cast<const at::BFloat16*>(ob), pb, n);
    }
    for (int64_t m = 0; m < m_count; ++m) {
      md.load(m, c0, mb, n);
      for (int64_t j = 0; j < n; j += L) {
        const int64_t w = std::min(L, n - j);
        vstore(ob + j, vec::fma(vload(pb + j, w), vload(mb + j, w), vload(xb + j, w)), w);
      }
      od.store(m * batch + b, c0, ob, n);
    }
  };
  // Tasks: (row, block) pairs; with chains a block of channels over every row in order.
  const int64_t tasks = src ? chunks : batch * chunks;
  at::parallel_for(0, tasks, src ? 1 : grain, [&](int64_t lo, int64_t hi) {
    alignas(64) float xb[kShiftChannels], pb[kShiftChannels], mb[kShiftChannels],
        ob[kShiftChannels];
    for (int64_t task = lo; task < hi; ++task) {
      if (src) {
        for (int64_t b = 0; b < batch; ++b) piece(b, task * kShiftChannels, xb, pb, mb, ob);
      } else {
        piece(task / chunks, (task % chunks) * kShiftChannels, xb, pb, mb, ob);
      }
    }
  });
  return out;
}

struct Glue7 {
  int64_t heads, dk, dv, nv, dkp;
  Data r, w, k, v, a, g, vf, vg;  // (B, C) / (B, CV) rows; vf, vg null in layer 0
  Data k_k, k_a, r_k, gn_w, gn_b;  // parameters
  float eps;
  Data states;  // (S, NH, Dv, Dk)
  Data out;     // (B, CV)
};

// Per-thread float32 buffers of the fused update.
struct GlueScratch {
  std::vector<float> coef;   // (5, dkp): exp(w), a, b, k (after the k_a update), r; zero past Dk
  std::vector<float> state;  // (Dv, dkp)
  std::vector<float> tk;     // (5, Dk): raw k, a rate, k_k / k_a / r_k temporaries
  std::vector<float> tv;     // (5, Dv): v, g, v_first, v_gate, o
  GlueScratch(int64_t dk, int64_t dkp, int64_t dv)
      : coef(5 * dkp, 0.0f), state(dv * dkp, 0.0f), tk(5 * dk), tv(5 * dv) {}
};

// x[:n] rounded to bfloat16 in place (to nearest even, NaN kept a NaN, as `f32_to_bf16`) when
// `round`; one branch-free pass the compiler vectorises.
inline void round_bf16_if(float* x, int64_t n, bool round) {
  if (!round) return;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], sizeof(u));
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    const uint32_t q = x[i] != x[i] ? 0x7FC00000u : r;
    std::memcpy(&x[i], &q, sizeof(q));
  }
}

// Row b, head h: the state read from slot `src` and written to `slot` (the same outside chains).
void glue_task(const Glue7& p, int64_t b, int64_t h, int64_t slot, int64_t src, StepFn step,
               GlueScratch& s) {
  const int64_t dk = p.dk, dv = p.dv, dkp = p.dkp;
  float *ew = s.coef.data(), *an = ew + dkp, *bn = ew + 2 * dkp, *kn = ew + 3 * dkp;
  float* rn = ew + 4 * dkp;
  float *kraw = s.tk.data(), *rate = kraw + dk, *t1 = kraw + 2 * dk, *t2 = kraw + 3 * dk;
  float* t3 = kraw + 4 * dk;
  float *v = s.tv.data(), *g = v + dv, *vf = v + 2 * dv, *vg = v + 3 * dv, *o = v + 4 * dv;
  const int64_t hk = h * dk, hv = h * dv;
  // Decay, removal rate and k, each an elementwise pass the compiler vectorises (`exp_f32`
  // is branch-free); the bfloat16 roundings are passes of their own.
  p.w.load(b, hk, ew, dk);
  p.a.load(b, hk, rate, dk);
  p.k.load(b, hk, kraw, dk);
  p.r.load(b, hk, rn, dk);
  p.k_k.load(0, hk, t1, dk);
  p.k_a.load(0, hk, t2, dk);
  const float decay = static_cast<float>(kDecayScale);
  // The reference's tensor ops round each result to the model dtype: rate (a's dtype), the
  // k * k_k product, kk, each op of the k_a update and b (k's dtype), the gate and the lerp
  // (v_gate's, v's dtype); float32 inputs round nothing.
  const bool ra = p.a.bf16, rk = p.k.bf16;
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) ew[j] = exp_f32(-decay / (1.0f + exp_f32(-ew[j])));
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) rate[j] = 1.0f / (1.0f + exp_f32(-rate[j]));
  round_bf16_if(rate, dk, ra);
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) t1[j] = kraw[j] * t1[j];  // k * k_k
  round_bf16_if(t1, dk, rk);
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < dk; ++j) sq += t1[j] * t1[j];
  // k = k * (1 + (rate - 1) * k_a), each op rounded as the reference's
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) t3[j] = rate[j] - 1.0f;
  round_bf16_if(t3, dk, rk);
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) t3[j] *= t2[j];
  round_bf16_if(t3, dk, rk);
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) t3[j] += 1.0f;
  round_bf16_if(t3, dk, rk);
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) kn[j] = kraw[j] * t3[j];
  round_bf16_if(kn, dk, rk);
  const float norm = std::sqrt(sq);
  const float inv = 1.0f / (norm > 1e-12f ? norm : 1e-12f);
  p.r_k.load(0, hk, t2, dk);
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) t1[j] *= inv;  // kk
  round_bf16_if(t1, dk, rk);
#pragma omp simd
  for (int64_t j = 0; j < dk; ++j) {
    an[j] = -t1[j];
    bn[j] = t1[j] * rate[j];
  }
  round_bf16_if(bn, dk, rk);
  float bonus = 0.0f;
#pragma omp simd reduction(+ : bonus)
  for (int64_t j = 0; j < dk; ++j) bonus += rn[j] * kn[j] * t2[j];
  // Values: the lerp towards layer 0's.
  p.v.load(b, hv, v, dv);
  p.g.load(b, hv, g, dv);
  if (p.vf.ptr != nullptr) {
    p.vf.load(b, hv, vf, dv);
    p.vg.load(b, hv, vg, dv);
#pragma omp simd
    for (int64_t i = 0; i < dv; ++i) vg[i] = 1.0f / (1.0f + exp_f32(-vg[i]));
    round_bf16_if(vg, dv, p.vg.bf16);
#pragma omp simd
    for (int64_t i = 0; i < dv; ++i) v[i] = v[i] + vg[i] * (vf[i] - v[i]);
    round_bf16_if(v, dv, p.v.bf16);
  }
  // The rule's step from the slot's state (zeros for a padding row).
  // A float32 state whose rows are whole vectors is stepped in place; others through the
  // zero-padded float32 buffer.
  const int64_t st0 = slot >= 0 ? (slot * p.heads + h) * dv * dk : 0;
  const int64_t src0 = slot >= 0 ? (src * p.heads + h) * dv * dk : 0;
  const bool in_place = slot >= 0 && src == slot && !p.states.bf16 && dk == dkp;
  float* st = in_place ? static_cast<float*>(p.states.ptr) + st0 : s.state.data();
  if (!in_place) {
    for (int64_t i = 0; i < dv; ++i) {
      float* si = st + i * dkp;
      if (slot >= 0) {
        p.states.load(0, src0 + i * dk, si, dk);
      } else {
        std::fill(si, si + dk, 0.0f);
      }
    }
  }
  if (step != nullptr) {
    step(s.coef.data(), st, dv, v, o);
  } else {
    step_rows_any(s.coef.data(), p.nv, st, dv, v, o);
  }
  if (slot >= 0 && !in_place) {
    for (int64_t i = 0; i < dv; ++i) p.states.store(0, st0 + i * dk, st + i * dkp, dk);
  }
  if (p.r.bf16) {  // the rule's output in r's dtype, as the reference returns it
    round_bf16_if(o, dv, true);
  }
  // Group norm of the head, bonus, gate.
  Vf acc = vec::zero();
  for (int64_t i = 0; i < dv; i += L) acc = vec::add(acc, vload(o + i, std::min(L, dv - i)));
  const float mean = vec::sum(acc) / static_cast<float>(dv);
  acc = vec::zero();
  const Vf vmean = vec::set1(mean);
  for (int64_t i = 0; i < dv; i += L) {
    const int64_t n = std::min(L, dv - i);
    const Vf d = vec::fma(vec::set1(-1.0f), vmean, vload(o + i, n));
    vstore(o + i, d, n);
    const Vf dm = vload(o + i, n);  // zero past n
    acc = vec::fma(dm, dm, acc);
  }
  const float var = vec::sum(acc) / static_cast<float>(dv);
  const float rstd = 1.0f / std::sqrt(var + p.eps);
  p.gn_w.load(0, hv, vf, dv);  // vf, vg reused for the weight and the bias
  p.gn_b.load(0, hv, vg, dv);
  const Vf vr = vec::set1(rstd), vb = vec::set1(bonus);
  for (int64_t i = 0; i < dv; i += L) {
    const int64_t n = std::min(L, dv - i);
    const Vf normed = vec::fma(vec::mul(vload(o + i, n), vr), vload(vf + i, n), vload(vg + i, n));
    const Vf y = vec::mul(vec::fma(vb, vload(v + i, n), normed), vload(g + i, n));
    vstore(o + i, y, n);
  }
  p.out.store(b, hv, o, dv);
}

at::Tensor rwkv7_fused_update(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& a, const at::Tensor& g,
                              const std::optional<at::Tensor>& v_first,
                              const std::optional<at::Tensor>& v_gate, const at::Tensor& k_k,
                              const at::Tensor& k_a, const at::Tensor& r_k,
                              const at::Tensor& gn_weight, const at::Tensor& gn_bias,
                              double gn_eps, at::Tensor states, const at::Tensor& state_indices,
                              const std::optional<at::Tensor>& src_state_indices) {
  TORCH_CHECK(r_k.dim() == 2, "r_k must be (NH, Dk)");
  TORCH_CHECK(r.dim() == 2 && v.dim() == 2, "r and v must be (B, C) and (B, CV)");
  const int64_t heads = r_k.size(0), dk = r_k.size(1), batch = r.size(0);
  TORCH_CHECK(heads > 0 && dk > 0 && r.size(1) == heads * dk, "r must be (B, NH * Dk) = (B, ",
              heads * dk, ")");
  TORCH_CHECK(v.size(1) % heads == 0, "v's width must be a multiple of the heads");
  const int64_t chans = heads * dk, vchans = v.size(1), dv = vchans / heads;
  TORCH_CHECK(dv > 0, "the value head size must be positive");
  TORCH_CHECK(v_first.has_value() == v_gate.has_value(), "v_first and v_gate go together");
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == dv &&
                  states.size(3) == dk,
              "states must be (S, NH, Dv, Dk) = (S, ", heads, ", ", dv, ", ", dk, "), got ",
              states.sizes());
  TORCH_CHECK(states.is_contiguous(), "rwkv7: states must be contiguous (updated in place)");
  std::vector<at::Tensor> keep;
  keep.reserve(16);
  Glue7 p;
  p.heads = heads;
  p.dk = dk;
  p.dv = dv;
  p.nv = (dk + L - 1) / L;
  p.dkp = p.nv * L;
  p.r = rows_of(r, batch, chans, "r", keep);
  p.w = rows_of(w, batch, chans, "w", keep);
  p.k = rows_of(k, batch, chans, "k", keep);
  p.a = rows_of(a, batch, chans, "a", keep);
  p.v = rows_of(v, batch, vchans, "v", keep);
  p.g = rows_of(g, batch, vchans, "g", keep);
  if (v_first.has_value()) {
    p.vf = rows_of(*v_first, batch, vchans, "v_first", keep);
    p.vg = rows_of(*v_gate, batch, vchans, "v_gate", keep);
  }
  p.k_k = param_of(k_k, chans, "k_k", keep);
  p.k_a = param_of(k_a, chans, "k_a", keep);
  p.r_k = param_of(r_k, chans, "r_k", keep);
  p.gn_w = param_of(gn_weight, vchans, "gn_weight", keep);
  p.gn_b = param_of(gn_bias, vchans, "gn_bias", keep);
  p.eps = static_cast<float>(gn_eps);
  p.states = data_of(states, "states");
  const SlotIndex slots = slot_index(state_indices, batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slots[b] < states.size(0), "state index ", slots[b], " out of range");
  }
  const std::optional<SlotIndex> src =
      source_slots(src_state_indices, slots, batch, states.size(0));
  at::Tensor out = at::empty({batch, vchans}, g.options());
  p.out = data_of(out, "g");
  const StepFn step = pick_step(p.nv, std::make_integer_sequence<int64_t, kMaxTemplateNV>{});
  // (row, head) tasks, split evenly over the threads (one row's heads over both threads at B=1);
  // with chains, head tasks over every row in order.
  at::parallel_for(0, src ? heads : batch * heads, 1, [&](int64_t lo, int64_t hi) {
    GlueScratch s(dk, p.dkp, dv);
    for (int64_t task = lo; task < hi; ++task) {
      if (src) {
        for (int64_t b = 0; b < batch; ++b) glue_task(p, b, task, slots[b], (*src)[b], step, s);
      } else {
        const int64_t b = task / heads;
        glue_task(p, b, task % heads, slots[b], slots[b], step, s);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("rwkv7_varlen", &rwkv7_varlen);
  m.impl("rwkv7_update", &rwkv7_update);
  m.impl("rwkv4_varlen", &rwkv4_varlen);
  m.impl("rwkv4_update", &rwkv4_update);
  m.impl("rwkv7_shift_mix", &rwkv7_shift_mix);
  m.impl("rwkv7_fused_update", &rwkv7_fused_update);
}

}  // namespace vllm_mamba
