// The Gated DeltaNet (GDN) ops on the CPU: the chunked gated delta rule over a packed varlen
// batch, its fused one-token update, and the per-head gated RMSNorm of its output. Shapes and
// semantics follow `vllm_mamba/ops/gated_delta.py` (its docstring has the math and glossary):
// per token and value head h (reading key head h / (Hv / Hk)), with q and k L2-normalised
// (eps 1e-6) and q scaled by Dk^-1/2,
//   g = -exp(A_log) softplus(a + dt_bias), beta = beta_scale sigmoid(b),
//   S = exp(g) S + k (beta (v - exp(g) S^T k))^T, o = S^T q,
// each sequence starting from its slot's state `(S, Hv, Dk, Dv)` where it has an initial state
// (zeros otherwise) and leaving its final state there; slot -1 marks a padding row (its slot is
// neither read nor written, its outputs are zeros). Math in float32 whatever the dtypes.
//
// Prefill runs the chunked form: a task is (sequence, value head), its (Dk, Dv) state in a
// float32 buffer for the whole sequence; per chunk of L <= Q tokens the products with the state
// ([K; Q] S0, the end-of-chunk update K^T U) and within the chunk (K K^T, Q K^T, the masked
// (Q K^T) U) are register-blocked matmuls (`gemm`), and the unit lower triangular system is a
// blocked forward substitution. Decode runs the recurrence fused, two passes over each state:
// one read pass for S^T k and S^T q together, one read-write pass for the update, with
// o = exp(g) S_old^T q + (k . q) delta.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernel_math.h"
#include "small_gemm.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

// A matmul tile: kMR rows of kNB columns, 12 accumulator vectors (two AVX-512 vectors of 16
// lanes a row, two AVX2 vectors of 8): enough independent FMA chains to cover their latency.
// (16 columns on AVX-512 left 6 chains: the chunked prefill's products ran at a quarter of the
// FMA peak.)
#if defined(VLLM_MAMBA_VEC_AVX512)
constexpr int64_t kNB = 32;
#else
constexpr int64_t kNB = 16;
#endif
constexpr int64_t kMR = 6;
constexpr float kL2Eps = 1e-6f;

// Which part of a product a caller needs (row i of C, column j, inner index k).
enum class Tri {
  kFull,     // all of C
  kLowerA,   // all of C, A lower triangular (A[i, k] = 0 for k > i: the sums stop at i)
  kLowerC,   // only C[i, j] for j <= i (other tiles are skipped, their content undefined)
};

// C (M, N) = c_scale * C + A (M, K) @ B (K, N), row-major float32 with leading dims.
void gemm(Tri tri, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, float c_scale) {
  for (int64_t j0 = 0; j0 < N; j0 += kNB) {
    const int64_t nw = std::min(kNB, N - j0);
    for (int64_t i0 = 0; i0 < M; i0 += kMR) {
      const int64_t mr = std::min(kMR, M - i0);
      if (tri == Tri::kLowerC && j0 >= i0 + mr) continue;
      const int64_t kk = tri == Tri::kLowerA ? std::min(K, i0 + mr) : K;
      small_gemm::rows_tile<kMR, kNB>(mr, kk, nw, A + i0 * lda, lda, B + j0, ldb,
                                      C + i0 * ldc + j0, ldc, {c_scale});
    }
  }
}

// The shared problem of the varlen and update ops (pointers into contiguous-row tensors).
struct GDNProblem {
  int64_t k_heads, v_heads, dk, dv;
  int64_t q_stride, k_stride, v_stride;  // token strides of q, k and v
  const float* a;        // (T, Hv) contiguous
  const float* b;        // (T, Hv) contiguous
  const float* A_log;    // (Hv,)
  const float* dt_bias;  // (Hv,)
  float beta_scale;
  const int64_t* slots;  // (B,)
};

template <typename T, typename S>
struct GDNTensors {
  const T* q;  // (T, Hk, Dk), token stride q_stride
  const T* k;  // (T, Hk, Dk), token stride k_stride
  const T* v;  // (T, Hv, Dv), token stride v_stride
  S* states;   // (S, Hv, Dk, Dv)
  T* out;      // (T, Hv, Dv), contiguous
};

// Log decay g and beta of token t, value head h.
inline void gates(const GDNProblem& p, int64_t t, int64_t h, float* g, float* beta) {
  const float a = p.a[t * p.v_heads + h] + p.dt_bias[h];
  *g = -std::exp(p.A_log[h]) * softplus_f32(a);
  *beta = p.beta_scale / (1.0f + std::exp(-p.b[t * p.v_heads + h]));
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

// Per-task float32 buffers of the chunked form (chunk size Q).
struct ChunkScratch {
  std::vector<float> kq;     // (2Q, Dk): normalised k rows, then scaled q rows
  std::vector<float> kt;     // (Dk, Q): k transposed, later scaled by exp(c_L - c_j)
  std::vector<float> ks;     // (2Q, Dv): K S0, then Q S0 (turned into the outputs)
  std::vector<float> gram;   // (2Q, Q): K K^T (turned into -A), then Q K^T (masked, decayed)
  std::vector<float> u;      // (Q, Dv): the new values U
  std::vector<float> cum;    // (Q,): cumulative log decay
  std::vector<float> beta;   // (Q,)
  std::vector<float> decay;  // (Q,): exp(c_L - c_j), the state update's decay of token j
  std::vector<float> state;  // (Dk, Dv)
  void resize(int64_t Q, int64_t dk, int64_t dv) {
    kq.resize(2 * Q * dk);
    kt.resize(dk * Q);
    ks.resize(2 * Q * dv);
    gram.resize(2 * Q * Q);
    u.resize(Q * dv);
    cum.resize(Q);
    beta.resize(Q);
    decay.resize(Q);
    state.resize(dk * dv);
  }
};

// Tokens ahead whose q / k / v rows `load_chunk` prefetches: a task reads one head's rows, a
// few hundred bytes token strides apart, which the hardware prefetchers do not follow (the
// loads of v were a tenth of a 512-token prefill's time before).
constexpr int64_t kAhead = 4;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) {
    __builtin_prefetch(p + off);
  }
}

// Loads chunk tokens [t0, t0 + L) of value head h: normalised k and q, the gates, v.
template <typename T, typename S>
void load_chunk(const GDNProblem& p, const GDNTensors<T, S>& io, int64_t t0, int64_t L,
                int64_t Q, int64_t h, ChunkScratch& w) {
  const int64_t dk = p.dk, dv = p.dv;
  const int64_t kh = h / (p.v_heads / p.k_heads);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  float c = 0.0f;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = t0 + i;
    if (i + kAhead < L) {  // the rows kAhead tokens on: a head's rows are token strides apart
      prefetch_row(io.k + (t + kAhead) * p.k_stride + kh * dk, dk);
      prefetch_row(io.q + (t + kAhead) * p.q_stride + kh * dk, dk);
      prefetch_row(io.v + (t + kAhead) * p.v_stride + h * dv, dv);
    }
    float* krow = w.kq.data() + i * dk;
    l2norm_row(io.k + t * p.k_stride + kh * dk, dk, 1.0f, krow);
    l2norm_row(io.q + t * p.q_stride + kh * dk, dk, q_scale, w.kq.data() + (L + i) * dk);
    for (int64_t d = 0; d < dk; ++d) w.kt[d * Q + i] = krow[d];
    float g;
    gates(p, t, h, &g, &w.beta[i]);
    c += g;
    w.cum[i] = c;
    const T* vrow = io.v + t * p.v_stride + h * dv;
    float* urow = w.u.data() + i * dv;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) urow[j] = load_f32(vrow[j]);
  }
}

// Solves (I + A) U = R in place (U holds R), with w.gram's first L rows holding -A (strictly
// lower): U's row blocks first take the products with the solved rows above, then a short
// substitution inside the block.
void forward_substitution(int64_t L, int64_t Q, int64_t dv, const float* neg_a, float* u) {
  for (int64_t i0 = 0; i0 < L; i0 += kMR) {
    const int64_t i1 = std::min(L, i0 + kMR);
    if (i0 > 0) gemm(Tri::kFull, i1 - i0, dv, i0, neg_a + i0 * Q, Q, u, dv, u + i0 * dv, dv, 1.0f);
    for (int64_t i = i0 + 1; i < i1; ++i) {
      float* ui = u + i * dv;
      for (int64_t j = i0; j < i; ++j) {
        const float aij = neg_a[i * Q + j];
        const float* uj = u + j * dv;
#pragma omp simd
        for (int64_t d = 0; d < dv; ++d) ui[d] += aij * uj[d];
      }
    }
  }
}

// One chunk of L tokens from t0: writes its outputs and advances w.state (S0 -> S_L).
template <typename T, typename S>
void run_chunk(const GDNProblem& p, const GDNTensors<T, S>& io, int64_t t0, int64_t L, int64_t Q,
               int64_t h, ChunkScratch& w) {
  const int64_t dk = p.dk, dv = p.dv;
  load_chunk(p, io, t0, L, Q, h, w);
  const float* kq = w.kq.data();  // (2L, Dk)
  float* ks = w.ks.data();         // (2L, Dv)
  float* gram = w.gram.data();     // (2L, Q)
  float* u = w.u.data();           // (L, Dv)
  const float* cum = w.cum.data();
  gemm(Tri::kFull, 2 * L, dv, dk, kq, dk, w.state.data(), dv, ks, dv, 0.0f);
  gemm(Tri::kLowerC, L, L, dk, kq, dk, w.kt.data(), Q, gram, Q, 0.0f);
  gemm(Tri::kLowerC, L, L, dk, kq + L * dk, dk, w.kt.data(), Q, gram + L * Q, Q, 0.0f);
  for (int64_t i = 0; i < L; ++i) {
    const float bi = w.beta[i], ci = cum[i], eci = std::exp(ci);
    float* neg_a = gram + i * Q;        // -A[i, j] = -beta_i exp(c_i - c_j) k_i . k_j, j < i
    float* mask = gram + (L + i) * Q;   // exp(c_i - c_j) q_i . k_j, j <= i; 0 up to the tile
#pragma omp simd
    for (int64_t j = 0; j <= i; ++j) {
      const float decay = exp_f32(ci - cum[j]);
      mask[j] *= decay;
      if (j < i) neg_a[j] *= -bi * decay;
    }
    for (int64_t j = i + 1; j < std::min(L, (i / kMR + 1) * kMR); ++j) mask[j] = 0.0f;
    float* ui = u + i * dv;
    const float* ksi = ks + i * dv;
    float* qsi = ks + (L + i) * dv;
#pragma omp simd
    for (int64_t d = 0; d < dv; ++d) {
      ui[d] = bi * (ui[d] - eci * ksi[d]);  // R = beta (V - exp(c) K S0)
      qsi[d] *= eci;                        // exp(c) Q S0
    }
  }
  forward_substitution(L, Q, dv, gram, u);
  float* o = ks + L * dv;  // (L, Dv)
  gemm(Tri::kLowerA, L, dv, L, gram + L * Q, Q, u, dv, o, dv, 1.0f);
  for (int64_t i = 0; i < L; ++i) {
    T* orow = io.out + ((t0 + i) * p.v_heads + h) * dv;
#pragma omp simd
    for (int64_t d = 0; d < dv; ++d) orow[d] = store_as<T>(o[i * dv + d]);
  }
  const float c_end = cum[L - 1];
  float* decay = w.decay.data();  // exp(c_L - c_j)
#pragma omp simd
  for (int64_t j = 0; j < L; ++j) decay[j] = exp_f32(c_end - cum[j]);
  for (int64_t d = 0; d < dk; ++d) {
#pragma omp simd
    for (int64_t j = 0; j < L; ++j) w.kt[d * Q + j] *= decay[j];
  }
  gemm(Tri::kFull, dk, dv, L, w.kt.data(), Q, u, dv, w.state.data(), dv, std::exp(c_end));
}

// Task (sequence b, value head h): the sequence's chunks from its initial state.
template <typename T, typename S>
void varlen_task(const GDNProblem& p, const GDNTensors<T, S>& io, const int64_t* qsl,
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
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) state[i] = load_f32(st[i]);
  } else {
    std::fill(state, state + size, 0.0f);
  }
  for (int64_t t0 = lo; t0 < hi; t0 += Q) run_chunk(p, io, t0, std::min(Q, hi - t0), Q, h, w);
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) st[i] = store_as<S>(state[i]);
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

struct GDNArgs {
  at::Tensor q, k, v, a, b, A_log, dt_bias, slots;
};

GDNArgs check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                   const at::Tensor& dt_bias, const at::Tensor& ssm_states,
                   const at::Tensor& state_indices) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes(), "q and k must be (T, Hk, Dk)");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == q.size(0), "v must be (T, Hv, Dv)");
  const int64_t tokens = v.size(0), hv = v.size(1);
  TORCH_CHECK(q.size(1) > 0 && hv % q.size(1) == 0, "Hv must be a multiple of Hk");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(a.dim() == 2 && a.size(0) == tokens && a.size(1) == hv && b.sizes() == a.sizes(),
              "a and b must be (T, Hv)");
  TORCH_CHECK(A_log.numel() == hv && dt_bias.numel() == hv, "A_log and dt_bias must be (Hv,)");
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.size(1) == hv &&
                  ssm_states.size(2) == q.size(2) && ssm_states.size(3) == v.size(2),
              "ssm_states must be (S, Hv, Dk, Dv)");
  TORCH_CHECK(ssm_states.is_contiguous(), "ssm_states must be contiguous");
  return GDNArgs{rows_contiguous(q),
                 rows_contiguous(k),
                 rows_contiguous(v),
                 a.to(at::kFloat).contiguous(),
                 b.to(at::kFloat).contiguous(),
                 A_log.to(at::kFloat).contiguous(),
                 dt_bias.to(at::kFloat).contiguous(),
                 as_index(state_indices)};
}

GDNProblem make_problem(const GDNArgs& x, double beta_scale) {
  return GDNProblem{x.q.size(1),
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
                    static_cast<float>(beta_scale),
                    x.slots.data_ptr<int64_t>()};
}

// Calls fn(io) with the typed pointers of q / k / v (type T) and the states (type S).
template <typename Fn>
void dispatch_io(const GDNArgs& x, at::Tensor& ssm_states, at::Tensor& out, Fn&& fn) {
  dispatch_float_bf16(x.v, "v", [&](auto* vt) {
    using T = std::remove_pointer_t<decltype(vt)>;
    dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      fn(GDNTensors<T, S>{x.q.data_ptr<T>(), x.k.data_ptr<T>(), x.v.data_ptr<T>(),
                          ssm_states.data_ptr<S>(), out.data_ptr<T>()});
    });
  });
}

at::Tensor gated_delta_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                              const at::Tensor& dt_bias, double beta_scale, at::Tensor ssm_states,
                              const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                              const at::Tensor& has_initial_state, int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0, "chunk_size must be positive");
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  const GDNArgs x = check_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices);
  const at::Tensor qsl_t = as_index(query_start_loc);
  const at::Tensor init_t = has_initial_state.to(at::kBool).contiguous();
  const int64_t* qsl = qsl_t.data_ptr<int64_t>();
  const bool* has_init = init_t.data_ptr<bool>();
  const int64_t tokens = x.v.size(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[batch] <= tokens, "query_start_loc must run from 0 to <= T");
  at::Tensor out = at::empty(x.v.sizes(), x.v.options());  // (T, Hv, Dv)
  if (qsl[batch] < tokens) out.narrow(0, qsl[batch], tokens - qsl[batch]).zero_();
  if (batch == 0) return out;
  const GDNProblem p = make_problem(x, beta_scale);
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

// Row r, value head h of the decode step: two passes over the slot's (Dk, Dv) state.
template <typename T, typename S>
void update_task(const GDNProblem& p, const GDNTensors<T, S>& io, int64_t r, int64_t h,
                 float* scratch) {
  const int64_t dk = p.dk, dv = p.dv;
  T* orow = io.out + (r * p.v_heads + h) * dv;
  const int64_t slot = p.slots[r];
  if (slot < 0) {
    std::fill(orow, orow + dv, store_as<T>(0.0f));
    return;
  }
  float* kn = scratch;        // (Dk,)
  float* qn = kn + dk;        // (Dk,)
  float* kv = qn + dk;        // (Dv,) S^T k, then delta
  float* qs = kv + dv;        // (Dv,) S^T q
  const int64_t kh = h / (p.v_heads / p.k_heads);
  l2norm_row(io.k + r * p.k_stride + kh * dk, dk, 1.0f, kn);
  l2norm_row(io.q + r * p.q_stride + kh * dk, dk, 1.0f / std::sqrt(static_cast<float>(dk)), qn);
  float g, beta;
  gates(p, r, h, &g, &beta);
  const float decay = std::exp(g);
  S* st = io.states + (slot * p.v_heads + h) * dk * dv;
  std::fill(kv, kv + 2 * dv, 0.0f);
  for (int64_t d = 0; d < dk; ++d) {
    const S* srow = st + d * dv;
    const float kd = kn[d], qd = qn[d];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      const float s = load_f32(srow[j]);
      kv[j] += s * kd;
      qs[j] += s * qd;
    }
  }
  float kq = 0.0f;
#pragma omp simd reduction(+ : kq)
  for (int64_t d = 0; d < dk; ++d) kq += kn[d] * qn[d];
  const T* vrow = io.v + r * p.v_stride + h * dv;
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    const float delta = beta * (load_f32(vrow[j]) - decay * kv[j]);
    kv[j] = delta;
    orow[j] = store_as<T>(decay * qs[j] + kq * delta);
  }
  for (int64_t d = 0; d < dk; ++d) {
    S* srow = st + d * dv;
    const float kd = kn[d];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) srow[j] = store_as<S>(decay * load_f32(srow[j]) + kd * kv[j]);
  }
}

at::Tensor gated_delta_update(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                              const at::Tensor& dt_bias, double beta_scale, at::Tensor ssm_states,
                              const at::Tensor& state_indices) {
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(v.dim() == 3 && v.size(0) == batch, "v must be (B, Hv, Dv)");
  const GDNArgs x = check_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices);
  at::Tensor out = at::empty(x.v.sizes(), x.v.options());  // (B, Hv, Dv)
  if (batch == 0) return out;
  const GDNProblem p = make_problem(x, beta_scale);
  // A task is one (Dk, Dv) state: group them so a thread gets at least ~64K state entries.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(p.dk * p.dv, 1));
  dispatch_io(x, ssm_states, out, [&](auto io) {
    at::parallel_for(0, batch * p.v_heads, grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch(2 * (p.dk + p.dv));
      for (int64_t i = lo; i < hi; ++i) {
        update_task(p, io, i / p.v_heads, i % p.v_heads, scratch.data());
      }
    });
  });
  return out;
}

// out = (weight * cast_P(rmsnorm(x))) * silu(z), cast to T; the weight product is rounded to
// bfloat16 when both x and the weight are bfloat16 (torch's type promotion in the reference).
template <bool kRoundProduct, typename T, typename Z, typename W>
void norm_gate_row(const T* x, const Z* z, const W* weight, T* out, int64_t dim, float eps) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < dim; ++i) {
    const float xi = load_f32(x[i]);
    sq += xi * xi;
  }
  const float scale = 1.0f / std::sqrt(sq / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    const float normed = load_f32(store_as<T>(load_f32(x[i]) * scale));
    float prod = load_f32(weight[i]) * normed;
    if constexpr (kRoundProduct) prod = load_f32(store_as<at::BFloat16>(prod));
    out[i] = store_as<T>(prod * silu_f32(load_f32(z[i])));
  }
}

at::Tensor rms_norm_gated(const at::Tensor& x_in, const at::Tensor& z_in, const at::Tensor& weight,
                          double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && z_in.sizes() == x_in.sizes(), "x and z must be (..., Dv)");
  const int64_t dim = x_in.size(-1);
  TORCH_CHECK(weight.numel() == dim, "weight must be (Dv,)");
  const at::Tensor x = x_in.reshape({-1, dim}).contiguous();                       // (N, Dv)
  const at::Tensor z = z_in.reshape({-1, dim}).contiguous();                       // (N, Dv)
  const at::Tensor w = weight.contiguous();
  const bool round_product = at::promote_types(w.scalar_type(), x.scalar_type()) == at::kBFloat16;
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, dim}, x.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  dispatch_float_bf16(x, "x", [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    dispatch_float_bf16(z, "z", [&](auto* zt) {
      using Z = std::remove_pointer_t<decltype(zt)>;
      dispatch_float_bf16(w, "weight", [&](auto* wt) {
        using W = std::remove_pointer_t<decltype(wt)>;
        const T* xp = x.data_ptr<T>();
        const Z* zp = z.data_ptr<Z>();
        const W* wp = w.data_ptr<W>();
        T* op = out.data_ptr<T>();
        at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
          const auto row = round_product ? &norm_gate_row<true, T, Z, W>
                                         : &norm_gate_row<false, T, Z, W>;
          for (int64_t r = lo; r < hi; ++r) {
            row(xp + r * dim, zp + r * dim, wp, op + r * dim, dim, static_cast<float>(eps));
          }
        });
      });
    });
  });
  return out.view(x_in.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("gated_delta_varlen", &gated_delta_varlen);
  m.impl("gated_delta_update", &gated_delta_update);
  m.impl("rms_norm_gated", &rms_norm_gated);
}

}  // namespace vllm_mamba
