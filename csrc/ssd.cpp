// Mamba2's SSD scan over a packed varlen batch (`x (T, H, P)`), and its one-token state update,
// on the CPU. Shapes and semantics follow `vllm_mamba/ops/ssd.py`: per token and head
// dt' = clamp(softplus(dt + dt_bias)), h = exp(dt' A) h + dt' x (outer) B, y = h @ C + D x,
// with head h reading group h / (H / G) of B and C; each sequence starts from its slot's state
// `(S, H, P, N)` where it has an initial state (zeros otherwise) and leaves its final state
// there; a slot index of -1 marks a padding row whose slot is never read nor written.
//
// The references compute the same recurrence chunk-wise (matmuls within chunks of Q tokens);
// at 2 threads a sequential recurrence per token is far cheaper (O(P N) per token and head
// against O(Q (P + N)) more for the chunked form), so this kernel runs it token by token and
// the chunk size only has to be accepted. Rows of the state are independent given dt', B and
// C, so a task is (sequence, head, block of kRows rows of P): its (kRows, N) state stays in
// L1 across the sequence's tokens, held transposed so that each step is vectorised over the
// rows with no horizontal sums; a one-token sequence (decode) instead updates its slot in place,
// vectorised over N.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernel_math.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kRows = 16;  // rows of a head's (P, N) state per task

struct SSDProblem {
  int64_t heads, head_dim, groups, nstate, batch;
  int64_t x_stride, dt_stride, bc_stride;  // token strides of x, dt and B / C
  const int64_t* qsl;    // (B + 1,)
  const int64_t* slots;  // (B,)
  const bool* has_init;  // (B,)
  const float* A;        // (H,)
  const float* B;        // (T, G, N), token stride bc_stride
  const float* C;        // (T, G, N), token stride bc_stride
  const float* D_skip;   // (H,) or nullptr
  const float* dt_bias;  // (H,) or nullptr
  bool dt_softplus, clamp;
  float dt_min, dt_max;
};

template <typename T, typename S>
struct SSDTensors {
  const T* x;   // (T, H, P), token stride x_stride
  const T* dt;  // (T, H), token stride dt_stride
  S* states;    // (S, H, P, N)
  T* out;       // (T, H, P), contiguous
};

inline float discretize(const SSDProblem& p, float dt, int64_t h) {
  float v = dt + (p.dt_bias ? p.dt_bias[h] : 0.0f);
  if (p.dt_softplus) v = softplus_f32(v);
  if (p.clamp) v = std::min(std::max(v, p.dt_min), p.dt_max);
  return v;
}

// Advances rows [p0, p0 + nrows) of head h's state `hs (nrows, N)` by token t; writes y.
template <typename T, typename S>
void ssd_token(const SSDProblem& p, const SSDTensors<T, S>& io, int64_t t, int64_t h,
               int64_t p0, int64_t nrows, float* hs) {
  const int64_t n_st = p.nstate;
  const float delta = discretize(p, to_f32(io.dt[t * p.dt_stride + h]), h);
  const float decay = std::exp(delta * p.A[h]);
  const int64_t g = h / (p.heads / p.groups);
  const float* b_row = p.B + t * p.bc_stride + g * n_st;
  const float* c_row = p.C + t * p.bc_stride + g * n_st;
  const T* x_row = io.x + t * p.x_stride + h * p.head_dim + p0;
  T* y_row = io.out + (t * p.heads + h) * p.head_dim + p0;
  const float skip = p.D_skip ? p.D_skip[h] : 0.0f;
  for (int64_t r = 0; r < nrows; ++r) {
    const float xr = to_f32(x_row[r]);
    const float xd = delta * xr;
    float* hr = hs + r * n_st;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < n_st; ++n) {
      const float v = decay * hr[n] + xd * b_row[n];
      hr[n] = v;
      acc += v * c_row[n];
    }
    y_row[r] = static_cast<T>(acc + skip * xr);
  }
}

// Token t for rows [p0, p0 + nrows) of head h, the state held transposed as `ht (N, kRows)`:
// every step is a loop over kRows contiguous lanes with B[n] and C[n] broadcast, so the
// outputs need no horizontal sums.
template <typename T, typename S>
void ssd_token_t(const SSDProblem& p, const SSDTensors<T, S>& io, int64_t t, int64_t h,
                 int64_t p0, int64_t nrows, float* ht) {
  const float delta = discretize(p, to_f32(io.dt[t * p.dt_stride + h]), h);
  const float decay = std::exp(delta * p.A[h]);
  const int64_t g = h / (p.heads / p.groups);
  const float* b_row = p.B + t * p.bc_stride + g * p.nstate;
  const float* c_row = p.C + t * p.bc_stride + g * p.nstate;
  const T* x_row = io.x + t * p.x_stride + h * p.head_dim + p0;
  float xr[kRows] = {};
  float xd[kRows];
  float y[kRows] = {};
  for (int64_t r = 0; r < nrows; ++r) xr[r] = to_f32(x_row[r]);
#pragma omp simd
  for (int64_t r = 0; r < kRows; ++r) xd[r] = delta * xr[r];
  for (int64_t n = 0; n < p.nstate; ++n) {
    float* hn = ht + n * kRows;
    const float bn = b_row[n];
    const float cn = c_row[n];
#pragma omp simd
    for (int64_t r = 0; r < kRows; ++r) {
      hn[r] = decay * hn[r] + xd[r] * bn;
      y[r] += hn[r] * cn;
    }
  }
  const float skip = p.D_skip ? p.D_skip[h] : 0.0f;
  T* y_row = io.out + (t * p.heads + h) * p.head_dim + p0;
  for (int64_t r = 0; r < nrows; ++r) y_row[r] = static_cast<T>(y[r] + skip * xr[r]);
}

// A multi-token task: the rows are transposed into `scratch (N, kRows)` (zero lanes past
// nrows), scanned over the sequence's tokens, and written back to the slot.
template <typename T, typename S>
void ssd_task_seq(const SSDProblem& p, const SSDTensors<T, S>& io, int64_t b, int64_t h,
                  int64_t p0, int64_t nrows, std::vector<float>& scratch) {
  const int64_t slot = p.slots[b];
  const int64_t n_st = p.nstate;
  S* st = slot >= 0 ? io.states + ((slot * p.heads + h) * p.head_dim + p0) * n_st : nullptr;
  scratch.assign(n_st * kRows, 0.0f);
  float* ht = scratch.data();
  if (slot >= 0 && p.has_init[b]) {
    for (int64_t r = 0; r < nrows; ++r) {
      for (int64_t n = 0; n < n_st; ++n) ht[n * kRows + r] = to_f32(st[r * n_st + n]);
    }
  }
  for (int64_t t = p.qsl[b]; t < p.qsl[b + 1]; ++t) ssd_token_t(p, io, t, h, p0, nrows, ht);
  if (st == nullptr) return;
  for (int64_t r = 0; r < nrows; ++r) {
    for (int64_t n = 0; n < n_st; ++n) st[r * n_st + n] = static_cast<S>(ht[n * kRows + r]);
  }
}

// A one-token task (decode): a float32 slot is advanced in place, row by row, vectorised over
// N; otherwise (bfloat16 state, padding row) the rows live in `scratch (nrows, N)`.
template <typename T, typename S>
void ssd_task_one(const SSDProblem& p, const SSDTensors<T, S>& io, int64_t b, int64_t h,
                  int64_t p0, int64_t nrows, std::vector<float>& scratch) {
  const int64_t slot = p.slots[b];
  const int64_t len = nrows * p.nstate;
  S* st = slot >= 0 ? io.states + ((slot * p.heads + h) * p.head_dim + p0) * p.nstate : nullptr;
  float* hs = nullptr;
  if constexpr (std::is_same_v<S, float>) hs = st;
  if (hs == nullptr) {
    scratch.resize(len);
    hs = scratch.data();
  }
  if (slot >= 0 && p.has_init[b]) {
    if (static_cast<void*>(hs) != static_cast<void*>(st)) {
      for (int64_t i = 0; i < len; ++i) hs[i] = to_f32(st[i]);
    }
  } else {
    std::fill(hs, hs + len, 0.0f);
  }
  ssd_token(p, io, p.qsl[b], h, p0, nrows, hs);
  if (st && static_cast<void*>(hs) != static_cast<void*>(st)) {
    for (int64_t i = 0; i < len; ++i) st[i] = static_cast<S>(hs[i]);
  }
}

template <typename T, typename S>
void ssd_task(const SSDProblem& p, const SSDTensors<T, S>& io, int64_t b, int64_t h, int64_t p0,
              int64_t nrows, std::vector<float>& scratch) {
  if (p.qsl[b + 1] - p.qsl[b] == 1) {
    ssd_task_one(p, io, b, h, p0, nrows, scratch);
  } else if (p.qsl[b + 1] > p.qsl[b]) {
    ssd_task_seq(p, io, b, h, p0, nrows, scratch);
  } else if (p.slots[b] >= 0 && !p.has_init[b]) {
    ssd_task_seq(p, io, b, h, p0, nrows, scratch);  // empty and fresh: a zero state
  }
}

template <typename T, typename S>
void ssd_run(const SSDProblem& p, const SSDTensors<T, S>& io) {
  const int64_t blocks = (p.head_dim + kRows - 1) / kRows;
  const int64_t per_seq = p.heads * blocks;
  // One-token tasks (decode) are tiny: group them so a thread gets at least ~16K state entries.
  const bool all_decode = p.qsl[p.batch] == p.batch;
  const int64_t grain = all_decode ? std::max<int64_t>(1, 16384 / (kRows * p.nstate)) : 1;
  at::parallel_for(0, p.batch * per_seq, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / per_seq;
      const int64_t h = (i % per_seq) / blocks;
      const int64_t p0 = (i % blocks) * kRows;
      ssd_task(p, io, b, h, p0, std::min(kRows, p.head_dim - p0), scratch);
    }
  });
}

// A (T, ...) tensor whose last `inner` dims are contiguous (row stride free), else a copy.
at::Tensor rows_contiguous(const at::Tensor& t, at::ScalarType dtype) {
  at::Tensor r = t.to(dtype);
  int64_t expected = 1;
  for (int64_t d = r.dim() - 1; d >= 1; --d) {
    if (r.size(d) != 1 && r.stride(d) != expected) return r.contiguous();
    expected *= r.size(d);
  }
  return r;
}

struct SSDArgs {
  at::Tensor x, dt, A, B, C, D, dt_bias, slots;
};

SSDArgs check_args(const at::Tensor& x_in, const at::Tensor& dt_in, const at::Tensor& A,
                   const at::Tensor& B_, const at::Tensor& C,
                   const std::optional<at::Tensor>& D_skip,
                   const std::optional<at::Tensor>& dt_bias, const at::Tensor& ssm_states,
                   const at::Tensor& state_indices) {
  TORCH_CHECK(x_in.dim() == 3, "x must be (T, H, P)");
  const int64_t tokens = x_in.size(0), heads = x_in.size(1), head_dim = x_in.size(2);
  TORCH_CHECK(dt_in.dim() == 2 && dt_in.size(0) == tokens && dt_in.size(1) == heads,
              "dt must be (T, H)");
  TORCH_CHECK(A.numel() == heads, "A must be (H,)");
  TORCH_CHECK(B_.dim() == 3 && B_.size(0) == tokens, "B must be (T, G, N)");
  TORCH_CHECK(C.sizes() == B_.sizes(), "C must be (T, G, N) like B");
  const int64_t groups = B_.size(1);
  TORCH_CHECK(groups > 0 && heads % groups == 0, "H must be a multiple of G");
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.size(1) == heads &&
                  ssm_states.size(2) == head_dim && ssm_states.size(3) == B_.size(2),
              "ssm_states must be (S, H, P, N)");
  TORCH_CHECK(ssm_states.is_contiguous(), "ssm_states must be contiguous");
  const at::Tensor x = rows_contiguous(x_in, x_in.scalar_type());
  return SSDArgs{x,
                 rows_contiguous(dt_in, x.scalar_type()),
                 A.to(at::kFloat).contiguous(),
                 rows_contiguous(B_, at::kFloat),
                 rows_contiguous(C, at::kFloat),
                 optional_f32(D_skip),
                 optional_f32(dt_bias),
                 as_index(state_indices)};
}

// `qsl` (B + 1,) and `has_init` (B,) are host arrays that outlive the call.
at::Tensor ssd_impl(const SSDArgs& a, bool dt_softplus, double dt_min, double dt_max,
                    at::Tensor& ssm_states, const int64_t* qsl, const bool* has_init) {
  const int64_t batch = a.slots.size(0);
  TORCH_CHECK(qsl[batch] == a.x.size(0), "query_start_loc[-1] must equal T");
  TORCH_CHECK(a.C.stride(0) == a.B.stride(0), "B and C must share a layout");
  at::Tensor out = at::empty(a.x.sizes(), a.x.options());
  const bool clamp = dt_min > 0.0 || dt_max != std::numeric_limits<double>::infinity();
  const SSDProblem p{a.x.size(1), a.x.size(2), a.B.size(1), a.B.size(2), batch,
                     a.x.stride(0), a.dt.stride(0), a.B.stride(0), qsl,
                     a.slots.data_ptr<int64_t>(), has_init, a.A.data_ptr<float>(),
                     a.B.data_ptr<float>(), a.C.data_ptr<float>(),
                     a.D.defined() ? a.D.data_ptr<float>() : nullptr,
                     a.dt_bias.defined() ? a.dt_bias.data_ptr<float>() : nullptr, dt_softplus,
                     clamp, static_cast<float>(dt_min), static_cast<float>(dt_max)};
  if (batch == 0) return out;
  dispatch_float_bf16(a.x, "x", [&](auto* xt) {
    using T = std::remove_pointer_t<decltype(xt)>;
    dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      const SSDTensors<T, S> io{a.x.data_ptr<T>(), a.dt.data_ptr<T>(), ssm_states.data_ptr<S>(),
                                out.data_ptr<T>()};
      ssd_run(p, io);
    });
  });
  return out;
}

at::Tensor ssd_chunk_scan_varlen(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                 const at::Tensor& B_, const at::Tensor& C,
                                 const std::optional<at::Tensor>& D_skip,
                                 const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                                 double dt_min, double dt_max, at::Tensor ssm_states,
                                 const at::Tensor& query_start_loc,
                                 const at::Tensor& state_indices,
                                 const at::Tensor& has_initial_state, int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0, "chunk_size must be positive");
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  const SSDArgs a = check_args(x, dt, A, B_, C, D_skip, dt_bias, ssm_states, state_indices);
  const at::Tensor qsl = as_index(query_start_loc);
  const at::Tensor has_init = has_initial_state.to(at::kBool).contiguous();
  return ssd_impl(a, dt_softplus, dt_min, dt_max, ssm_states, qsl.data_ptr<int64_t>(),
                  has_init.data_ptr<bool>());
}

// Decode: each row is a one-token sequence that starts from its slot's state; like the
// reference (and transformers), the one-token step does not clamp dt.
at::Tensor ssd_state_update(at::Tensor ssm_states, const at::Tensor& x, const at::Tensor& dt,
                            const at::Tensor& A, const at::Tensor& B_, const at::Tensor& C,
                            const std::optional<at::Tensor>& D_skip,
                            const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                            const at::Tensor& state_indices) {
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == batch, "x must be (B, H, P)");
  const SSDArgs a = check_args(x, dt, A, B_, C, D_skip, dt_bias, ssm_states, state_indices);
  std::vector<int64_t> qsl(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) qsl[b] = b;
  const std::unique_ptr<bool[]> has_init(new bool[std::max<int64_t>(batch, 1)]);
  std::fill(has_init.get(), has_init.get() + batch, true);
  return ssd_impl(a, dt_softplus, 0.0, std::numeric_limits<double>::infinity(), ssm_states,
                  qsl.data(), has_init.get());
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("ssd_chunk_scan_varlen", &ssd_chunk_scan_varlen);
  m.impl("ssd_state_update", &ssd_state_update);
}

}  // namespace vllm_mamba
