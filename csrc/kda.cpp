// The Kimi Delta Attention (KDA) ops on the CPU: the chunked KDA rule over a packed varlen
// batch, its fused one-token update, and the sigmoid-gated RMSNorm of its output. Shapes and
// semantics follow `vllm_mamba/ops/kda.py` (its docstring has the math and glossary): per token
// and value head h (reading key head h / (Hv / Hk)), with q and k L2-normalised (eps 1e-6) and
// q scaled by Dk^-1/2,
//   g = -exp(A_log[h]) softplus(a[h] + dt_bias[h])  (a (Dk,) log decay per key channel;
//       Kimi's gate, lower_bound == 0), or
//   g = lower_bound sigmoid(exp(A_log[h]) (a[h] + dt_bias[h]))  (the safe gate of Ling-3.0 /
//       GLM-5-Next, lower_bound < 0; a positive lower_bound is refused),
//   beta = sigmoid(b[h]),
//   S = diag(exp(g)) S, S += k (beta (v - S^T k))^T, o = S^T q,
// each sequence starting from its slot's state `(S, Hv, Dk, Dv)` where it has an initial state
// (zeros otherwise) and leaving its final state there; slot -1 marks a padding row (its slot is
// neither read nor written, its outputs are zeros). Math in float32 whatever the dtypes.
//
// Prefill runs the chunked (WY) form: a task is (sequence, value head), its (Dk, Dv) state in a
// float32 buffer for the whole sequence. Per chunk of L <= Q tokens, with c_i the per-channel
// cumulative log decay from the chunk's start (c_i <= 0):
//   - the pairwise factors sum_d x_i[d] k_j[d] exp(c_i[d] - c_j[d]) for x = k (the system A)
//     and x = q (the causal readout), j <= i, with exp(c_i - c_j) the running product of the
//     decays exp(g) of tokens j+1..i: every factor <= 1, none an exp of a difference of large
//     sums (never exp(c_i) exp(-c_j), which overflows under strong decay, nor exp(c_i - c_j)
//     of float sums, which loses |c_j| 2^-24 to cancellation);
//   - [K exp(c); Q exp(c)] S0 (one product with the state), R = beta (V - K exp(c) S0);
//   - U = (I + A)^-1 R by forward substitution;
//   - o = Q exp(c) S0 + (causal factors) U;
//   - S_end = diag(exp(c_L)) S0 + (K exp(c_L - c))^T U.
// The products are register-blocked matmuls on `vec.h` (one code for every ISA level); the
// gates, exps and pairwise factors are `#pragma omp simd` loops (over `math.h`'s branch-free
// exp). The pairwise factors cost O(Q Dk) per token against O(Dk Dv) for the state products,
// and a chunk pass over the state O(Dk Dv / Q): the measured best is Q = 8 to 12, where the
// 2Q rows of [K; Q] fill whole 6-row tiles at 12 (`vllm_mamba/ops/kda.py`'s CHUNK_SIZE).
//
// Decode runs the recurrence fused, two passes over each state row by row: a read pass for
// (D S)^T k and (D S)^T q (D = diag(exp(g))), then a read-write pass S = D S + k delta^T, with
// delta = beta (v - (D S)^T k) and o = (D S)^T q + (k . q) delta.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernel_math.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

using vec::Vf;
constexpr int64_t kLanes = vec::kLanes;
constexpr int64_t kNV = 2;  // vectors per row of a matmul tile
constexpr int64_t kMR = 6;  // rows of a matmul tile (12 accumulators)
constexpr float kL2Eps = 1e-6f;
constexpr float kSoftplusThreshold = 20.0f;

// ---- loads and stores of float32 / bfloat16 as float32 -------------------------------------

// (`load_f32` / `store_as`: kernel_math.h)

inline Vf vload(const float* p) { return vec::load(p); }
inline Vf vload(const at::BFloat16* p) {
  return vec::load(reinterpret_cast<const vec::bf16_t*>(p));
}
inline Vf vload_n(const float* p, int64_t n) { return vec::load_n(p, static_cast<int>(n)); }
inline Vf vload_n(const at::BFloat16* p, int64_t n) {
  return vec::load_n(reinterpret_cast<const vec::bf16_t*>(p), static_cast<int>(n));
}
inline void vstore(float* p, Vf v) { vec::store(p, v); }
inline void vstore(at::BFloat16* p, Vf v) { vec::store(reinterpret_cast<vec::bf16_t*>(p), v); }
inline void vstore_n(float* p, Vf v, int64_t n) { vec::store_n(p, v, static_cast<int>(n)); }
inline void vstore_n(at::BFloat16* p, Vf v, int64_t n) {
  float buf[kLanes];
  vec::store(buf, v);
  for (int64_t i = 0; i < n; ++i) p[i] = store_as<at::BFloat16>(buf[i]);
}

// y[0:n] (type Y) = x[0:n] (type X) converted, vectorised.
template <typename X, typename Y>
void convert_row(const X* x, Y* y, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) vstore(y + j, vload(x + j));
  if (j < n) vstore_n(y + j, vload_n(x + j, n - j), n - j);
}

// ---- matmul ---------------------------------------------------------------------------------

// How a product initialises C before adding A @ B.
enum class Init {
  kZero,        // C = A @ B
  kAccumulate,  // C += A @ B
  kRowScale,    // C = diag(row_scale) C + A @ B
};

// Tile C[0:MR, 0:nw] (Init) A[0:MR, 0:K] @ B[0:K, 0:nw], nw <= kNV * kLanes; A[r, k] at
// A[r * ars + k * acs] (any layout: the tile reads it one scalar at a time), B and C row-major.
template <int64_t MR>
void tile(Init init, int64_t K, int64_t nw, const float* A, int64_t ars, int64_t acs,
          const float* B, int64_t ldb, float* C, int64_t ldc, const float* row_scale) {
  Vf c[MR][kNV];
  int64_t width[kNV];  // valid lanes of each vector of the tile's rows
  for (int64_t v = 0; v < kNV; ++v) width[v] = std::clamp<int64_t>(nw - v * kLanes, 0, kLanes);
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t v = 0; v < kNV; ++v) {
      if (init == Init::kZero || width[v] == 0) {
        c[r][v] = vec::zero();
        continue;
      }
      const float* cp = C + r * ldc + v * kLanes;
      const Vf old = width[v] == kLanes ? vec::load(cp) : vec::load_n(cp, width[v]);
      c[r][v] = init == Init::kRowScale ? vec::mul(vec::set1(row_scale[r]), old) : old;
    }
  }
  if (nw == kNV * kLanes) {
    for (int64_t k = 0; k < K; ++k) {
      const float* b = B + k * ldb;
      Vf bv[kNV];
      for (int64_t v = 0; v < kNV; ++v) bv[v] = vec::load(b + v * kLanes);
#pragma GCC unroll 8
      for (int64_t r = 0; r < MR; ++r) {
        const Vf a = vec::set1(A[r * ars + k * acs]);
        for (int64_t v = 0; v < kNV; ++v) c[r][v] = vec::fma(a, bv[v], c[r][v]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const float* b = B + k * ldb;
      Vf bv[kNV];
      for (int64_t v = 0; v < kNV; ++v) {
        bv[v] = width[v] == kLanes ? vec::load(b + v * kLanes)
                : width[v] > 0     ? vec::load_n(b + v * kLanes, width[v])
                                   : vec::zero();
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < MR; ++r) {
        const Vf a = vec::set1(A[r * ars + k * acs]);
        for (int64_t v = 0; v < kNV; ++v) c[r][v] = vec::fma(a, bv[v], c[r][v]);
      }
    }
  }
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t v = 0; v < kNV; ++v) {
      float* cp = C + r * ldc + v * kLanes;
      if (width[v] == kLanes) {
        vec::store(cp, c[r][v]);
      } else if (width[v] > 0) {
        vec::store_n(cp, c[r][v], width[v]);
      }
    }
  }
}

// C (M, N) (Init) A (M, K) @ B (K, N): A[r, k] at A[r * ars + k * acs], B and C row-major with
// leading dims ldb, ldc; row_scale (M,) for Init::kRowScale.
void gemm(Init init, int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs,
          const float* B, int64_t ldb, float* C, int64_t ldc, const float* row_scale = nullptr) {
  constexpr int64_t kNB = kNV * kLanes;
  for (int64_t j0 = 0; j0 < N; j0 += kNB) {
    const int64_t nw = std::min(kNB, N - j0);
    for (int64_t i0 = 0; i0 < M; i0 += kMR) {
      const int64_t mr = std::min(kMR, M - i0);
      const float* a = A + i0 * ars;
      float* c = C + i0 * ldc + j0;
      const float* rs = row_scale == nullptr ? nullptr : row_scale + i0;
      switch (mr) {
        case 6: tile<6>(init, K, nw, a, ars, acs, B + j0, ldb, c, ldc, rs); break;
        case 5: tile<5>(init, K, nw, a, ars, acs, B + j0, ldb, c, ldc, rs); break;
        case 4: tile<4>(init, K, nw, a, ars, acs, B + j0, ldb, c, ldc, rs); break;
        case 3: tile<3>(init, K, nw, a, ars, acs, B + j0, ldb, c, ldc, rs); break;
        case 2: tile<2>(init, K, nw, a, ars, acs, B + j0, ldb, c, ldc, rs); break;
        default: tile<1>(init, K, nw, a, ars, acs, B + j0, ldb, c, ldc, rs); break;
      }
    }
  }
}

// y[0:n] += alpha * x[0:n] (float32 rows).
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const Vf a = vec::set1(alpha);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    vec::store(y + j, vec::fma(a, vec::load(x + j), vec::load(y + j)));
  }
  if (j < n) {
    const int r = static_cast<int>(n - j);
    vec::store_n(y + j, vec::fma(a, vec::load_n(x + j, r), vec::load_n(y + j, r)), r);
  }
}

// ---- the problem ----------------------------------------------------------------------------

// The shared problem of the varlen and update ops (pointers into contiguous-row tensors).
struct KDAProblem {
  int64_t k_heads, v_heads, dk, dv;
  int64_t q_stride, k_stride, v_stride;  // token strides of q, k and v
  const float* a;        // (T, Hv * Dk) contiguous
  const float* b;        // (T, Hv) contiguous
  const float* A_log;    // (Hv,)
  const float* dt_bias;  // (Hv * Dk,)
  const int64_t* slots;  // (B,)
  float lower_bound;     // 0: the softplus gate; < 0: the safe gate
};

template <typename T, typename S>
struct KDATensors {
  const T* q;  // (T, Hk, Dk), token stride q_stride
  const T* k;  // (T, Hk, Dk), token stride k_stride
  const T* v;  // (T, Hv, Dv), token stride v_stride
  S* states;   // (S, Hv, Dk, Dv)
  T* out;      // (T, Hv, Dv), contiguous
};

// g (Dk,) of token t, value head h: -exp(A_log[h]) softplus(x) (lower_bound 0) or
// lower_bound sigmoid(exp(A_log[h]) x) (lower_bound < 0), x = a[t, h] + dt_bias[h]; returns
// beta = sigmoid(b[t, h]).
inline float gates(const KDAProblem& p, int64_t t, int64_t h, float* g) {
  const int64_t dk = p.dk;
  const float* a = p.a + (t * p.v_heads + h) * dk;
  const float* bias = p.dt_bias + h * dk;
  const float rate = std::exp(p.A_log[h]);
  if (p.lower_bound < 0.0f) {
    const float bound = p.lower_bound;
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) {
      // sigmoid as torch computes it in float32: 1 / (1 + exp(-z)).
      const float sig = 1.0f / (1.0f + exp_f32(-(rate * (a[d] + bias[d]))));
      g[d] = bound * sig;
    }
  } else {
    const float neg_rate = -rate;
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) {
      const float x = a[d] + bias[d];
      // softplus_f32 already returns x above 20 up to half an ulp; the select makes it exact.
      g[d] = neg_rate * select_f32(x > kSoftplusThreshold, x, softplus_f32(x));
    }
  }
  return 1.0f / (1.0f + std::exp(-p.b[t * p.v_heads + h]));
}

// dst (D,) = x * scale / sqrt(|x|^2 + eps) in float32.
template <typename T>
void l2norm_row(const T* x, int64_t dim, float scale, float* dst) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < dim; ++i) {
    const float xi = load_f32(x[i]);
    sq += xi * xi;
  }
  const float s = scale / std::sqrt(sq + kL2Eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) dst[i] = load_f32(x[i]) * s;
}

// ---- prefill: the chunked form --------------------------------------------------------------

// Per-task float32 buffers of the chunked form (chunk size Q).
struct ChunkScratch {
  std::vector<float> kn;     // (Q, Dk): normalised k rows
  std::vector<float> qn;     // (Q, Dk): normalised, scaled q rows
  std::vector<float> eg;     // (Q, Dk): the tokens' decays exp(g)
  std::vector<float> kqd;    // (2Q, Dk): k exp(c), then q exp(c)
  std::vector<float> kend;   // (Q, Dk): k exp(c_L - c)
  std::vector<float> ks;     // (2Q, Dv): K exp(c) S0, then Q exp(c) S0 (turned into outputs)
  std::vector<float> neg_a;  // (Q, Q): -A (strictly lower)
  std::vector<float> attn;   // (Q, Q): causal q-k factors, zeros above the diagonal
  std::vector<float> u;      // (Q, Dv): V, then R, then U
  std::vector<float> beta;   // (Q,)
  std::vector<float> r;      // (Dk,): running product exp(c_i - c_j)
  std::vector<float> state;  // (Dk, Dv)
  void resize(int64_t Q, int64_t dk, int64_t dv) {
    kn.resize(Q * dk);
    qn.resize(Q * dk);
    eg.resize(Q * dk);
    kqd.resize(2 * Q * dk);
    kend.resize(Q * dk);
    ks.resize(2 * Q * dv);
    neg_a.resize(Q * Q);
    attn.resize(Q * Q);
    u.resize(Q * dv);
    beta.resize(Q);
    r.resize(dk);
    state.resize(dk * dv);
  }
};

// Loads chunk tokens [t0, t0 + L) of value head h: normalised k and q, the decays, beta, v.
template <typename T, typename S>
void load_chunk(const KDAProblem& p, const KDATensors<T, S>& io, int64_t t0, int64_t L,
                int64_t h, ChunkScratch& w) {
  const int64_t dk = p.dk, dv = p.dv;
  const int64_t kh = h / (p.v_heads / p.k_heads);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = t0 + i;
    l2norm_row(io.k + t * p.k_stride + kh * dk, dk, 1.0f, w.kn.data() + i * dk);
    l2norm_row(io.q + t * p.q_stride + kh * dk, dk, q_scale, w.qn.data() + i * dk);
    float* egi = w.eg.data() + i * dk;
    w.beta[i] = gates(p, t, h, egi);
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) egi[d] = exp_f32(egi[d]);
    convert_row(io.v + t * p.v_stride + h * dv, w.u.data() + i * dv, dv);
  }
}

// One chunk of L tokens from t0: writes its outputs and advances w.state (S0 -> S_L).
template <typename T, typename S>
void run_chunk(const KDAProblem& p, const KDATensors<T, S>& io, int64_t t0, int64_t L, int64_t Q,
               int64_t h, ChunkScratch& w) {
  const int64_t dk = p.dk, dv = p.dv;
  load_chunk(p, io, t0, L, h, w);
  const float* kn = w.kn.data();
  const float* qn = w.qn.data();
  const float* eg = w.eg.data();
  float* kqd = w.kqd.data();
  float* kend = w.kend.data();
  float* ks = w.ks.data();
  float* u = w.u.data();
  float* neg_a = w.neg_a.data();
  float* attn = w.attn.data();
  float* r = w.r.data();
  // Row i of the pairwise factors, j from i down to 0, with r = exp(c_i - c_j) the product of
  // the decays of tokens j+1..i (no exp of a difference of large sums: no cancellation, and
  // strong decays underflow to 0). After j = 0, r = exp(c_i), the decay since the chunk start;
  // the last row's r are also the end-of-chunk factors exp(c_L - c_j).
  for (int64_t i = 0; i < L; ++i) {
    const float* ki = kn + i * dk;
    const float* qi = qn + i * dk;
    const float bi = w.beta[i];
    const bool last = i == L - 1;
    std::fill(r, r + dk, 1.0f);
    for (int64_t j = i; j >= 0; --j) {
      const float* kj = kn + j * dk;
      const float* egj = eg + j * dk;
      if (last) {
        float* ke = kend + j * dk;
#pragma omp simd
        for (int64_t d = 0; d < dk; ++d) ke[d] = kj[d] * r[d];
      }
      float kk = 0.0f, qk = 0.0f;
#pragma omp simd reduction(+ : kk, qk)
      for (int64_t d = 0; d < dk; ++d) {
        const float kjr = kj[d] * r[d];
        kk += ki[d] * kjr;
        qk += qi[d] * kjr;
        r[d] *= egj[d];
      }
      neg_a[i * Q + j] = j < i ? -bi * kk : 0.0f;
      attn[i * Q + j] = qk;
    }
    for (int64_t j = i + 1; j < L; ++j) {
      neg_a[i * Q + j] = 0.0f;
      attn[i * Q + j] = 0.0f;
    }
    // The rows that read the start state: k_i exp(c_i) and q_i exp(c_i).
    float* kd = kqd + i * dk;
    float* qd = kqd + (L + i) * dk;
#pragma omp simd
    for (int64_t d = 0; d < dk; ++d) {
      kd[d] = ki[d] * r[d];
      qd[d] = qi[d] * r[d];
    }
  }
  // [K exp(c); Q exp(c)] S0: (2L, Dk) @ (Dk, Dv).
  gemm(Init::kZero, 2 * L, dv, dk, kqd, dk, 1, w.state.data(), dv, ks, dv);
  // R = beta (V - K exp(c) S0), then U = (I + A)^-1 R row by row.
  for (int64_t i = 0; i < L; ++i) {
    float* ui = u + i * dv;
    axpy(-1.0f, ks + i * dv, ui, dv);
    const Vf bi = vec::set1(w.beta[i]);
    int64_t j = 0;
    for (; j + kLanes <= dv; j += kLanes) vec::store(ui + j, vec::mul(bi, vec::load(ui + j)));
    if (j < dv) {
      const int n = static_cast<int>(dv - j);
      vec::store_n(ui + j, vec::mul(bi, vec::load_n(ui + j, n)), n);
    }
    for (int64_t jj = 0; jj < i; ++jj) axpy(neg_a[i * Q + jj], u + jj * dv, ui, dv);
  }
  // o = Q exp(c) S0 + attn U.
  float* o = ks + L * dv;  // (L, Dv)
  gemm(Init::kAccumulate, L, dv, L, attn, Q, 1, u, dv, o, dv);
  for (int64_t i = 0; i < L; ++i) {
    convert_row(o + i * dv, io.out + ((t0 + i) * p.v_heads + h) * dv, dv);
  }
  // S_end = diag(exp(c_L)) S0 + (K exp(c_L - c))^T U, r = exp(c_L) from the last row:
  // (Dk, L) @ (L, Dv) with A[d, j] = kend[j * Dk + d].
  gemm(Init::kRowScale, dk, dv, L, kend, 1, dk, u, dv, w.state.data(), dv, r);
}

// Task (sequence b, value head h): the sequence's chunks from its initial state.
template <typename T, typename S>
void varlen_task(const KDAProblem& p, const KDATensors<T, S>& io, const int64_t* qsl,
                 const bool* has_init, int64_t Q, int64_t b, int64_t h, ChunkScratch& w) {
  const int64_t lo = qsl[b], hi = qsl[b + 1];
  const int64_t slot = p.slots[b];
  const int64_t size = p.dk * p.dv;
  if (slot < 0) {
    for (int64_t t = lo; t < hi; ++t) {
      T* orow = io.out + (t * p.v_heads + h) * p.dv;
      std::fill(orow, orow + p.dv, store_as<T>(0.0f));
    }
    return;
  }
  if (hi == lo) return;
  S* st = io.states + (slot * p.v_heads + h) * size;
  float* state = w.state.data();
  if (has_init[b]) {
    convert_row(st, state, size);
  } else {
    std::fill(state, state + size, 0.0f);
  }
  for (int64_t t0 = lo; t0 < hi; t0 += Q) run_chunk(p, io, t0, std::min(Q, hi - t0), Q, h, w);
  convert_row(state, st, size);
}

// A (T, ...) tensor whose dims after the first are contiguous (token stride free), else a copy.
at::Tensor rows_contiguous(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return t.contiguous();
    expected *= t.size(d);
  }
  return t;
}

struct KDAArgs {
  at::Tensor q, k, v, a, b, A_log, dt_bias, slots;
  float lower_bound;
};

KDAArgs check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                   const at::Tensor& dt_bias, const at::Tensor& ssm_states,
                   const at::Tensor& state_indices, double lower_bound) {
  // A ValueError in Python; NaN fails the check too.
  TORCH_CHECK_VALUE(lower_bound <= 0.0,
                    "lower_bound must be 0 (softplus gate) or negative, got ", lower_bound);
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes(), "q and k must be (T, Hk, Dk)");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == q.size(0), "v must be (T, Hv, Dv)");
  const int64_t tokens = v.size(0), hv = v.size(1), dk = q.size(2);
  TORCH_CHECK(q.size(1) > 0 && hv % q.size(1) == 0, "Hv must be a multiple of Hk");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(a.size(0) == tokens && a.numel() == tokens * hv * dk, "a must be (T, Hv * Dk)");
  TORCH_CHECK(b.dim() == 2 && b.size(0) == tokens && b.size(1) == hv, "b must be (T, Hv)");
  TORCH_CHECK(A_log.numel() == hv, "A_log must have Hv elements");
  TORCH_CHECK(dt_bias.numel() == hv * dk, "dt_bias must be (Hv * Dk,)");
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.size(1) == hv && ssm_states.size(2) == dk &&
                  ssm_states.size(3) == v.size(2),
              "ssm_states must be (S, Hv, Dk, Dv)");
  TORCH_CHECK(ssm_states.is_contiguous(), "ssm_states must be contiguous");
  return KDAArgs{rows_contiguous(q),
                 rows_contiguous(k),
                 rows_contiguous(v),
                 a.to(at::kFloat).reshape({tokens, hv * dk}).contiguous(),
                 b.to(at::kFloat).contiguous(),
                 A_log.to(at::kFloat).reshape({hv}).contiguous(),
                 dt_bias.to(at::kFloat).reshape({hv * dk}).contiguous(),
                 as_index(state_indices),
                 static_cast<float>(lower_bound)};
}

KDAProblem make_problem(const KDAArgs& x) {
  return KDAProblem{x.q.size(1),
                    x.v.size(1),
                    x.q.size(2),
                    x.v.size(2),
                    x.q.stride(0),
                    x.k.stride(0),
                    x.v.stride(0),
                    x.a.data_ptr<float>(),
                    x.b.data_ptr<float>(),
                    x.A_log.data_ptr<float>(),
                    x.dt_bias.data_ptr<float>(),
                    x.slots.data_ptr<int64_t>(),
                    x.lower_bound};
}

// Calls fn(io) with the typed pointers of q / k / v (type T) and the states (type S).
template <typename Fn>
void dispatch_io(const KDAArgs& x, at::Tensor& ssm_states, at::Tensor& out, Fn&& fn) {
  dispatch_float_bf16(x.v, "v", [&](auto* vt) {
    using T = std::remove_pointer_t<decltype(vt)>;
    dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      fn(KDATensors<T, S>{x.q.data_ptr<T>(), x.k.data_ptr<T>(), x.v.data_ptr<T>(),
                          ssm_states.data_ptr<S>(), out.data_ptr<T>()});
    });
  });
}

at::Tensor kda_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, at::Tensor ssm_states,
                      const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                      const at::Tensor& has_initial_state, int64_t chunk_size,
                      double lower_bound) {
  TORCH_CHECK(chunk_size > 0, "chunk_size must be positive");
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  const KDAArgs x =
      check_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, lower_bound);
  const at::Tensor qsl_t = as_index(query_start_loc);
  const at::Tensor init_t = has_initial_state.to(at::kBool).contiguous();
  const int64_t* qsl = qsl_t.data_ptr<int64_t>();
  const bool* has_init = init_t.data_ptr<bool>();
  const int64_t tokens = x.v.size(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[batch] <= tokens, "query_start_loc must run from 0 to <= T");
  at::Tensor out = at::empty(x.v.sizes(), x.v.options());  // (T, Hv, Dv)
  if (qsl[batch] < tokens) out.narrow(0, qsl[batch], tokens - qsl[batch]).zero_();
  if (batch == 0) return out;
  const KDAProblem p = make_problem(x);
  // The chunked form is exact for any Q: no chunk needs to be longer than the longest sequence.
  int64_t Q = 1;
  for (int64_t i = 0; i < batch; ++i) Q = std::max(Q, std::min(chunk_size, qsl[i + 1] - qsl[i]));
  dispatch_io(x, ssm_states, out, [&](auto io) {
    at::parallel_for(0, batch * p.v_heads, 1, [&](int64_t lo, int64_t hi) {
      ChunkScratch w;
      w.resize(Q, p.dk, p.dv);
      for (int64_t i = lo; i < hi; ++i) {
        varlen_task(p, io, qsl, has_init, Q, i / p.v_heads, i % p.v_heads, w);
      }
    });
  });
  return out;
}

// ---- decode: the fused one-token update -----------------------------------------------------

// Row r, value head h of the decode step: two passes over the slot's (Dk, Dv) state.
template <typename T, typename S>
void update_task(const KDAProblem& p, const KDATensors<T, S>& io, int64_t r, int64_t h,
                 float* scratch) {
  const int64_t dk = p.dk, dv = p.dv;
  T* orow = io.out + (r * p.v_heads + h) * dv;
  const int64_t slot = p.slots[r];
  if (slot < 0) {
    std::fill(orow, orow + dv, store_as<T>(0.0f));
    return;
  }
  float* kn = scratch;     // (Dk,)
  float* qn = kn + dk;     // (Dk,)
  float* decay = qn + dk;  // (Dk,) g, then exp(g)
  float* kv = decay + dk;  // (Dv,) (D S)^T k, then delta
  float* qs = kv + dv;     // (Dv,) (D S)^T q, then o
  const int64_t kh = h / (p.v_heads / p.k_heads);
  l2norm_row(io.k + r * p.k_stride + kh * dk, dk, 1.0f, kn);
  l2norm_row(io.q + r * p.q_stride + kh * dk, dk, 1.0f / std::sqrt(static_cast<float>(dk)), qn);
  const float beta = gates(p, r, h, decay);
  float kq = 0.0f;
#pragma omp simd reduction(+ : kq)
  for (int64_t d = 0; d < dk; ++d) {
    decay[d] = exp_f32(decay[d]);
    kq += kn[d] * qn[d];
  }
  S* st = io.states + (slot * p.v_heads + h) * dk * dv;
  std::fill(kv, kv + 2 * dv, 0.0f);
  const int64_t full = dv - dv % kLanes, tail = dv - full;
  for (int64_t d = 0; d < dk; ++d) {  // read pass
    const S* srow = st + d * dv;
    const Vf kd = vec::set1(kn[d] * decay[d]), qd = vec::set1(qn[d] * decay[d]);
    for (int64_t j = 0; j < full; j += kLanes) {
      const Vf s = vload(srow + j);
      vec::store(kv + j, vec::fma(kd, s, vec::load(kv + j)));
      vec::store(qs + j, vec::fma(qd, s, vec::load(qs + j)));
    }
    if (tail > 0) {
      const Vf s = vload_n(srow + full, tail);
      vec::store_n(kv + full, vec::fma(kd, s, vec::load_n(kv + full, tail)), tail);
      vec::store_n(qs + full, vec::fma(qd, s, vec::load_n(qs + full, tail)), tail);
    }
  }
  const T* vrow = io.v + r * p.v_stride + h * dv;
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    const float delta = beta * (load_f32(vrow[j]) - kv[j]);
    kv[j] = delta;
    qs[j] += kq * delta;
  }
  convert_row(qs, orow, dv);
  for (int64_t d = 0; d < dk; ++d) {  // read-write pass: S = D S + k delta^T
    S* srow = st + d * dv;
    const Vf dd = vec::set1(decay[d]), kd = vec::set1(kn[d]);
    for (int64_t j = 0; j < full; j += kLanes) {
      vstore(srow + j, vec::fma(kd, vec::load(kv + j), vec::mul(dd, vload(srow + j))));
    }
    if (tail > 0) {
      const Vf s = vec::mul(dd, vload_n(srow + full, tail));
      vstore_n(srow + full, vec::fma(kd, vec::load_n(kv + full, tail), s), tail);
    }
  }
}

at::Tensor kda_update(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, at::Tensor ssm_states,
                      const at::Tensor& state_indices, double lower_bound) {
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(v.dim() == 3 && v.size(0) == batch, "v must be (B, Hv, Dv)");
  const KDAArgs x =
      check_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, lower_bound);
  at::Tensor out = at::empty(x.v.sizes(), x.v.options());  // (B, Hv, Dv)
  if (batch == 0) return out;
  const KDAProblem p = make_problem(x);
  // A task is one (Dk, Dv) state: group them so a thread gets at least ~64K state entries.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(p.dk * p.dv, 1));
  dispatch_io(x, ssm_states, out, [&](auto io) {
    at::parallel_for(0, batch * p.v_heads, grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch(3 * p.dk + 2 * p.dv);
      for (int64_t i = lo; i < hi; ++i) {
        update_task(p, io, i / p.v_heads, i % p.v_heads, scratch.data());
      }
    });
  });
  return out;
}

// ---- the output norm ------------------------------------------------------------------------

// out = weight * rmsnorm(x) * sigmoid(gate), all in float32, rounded once to T.
template <typename T, typename Z, typename W>
void norm_gate_row(const T* x, const Z* gate, const W* weight, T* out, int64_t dim, float eps,
                   float* buf) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < dim; ++i) {
    const float xi = load_f32(x[i]);
    sq += xi * xi;
  }
  const float scale = 1.0f / std::sqrt(sq / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    const float normed = load_f32(x[i]) * scale;
    buf[i] = load_f32(weight[i]) * normed / (1.0f + exp_f32(-load_f32(gate[i])));
  }
  convert_row(buf, out, dim);
}

at::Tensor kda_norm_gate(const at::Tensor& o_in, const at::Tensor& gate_in,
                         const at::Tensor& weight, double eps) {
  TORCH_CHECK(o_in.dim() >= 1 && gate_in.sizes() == o_in.sizes(), "o and gate must be (..., Dv)");
  const int64_t dim = o_in.size(-1);
  TORCH_CHECK(weight.numel() == dim, "weight must be (Dv,)");
  const at::Tensor x = o_in.reshape({-1, dim}).contiguous();     // (N, Dv)
  const at::Tensor z = gate_in.reshape({-1, dim}).contiguous();  // (N, Dv)
  const at::Tensor w = weight.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, dim}, x.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  dispatch_float_bf16(x, "o", [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    dispatch_float_bf16(z, "gate", [&](auto* zt) {
      using Z = std::remove_pointer_t<decltype(zt)>;
      dispatch_float_bf16(w, "weight", [&](auto* wt) {
        using W = std::remove_pointer_t<decltype(wt)>;
        const T* xp = x.data_ptr<T>();
        const Z* zp = z.data_ptr<Z>();
        const W* wp = w.data_ptr<W>();
        T* op = out.data_ptr<T>();
        at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
          std::vector<float> buf(dim);
          for (int64_t r = lo; r < hi; ++r) {
            norm_gate_row(xp + r * dim, zp + r * dim, wp, op + r * dim, dim,
                          static_cast<float>(eps), buf.data());
          }
        });
      });
    });
  });
  return out.view(o_in.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("kda_varlen", &kda_varlen);
  m.impl("kda_update", &kda_update);
  m.impl("kda_norm_gate", &kda_norm_gate);
}

}  // namespace vllm_mamba
