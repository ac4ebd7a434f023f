// Mamba's selective scan over a packed varlen batch (token-major `(T, D)`), and its one-token
// state update, on the CPU. Shapes and semantics follow `vllm_mamba/ops/selective_scan.py`:
// per token h = exp(dt * A) * h + (dt * B) * u, y = h @ C + D * u, out = y * silu(z), with the
// state `(S, D, N)` of each sequence's slot read where it has an initial state and overwritten
// at the end; a slot index of -1 marks a padding row whose slot is never read nor written.
//
// One task per (sequence, block of kBlock channels), all in parallel. The task keeps its state
// transposed as (N, kBlock) float32 so that every step is a loop over contiguous channels;
// one-token sequences (decode) skip the transposition and vectorise over N instead.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernel_math.h"
#include "vec.h"

#ifdef VLLM_MAMBA_VEC_AVX512
#include <immintrin.h>
#endif

namespace vllm_mamba {
namespace {

struct ScanProblem {
  int64_t dim, nstate, batch;
  const int64_t* qsl;     // (B + 1,)
  const int64_t* slots;   // (B,)
  const bool* has_init;   // (B,)
  const float* A;         // (D, N)
  const float* B;         // (T, N)
  const float* C;         // (T, N)
  const float* D_skip;    // (D,) or nullptr
  const float* dt_bias;   // (D,) or nullptr
  bool dt_softplus;
};

template <typename T, typename S>
struct ScanTensors {
  const T* u;
  const T* dt;
  const T* z;  // nullptr without a gate
  S* states;
  T* out;
};

// Loads (or zeroes) the transposed state h (N, kBlock) and A (N, kBlock) of one block.
template <typename S>
void load_block(const ScanProblem& p, const S* states, int64_t b, int64_t d0, int64_t nd,
                float* h, float* a_t) {
  const int64_t slot = p.slots[b];
  const bool from_state = slot >= 0 && p.has_init[b];
  for (int64_t j = 0; j < kBlock; ++j) {
    for (int64_t n = 0; n < p.nstate; ++n) {
      const bool live = j < nd;
      a_t[n * kBlock + j] = live ? p.A[(d0 + j) * p.nstate + n] : 0.0f;
      h[n * kBlock + j] =
          live && from_state ? to_f32(states[(slot * p.dim + d0 + j) * p.nstate + n]) : 0.0f;
    }
  }
}

// Time steps (bias, softplus) and inputs of token t for channels [d0, d0 + nd), zero-padded
// to kBlock lanes.
template <typename T, typename S>
void token_inputs(const ScanProblem& p, const ScanTensors<T, S>& io, int64_t t, int64_t d0,
                  int64_t nd, float* delta, float* ut) {
  const T* dt_row = io.dt + t * p.dim + d0;
  const T* u_row = io.u + t * p.dim + d0;
  for (int64_t j = 0; j < nd; ++j) {
    delta[j] = to_f32(dt_row[j]) + (p.dt_bias ? p.dt_bias[d0 + j] : 0.0f);
    ut[j] = to_f32(u_row[j]);
  }
  if (p.dt_softplus) {
    // Padding lanes get softplus(0) > 0, harmless: their u and A are 0, so h stays 0.
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) delta[j] = softplus_f32(delta[j]);
  }
}

// out = (y + D * u) * silu(z) for token t, channels [d0, d0 + nd).
template <typename T, typename S>
void token_outputs(const ScanProblem& p, const ScanTensors<T, S>& io, int64_t t, int64_t d0,
                   int64_t nd, const float* y, const float* ut) {
  const T* z_row = io.z ? io.z + t * p.dim + d0 : nullptr;
  T* o = io.out + t * p.dim + d0;
  float v[kBlock], zf[kBlock];
  for (int64_t j = 0; j < nd; ++j) {
    v[j] = p.D_skip ? y[j] + ut[j] * p.D_skip[d0 + j] : y[j];
    zf[j] = z_row ? to_f32(z_row[j]) : 0.0f;
  }
  if (z_row) {
#pragma omp simd
    for (int64_t j = 0; j < nd; ++j) v[j] *= silu_f32(zf[j]);
  }
  for (int64_t j = 0; j < nd; ++j) o[j] = static_cast<T>(v[j]);
}

// One token for a block: advances the transposed h (N, kBlock) and writes the outputs.
template <typename T, typename S>
void scan_token(const ScanProblem& p, const ScanTensors<T, S>& io, int64_t t, int64_t d0,
                int64_t nd, float* h, const float* a_t) {
  float delta[kBlock] = {};
  float ut[kBlock] = {};
  float y[kBlock] = {};
  token_inputs(p, io, t, d0, nd, delta, ut);
  const float* b_row = p.B + t * p.nstate;
  const float* c_row = p.C + t * p.nstate;
  for (int64_t n = 0; n < p.nstate; ++n) {
    float* hn = h + n * kBlock;
    const float* an = a_t + n * kBlock;
    const float bn = b_row[n];
    const float cn = c_row[n];
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) {
      hn[j] = exp_f32(delta[j] * an[j]) * hn[j] + (delta[j] * bn) * ut[j];
      y[j] += hn[j] * cn;
    }
  }
  token_outputs(p, io, t, d0, nd, y, ut);
}

// h over the N entries of one channel, in place in the slot when it has one; returns h @ C.
template <typename S, bool kRead, bool kWrite>
float step_channel(const float* a, const float* b_row, const float* c_row, int64_t nstate,
                   float delta, float u, S* st) {
  float y = 0.0f;
#pragma omp simd reduction(+ : y)
  for (int64_t n = 0; n < nstate; ++n) {
    const float prev = kRead ? to_f32(st[n]) : 0.0f;
    const float h = exp_f32(delta * a[n]) * prev + (delta * b_row[n]) * u;
    y += h * c_row[n];
    if (kWrite) st[n] = static_cast<S>(h);
  }
  return y;
}

#ifdef VLLM_MAMBA_VEC_AVX512
// sum(rows[c]) for 16 rows of 16 floats, as one vector (lane c): a transpose-and-add tree,
// 15 shuffles and 15 adds instead of 16 horizontal reductions.
inline __m512 sum_rows16(const float* rows) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i) {  // quarters 0-1: row 2i, 2-3: row 2i + 1
    const __m512 a = _mm512_loadu_ps(rows + 32 * i), b = _mm512_loadu_ps(rows + 32 * i + 16);
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // quarter j: row 4k + j
    const __m512 a = s[2 * k], b = s[2 * k + 1];
    t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int m = 0; m < 2; ++m) {  // quarter j: rows 8m + j, 8m + 4 + j, each in two lanes
    const __m512 a = t[2 * m], b = t[2 * m + 1];
    u[m] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  // Lane 4j + e: row 4e + j.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}
#endif

// h over the 16 entries of one channel, in place in the slot when it has one; `prod` gets
// h * C (summed later by `sum_rows16`).
template <typename S, bool kRead, bool kWrite>
void step_channel16(const float* a, const float* b_row, const float* c_row, float delta,
                    float u, S* st, float* prod) {
#pragma omp simd
  for (int64_t n = 0; n < 16; ++n) {
    const float prev = kRead ? to_f32(st[n]) : 0.0f;
    const float h = exp_f32(delta * a[n]) * prev + (delta * b_row[n]) * u;
    prod[n] = h * c_row[n];
    if (kWrite) st[n] = static_cast<S>(h);
  }
}

// A one-token sequence (decode): the state stays in its (D, N) layout, vectorised over N.
template <typename T, typename S>
void scan_one_token(const ScanProblem& p, const ScanTensors<T, S>& io, int64_t b, int64_t d0,
                    int64_t nd) {
  const int64_t t = p.qsl[b];
  const int64_t slot = p.slots[b];
  const bool from_state = slot >= 0 && p.has_init[b];
  float delta[kBlock] = {};
  float ut[kBlock] = {};
  float y[kBlock];
  token_inputs(p, io, t, d0, nd, delta, ut);
  const float* b_row = p.B + t * p.nstate;
  const float* c_row = p.C + t * p.nstate;
  int64_t j = 0;
#ifdef VLLM_MAMBA_VEC_AVX512
  if (p.nstate == 16) {  // Mamba's and FalconMamba's state size
    alignas(64) float prod[16 * 16];
    for (; j + 16 <= nd; j += 16) {
      for (int64_t i = 0; i < 16; ++i) {
        const float* a = p.A + (d0 + j + i) * 16;
        S* st = slot >= 0 ? io.states + (slot * p.dim + d0 + j + i) * 16 : nullptr;
        const float dl = delta[j + i], uu = ut[j + i];
        if (from_state) {
          step_channel16<S, true, true>(a, b_row, c_row, dl, uu, st, prod + 16 * i);
        } else if (st) {
          step_channel16<S, false, true>(a, b_row, c_row, dl, uu, st, prod + 16 * i);
        } else {
          step_channel16<S, false, false>(a, b_row, c_row, dl, uu, st, prod + 16 * i);
        }
      }
      _mm512_storeu_ps(y + j, sum_rows16(prod));
    }
  }
#endif
  for (; j < nd; ++j) {
    const float* a = p.A + (d0 + j) * p.nstate;
    S* st = slot >= 0 ? io.states + (slot * p.dim + d0 + j) * p.nstate : nullptr;
    if (from_state) {
      y[j] = step_channel<S, true, true>(a, b_row, c_row, p.nstate, delta[j], ut[j], st);
    } else if (st) {
      y[j] = step_channel<S, false, true>(a, b_row, c_row, p.nstate, delta[j], ut[j], st);
    } else {
      y[j] = step_channel<S, false, false>(a, b_row, c_row, p.nstate, delta[j], ut[j], st);
    }
  }
  token_outputs(p, io, t, d0, nd, y, ut);
}

template <typename T, typename S>
void scan_block(const ScanProblem& p, const ScanTensors<T, S>& io, int64_t b, int64_t d0) {
  const int64_t nd = std::min(kBlock, p.dim - d0);
  if (p.qsl[b + 1] - p.qsl[b] == 1) {
    scan_one_token(p, io, b, d0, nd);
    return;
  }
  std::vector<float> buf(2 * p.nstate * kBlock);
  float* h = buf.data();                       // (N, kBlock)
  float* a_t = buf.data() + p.nstate * kBlock;  // (N, kBlock)
  load_block(p, io.states, b, d0, nd, h, a_t);
  for (int64_t t = p.qsl[b]; t < p.qsl[b + 1]; ++t) scan_token(p, io, t, d0, nd, h, a_t);
  const int64_t slot = p.slots[b];
  if (slot < 0) return;
  for (int64_t j = 0; j < nd; ++j) {
    S* st = io.states + (slot * p.dim + d0 + j) * p.nstate;
    for (int64_t n = 0; n < p.nstate; ++n) st[n] = static_cast<S>(h[n * kBlock + j]);
  }
}

template <typename T, typename S>
void scan_run(const ScanProblem& p, const ScanTensors<T, S>& io) {
  const int64_t blocks = (p.dim + kBlock - 1) / kBlock;
  // A task is a (sequence, channel block); one-token tasks are tiny, so group them.
  const bool all_decode = p.qsl[p.batch] == p.batch;
  const int64_t grain = all_decode ? std::max<int64_t>(1, 8192 / (kBlock * p.nstate)) : 1;
  at::parallel_for(0, p.batch * blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) scan_block(p, io, i / blocks, (i % blocks) * kBlock);
  });
}

// `qsl` (B + 1,) and `has_init` (B,) are host arrays that outlive the call.
at::Tensor scan_impl(const at::Tensor& u_in, const at::Tensor& dt_in, const at::Tensor& A,
                     const at::Tensor& B_, const at::Tensor& C,
                     const std::optional<at::Tensor>& D_skip, const std::optional<at::Tensor>& z_in,
                     const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                     at::Tensor& ssm_states, const int64_t* qsl, const at::Tensor& state_indices,
                     const bool* has_init) {
  TORCH_CHECK(u_in.dim() == 2, "u must be (T, D)");
  const int64_t tokens = u_in.size(0);
  const int64_t dim = u_in.size(1);
  TORCH_CHECK(A.dim() == 2 && A.size(0) == dim, "A must be (D, N)");
  const int64_t nstate = A.size(1);
  TORCH_CHECK(dt_in.sizes() == u_in.sizes(), "dt must be (T, D)");
  TORCH_CHECK(B_.dim() == 2 && B_.size(0) == tokens && B_.size(1) == nstate, "B must be (T, N)");
  TORCH_CHECK(C.sizes() == B_.sizes(), "C must be (T, N)");
  TORCH_CHECK(ssm_states.dim() == 3 && ssm_states.size(1) == dim && ssm_states.size(2) == nstate,
              "ssm_states must be (S, D, N)");
  TORCH_CHECK(ssm_states.is_contiguous(), "ssm_states must be contiguous");
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(qsl[batch] == tokens, "query_start_loc[-1] must equal T");
  const at::Tensor u = u_in.contiguous();
  const at::Tensor dt = dt_in.to(u.scalar_type()).contiguous();
  at::Tensor z;
  if (z_in.has_value()) {
    TORCH_CHECK(z_in->sizes() == u.sizes(), "z must be (T, D)");
    z = z_in->to(u.scalar_type()).contiguous();
  }
  const at::Tensor A_f = A.to(at::kFloat).contiguous();
  const at::Tensor B_f = B_.to(at::kFloat).contiguous();
  const at::Tensor C_f = C.to(at::kFloat).contiguous();
  const at::Tensor D_f = optional_f32(D_skip);
  const at::Tensor dt_bias_f = optional_f32(dt_bias);
  const at::Tensor slots = as_index(state_indices);
  at::Tensor out = at::empty_like(u);

  const ScanProblem p{dim,
                      nstate,
                      batch,
                      qsl,
                      slots.data_ptr<int64_t>(),
                      has_init,
                      A_f.data_ptr<float>(),
                      B_f.data_ptr<float>(),
                      C_f.data_ptr<float>(),
                      D_f.defined() ? D_f.data_ptr<float>() : nullptr,
                      dt_bias_f.defined() ? dt_bias_f.data_ptr<float>() : nullptr,
                      dt_softplus};
  dispatch_float_bf16(u, "u", [&](auto* ut) {
    using T = std::remove_pointer_t<decltype(ut)>;
    dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* st) {
      using S = std::remove_pointer_t<decltype(st)>;
      const ScanTensors<T, S> io{u.data_ptr<T>(), dt.data_ptr<T>(),
                                 z.defined() ? z.data_ptr<T>() : nullptr,
                                 ssm_states.data_ptr<S>(), out.data_ptr<T>()};
      scan_run(p, io);
    });
  });
  return out;
}

at::Tensor selective_scan_varlen(const at::Tensor& u, const at::Tensor& dt, const at::Tensor& A,
                                 const at::Tensor& B_, const at::Tensor& C,
                                 const std::optional<at::Tensor>& D_skip,
                                 const std::optional<at::Tensor>& z,
                                 const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                                 at::Tensor ssm_states, const at::Tensor& query_start_loc,
                                 const at::Tensor& state_indices,
                                 const at::Tensor& has_initial_state) {
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  const at::Tensor qsl = as_index(query_start_loc);
  const at::Tensor has_init = has_initial_state.to(at::kBool).contiguous();
  return scan_impl(u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus, ssm_states,
                   qsl.data_ptr<int64_t>(), state_indices, has_init.data_ptr<bool>());
}

// Decode: each row is a one-token sequence that starts from its slot's state.
at::Tensor selective_state_update(at::Tensor ssm_states, const at::Tensor& u,
                                  const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B_,
                                  const at::Tensor& C, const std::optional<at::Tensor>& D_skip,
                                  const std::optional<at::Tensor>& z,
                                  const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                                  const at::Tensor& state_indices) {
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(u.dim() == 2 && u.size(0) == batch, "u must be (B, D)");
  std::vector<int64_t> qsl(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) qsl[b] = b;
  const std::unique_ptr<bool[]> has_init(new bool[std::max<int64_t>(batch, 1)]);
  std::fill(has_init.get(), has_init.get() + batch, true);
  return scan_impl(u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus, ssm_states, qsl.data(),
                   state_indices, has_init.get());
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("selective_scan_varlen", &selective_scan_varlen);
  m.impl("selective_state_update", &selective_state_update);
}

}  // namespace vllm_mamba
