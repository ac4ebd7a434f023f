// One Gated DeltaNet (GDN) layer's decode step for a few sequences in one call
// (`fused_gdn_decode`): block RMSNorm (optional) -> the input projections, whose concatenated
// outputs are [q | k | v | z | b | a] -> causal conv + SiLU over q, k and v -> the gated delta
// rule per value head (L2 norms, gates, the state update and read-out) -> the per-head gated
// RMSNorm with silu(z) -> out_proj (+ the residual when the block norm is given).
//
// Semantics are those of the unfused path (`vllm_mamba/layers/gated_deltanet.py`) with the ops
// `causal_conv1d_update`, `gated_delta_update` and `rms_norm_gated`
// (`vllm_mamba/ops/gated_delta.py` has the math): per value head h, reading key head
// h / (Hv / Hk), with q and k L2-normalised (eps 1e-6) and q scaled by Dk^-1/2,
//   g = -exp(A_log) softplus(a + dt_bias), beta = beta_scale sigmoid(b),
//   S = exp(g) S + k (beta (v - exp(g) S^T k))^T, o = S^T q,
// computed as the `gated_delta_update` kernel does: one read pass over the state for S^T k and
// S^T q, o = exp(g) S^T q + (k . q) delta, one read-write pass for the update. A slot index of
// -1 marks a padding row: its history and state are neither read nor written and its delta
// rule output is zero (as the reference's). All intermediates stay float32 (the unfused path
// rounds them to the model dtype between ops; in float32 the two agree to rounding).
//
// Speculative chains (`src_state_indices`): row b reads the state of slot src[b] and writes
// slot dst[b], the rows in order, so a chain's positions run in one call, each streaming the
// weights once for all rows (each row's products summed exactly as a one-row call sums them:
// `gemv::dot_tile`).
// The recurrent state is read from src and written to dst in the same pass; the conv history
// (K - 1 values per channel) is read from src and written shifted to dst.
// With a `chain_log` the chains' recurrent states are logged instead (`chain_head`): a chain
// keeps its state in a thread's scratch from position to position and writes no position's
// state: the sequence's slot keeps the start state, the chain's first spare slot gets a copy of
// it, and each position leaves its record (normalised k, delta, decay: Dk + Dv + 1 floats a
// head) in the chain log at its row's slot. `gdn_chain_replay` then brings the state to the
// kept position (in place in the sequence's slot, or from the spare copy), bit for bit. A
// chain of 5 positions so moves its 1 MiB state (Qwen3.5: 16 heads of 128 x 128) twice (read,
// copied with non-temporal stores), and the replay twice more, where writing every position
// would move it eleven times.
//
// Up to `kGemvMaxBatch` rows, or a chain of any length, one OpenMP region per call: the rows of
// all input projections (one range over their concatenated outputs, with the conv fused per
// channel), then the value heads (with the gated norm), then the out_proj rows are split over
// the threads, with a barrier between the stages. More rows without chains run the projections
// as GEMMs (`fused::project`) between parallel stages.
//
// Glossary: B batch rows, H hidden, Hk / Hv key / value heads of Dk / Dv, KD = Hk Dk,
// VD = Hv Dv, CD = 2 KD + VD conv channels, K conv width, NIN = CD + VD + 2 Hv projected
// values per row, S state slots.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "fused_decode.h"
#include "fused_decode_delta.h"
#include "kernel_math.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

using fused::gemv;
using fused::split;
using fused::Weight;

// Index of each entry of the `params` list (`vllm_mamba/ops/gated_delta.py`:
// GDN_DECODE_PARAMS), then one (weight, scale) pair per input projection, in the order of
// their outputs ([q | k | v | z | b | a] concatenated).
enum Param : size_t { kNormW, kConvW, kALog, kDtBias, kGateW, kOutW, kOutScale, kFirstIn };

using delta::Dims;

struct Small {  // float32 parameters; nullptr when absent
  const float *norm_w, *conv_w, *A_log, *dt_bias, *gate_w;
  float norm_eps, gate_eps, beta_scale;
};

// C: the conv states' dtype; S: the recurrent states' (each float32 or bfloat16).
template <typename C, typename S>
struct Io {
  const Weight* in_w;     // n_in input projections
  const int64_t* in_off;  // (n_in + 1,) first output of each in the concatenation
  int64_t n_in;
  const Weight* out_w;
  C* conv_states;            // (S, CD, K - 1)
  S* ssm_states;             // (S, Hv, Dk, Dv)
  const int64_t* slots;      // (B,) where row b writes its state
  const int64_t* src_slots;  // where row b's state is read from (nullptr: `slots`)
  const float* hidden;       // (B, H)
  float *xn, *proj, *y, *mixed;  // (B, H), (B, NIN), (B, VD), (B, H) scratch
  float* log;                // (S, Hv, Dk + Dv + 1) chain records (nullptr: states written)
  const std::vector<std::vector<int64_t>>* chains;  // with `log`: each chain's rows in order
};

// A state row as float32 for reading: the row itself, or a bfloat16 row widened into `buf`.
inline const float* read_row(const float* row, float*, int64_t) { return row; }
inline const float* read_row(const c10::BFloat16* row, float* buf, int64_t n) {
  const vec::bf16_t* p = fused::raw(row);
  int64_t i = 0;
  for (; i + vec::kLanes <= n; i += vec::kLanes) vec::store(buf + i, vec::load(p + i));
  for (; i < n; ++i) buf[i] = vec::bf16_to_f32(p[i].bits);
  return buf;
}

// Where a new state row is computed: the float32 row itself, or `buf` for a bfloat16 row
// (then rounded into it by `fused::store_state`).
inline float* write_row(float* row, float*) { return row; }
inline float* write_row(c10::BFloat16*, float* buf) { return buf; }

// The inputs of value head h of batch row b's delta rule: its L2-normalised k and q (into
// w.kn, w.qn), its v, decay exp(g) and beta.
struct HeadIn {
  const float* v;
  float decay, beta;
};

// Scratch of one thread for `delta_head` and `chain_head`.
struct HeadScratch {
  std::vector<float> buf;
  float *kn, *qn, *kv, *qs, *in_row, *out_row;
  // chain_head's (allocated on first use): a column block of the state (Dk x kChainCols), the
  // rounding row (Dv), and per position its normalised k and q (Dk each), its delta (Dv), its
  // k . q and its inputs.
  std::vector<float> block, pos_kn, pos_qn, pos_kv, pos_kq;
  std::vector<HeadIn> pos_in;
  std::vector<vec::bf16_t> tmp;
  HeadScratch(int64_t dk, int64_t dv) : buf(2 * dk + 4 * dv) {
    kn = buf.data();
    qn = kn + dk;
    kv = qn + dk;
    qs = kv + dv;
    in_row = qs + dv;
    out_row = in_row + dv;
  }
};

template <typename C, typename S>
HeadIn head_inputs(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t h,
                   HeadScratch& w) {
  const float* row = io.proj + b * d.nin;
  const int64_t kh = h / (d.v_heads / d.k_heads);
  delta::l2norm(row + d.key_dim + kh * d.dk, d.dk, 1.0f, w.kn);
  delta::l2norm(row + kh * d.dk, d.dk, 1.0f / std::sqrt(static_cast<float>(d.dk)), w.qn);
  const float bv = row[d.conv_dim + d.value_dim + h];
  const float av = row[d.conv_dim + d.value_dim + d.v_heads + h];
  const float g = -std::exp(s.A_log[h]) * softplus_f32(av + s.dt_bias[h]);
  return {row + 2 * d.key_dim + h * d.dv, std::exp(g), s.beta_scale / (1.0f + std::exp(-bv))};
}

// The paths that advance a state (one row, a chain, a chain's replay) call the same compiled
// bodies for the rule's arithmetic (not inlined, so that no calling context changes how they
// are vectorised or contracted): the paths agree bit for bit.
#define VLLM_MAMBA_NOINLINE __attribute__((noinline))

// A state's rows as `vec.h` loads them.
inline const float* vec_rows(const float* p) { return p; }
inline const vec::bf16_t* vec_rows(const c10::BFloat16* p) { return fused::raw(p); }

// The read pass over Dv columns of a Dk-row state (rows `stride` apart, float32 or bfloat16):
// kv = S^T k, qs = S^T q, each column summed over the rows in order with fused multiply-adds
// (so a column's sums do not depend on which columns are read with it); kColVecs vectors of
// columns stay in registers over all the rows.
constexpr int kColVecs = 4;
constexpr int64_t kChainCols = kColVecs * vec::kLanes;  // a chain's column block
template <typename T>
VLLM_MAMBA_NOINLINE void read_pass(const T* st, int64_t dk, int64_t dv, int64_t stride,
                                   const float* kn, const float* qn, float* kv, float* qs) {
  constexpr int L = vec::kLanes;
  int64_t j0 = 0;
  for (; j0 + kColVecs * L <= dv; j0 += kColVecs * L) {
    vec::Vf ak[kColVecs], aq[kColVecs];
    for (int u = 0; u < kColVecs; ++u) ak[u] = aq[u] = vec::zero();
    for (int64_t i = 0; i < dk; ++i) {
      const vec::Vf k = vec::set1(kn[i]), q = vec::set1(qn[i]);
      const T* r = st + i * stride + j0;
      for (int u = 0; u < kColVecs; ++u) {
        const vec::Vf x = vec::load(r + u * L);
        ak[u] = vec::fma(x, k, ak[u]);
        aq[u] = vec::fma(x, q, aq[u]);
      }
    }
    for (int u = 0; u < kColVecs; ++u) {
      vec::store(kv + j0 + u * L, ak[u]);
      vec::store(qs + j0 + u * L, aq[u]);
    }
  }
  for (; j0 < dv; j0 += L) {  // the last columns, a vector (or part of one) at a time
    const int n = static_cast<int>(std::min<int64_t>(L, dv - j0));
    vec::Vf ak = vec::zero(), aq = vec::zero();
    for (int64_t i = 0; i < dk; ++i) {
      const vec::Vf x = vec::load_n(st + i * stride + j0, n);
      ak = vec::fma(x, vec::set1(kn[i]), ak);
      aq = vec::fma(x, vec::set1(qn[i]), aq);
    }
    vec::store_n(kv + j0, ak, n);
    vec::store_n(qs + j0, aq, n);
  }
}

// k . q of a value head's normalised k and q (the read-out's (k . q) delta term).
VLLM_MAMBA_NOINLINE float dot_kq(const float* kn, const float* qn, int64_t dk) {
  float kq = 0.0f;
#pragma omp simd reduction(+ : kq)
  for (int64_t i = 0; i < dk; ++i) kq += kn[i] * qn[i];
  return kq;
}

// After the read pass, for n columns: the rule's delta = beta (v - decay S^T k) (into kv, which
// held S^T k) and the read-out o = decay S^T q + (k . q) delta, each column on its own (the
// expressions of `gated_delta_update`'s kernel, so that the unfused path agrees).
VLLM_MAMBA_NOINLINE void finish_read(const HeadIn& in, float kq, const float* v, float* kv,
                                     const float* qs, float* o, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float delta = in.beta * (v[j] - in.decay * kv[j]);
    kv[j] = delta;
    o[j] = in.decay * qs[j] + kq * delta;
  }
}

// One state row's update: nr = ki delta + decay sr, one multiply and one fused multiply-add a
// value (`sr` and `nr` may be the same row).
VLLM_MAMBA_NOINLINE void update_row(const float* sr, float decay, float ki, const float* delta,
                                    float* nr, int64_t n) {
  constexpr int L = vec::kLanes;
  const vec::Vf dv = vec::set1(decay), kv = vec::set1(ki);
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    vec::store(nr + j, vec::fma(kv, vec::load(delta + j), vec::mul(dv, vec::load(sr + j))));
  }
  if (j < n) {
    const int m = static_cast<int>(n - j);
    const vec::Vf old = vec::mul(dv, vec::load_n(sr + j, m));
    vec::store_n(nr + j, vec::fma(kv, vec::load_n(delta + j, m), old), m);
  }
}

// A float32 row rounded as the state dtype S stores it (bfloat16: to nearest even and back).
inline void round_row(const float*, float*, vec::bf16_t*, int64_t) {}
inline void round_row(const c10::BFloat16*, float* row, vec::bf16_t* tmp, int64_t n) {
  gemv::store_state(row, tmp, n);
  gemv::load_state(tmp, row, n);
}

// A column block's update over all its Dk rows (each `m` wide): row i = kn[i] delta + decay row i,
// the arithmetic of `update_row`, each row then rounded as S stores it (`round_row`); a full
// block (kChainCols columns) keeps delta in registers.
template <typename S>
VLLM_MAMBA_NOINLINE void update_block(float* blk, int64_t dk, int64_t m, float decay,
                                      const float* kn, const float* delta, vec::bf16_t* tmp) {
  constexpr int L = vec::kLanes;
  const S* tag = nullptr;
  if (m != kChainCols) {
    for (int64_t i = 0; i < dk; ++i) {
      update_row(blk + i * m, decay, kn[i], delta, blk + i * m, m);
      round_row(tag, blk + i * m, tmp, m);
    }
    return;
  }
  const vec::Vf vd = vec::set1(decay);
  vec::Vf dl[kColVecs];
  for (int u = 0; u < kColVecs; ++u) dl[u] = vec::load(delta + u * L);
  for (int64_t i = 0; i < dk; ++i) {
    float* r = blk + i * kChainCols;
    const vec::Vf k = vec::set1(kn[i]);
    for (int u = 0; u < kColVecs; ++u) {
      vec::store(r + u * L, vec::fma(k, dl[u], vec::mul(vd, vec::load(r + u * L))));
    }
    round_row(tag, r, tmp, kChainCols);
  }
}

// n state values copied out as float32, and n float32 values stored as the state dtype
// (bfloat16: rounded to nearest even).
inline void get_rows(const float* st, float* x, int64_t n) { std::copy(st, st + n, x); }
inline void get_rows(const c10::BFloat16* st, float* x, int64_t n) { read_row(st, x, n); }
inline void put_rows(const float* x, float* st, int64_t n) { std::copy(x, x + n, st); }
inline void put_rows(const float* x, c10::BFloat16* st, int64_t n) { fused::store_state(x, st, n); }

// The per-head gated RMSNorm of a value head's read-out: o = gate_w * rmsnorm(o) * silu(z).
VLLM_MAMBA_NOINLINE void gate_out(const Small& s, const float* z, float* o, int64_t dv) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(dv) + s.gate_eps);
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) o[j] = s.gate_w[j] * (o[j] * r) * silu_f32(z[j]);
}

// `gate_out` of value head h of batch row b.
template <typename C, typename S>
void gate_head(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t h, float* o) {
  gate_out(s, io.proj + b * d.nin + d.conv_dim + h * d.dv, o, d.dv);
}

// The gated delta rule of value head h of batch row b, then its gated RMSNorm:
// y[b, h] = gate_w * rmsnorm(o) * silu(z) with o the rule's read-out (zeros for a padding row).
template <typename C, typename S>
void delta_head(const Dims& d, const Small& s, const Io<C, S>& io, int64_t b, int64_t h,
                HeadScratch& w) {
  const int64_t dk = d.dk, dv = d.dv;
  float* o = io.y + b * d.value_dim + h * dv;
  const int64_t slot = io.slots[b];
  if (slot < 0) {
    std::fill(o, o + dv, 0.0f);
  } else {
    const HeadIn in = head_inputs(d, s, io, b, h, w);
    const int64_t src_slot = io.src_slots ? io.src_slots[b] : slot;
    const S* src = io.ssm_states + (src_slot * d.v_heads + h) * dk * dv;
    S* dst = io.ssm_states + (slot * d.v_heads + h) * dk * dv;
    read_pass(vec_rows(src), dk, dv, dv, w.kn, w.qn, w.kv, w.qs);
    finish_read(in, dot_kq(w.kn, w.qn, dk), in.v, w.kv, w.qs, o, dv);
    for (int64_t i = 0; i < dk; ++i) {
      const float* sr = read_row(src + i * dv, w.in_row, dv);
      float* nr = write_row(dst + i * dv, w.out_row);
      update_row(sr, in.decay, w.kn[i], w.kv, nr, dv);
      fused::store_state(nr, dst + i * dv, dv);
    }
  }
  gate_head(d, s, io, b, h, o);
}

// A state copy with non-temporal stores where the destination allows (x86 with AVX, 32-byte
// aligned, whole vectors): no read for ownership, so a copy moves its bytes once each way, and
// the copy does not evict what the caches hold. For the start state a chain leaves in its
// spare slot, which only a later rollback reads.
inline void stream_copy(const void* src, void* dst, size_t bytes) {
#if defined(__AVX__)
  if (reinterpret_cast<uintptr_t>(dst) % 32 == 0 && bytes % 32 == 0) {
    auto* d = static_cast<__m256i*>(dst);
    const auto* from = static_cast<const __m256i*>(src);
    for (size_t i = 0; i < bytes / 32; ++i) _mm256_stream_si256(d + i, _mm256_loadu_si256(from + i));
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Value head h of one speculative chain whose positions are the rows `rows` (n > 1, in order),
// logged instead of writing each position's state (`Io::log`). The chain's start state (its
// first row's source slot, the sequence's) is left as it is, and copied to the first row's own
// slot (the chain's first spare slot; `stream_copy`); no position's state is written. The
// state is advanced through every position a column block at a time (kChainCols columns of
// all Dk rows, float32 in w.block, each position's values rounded as S stores them: the rule
// reads and updates each column on its own, so a block stays in the core's first cache over
// all the positions). Every row's slot keeps its position's record: the normalised k (Dk), the
// delta (Dv) and the decay, all a replay needs (`gdn_chain_replay`) to bring the start state
// to any position bit for bit, in place in the sequence's slot or from the spare copy.
template <typename C, typename S>
void chain_head(const Dims& d, const Small& s, const Io<C, S>& io, const int64_t* rows, int64_t n,
                int64_t h, HeadScratch& w) {
  const int64_t dk = d.dk, dv = d.dv, size = dk * dv, rec = dk + dv + 1;
  const int64_t cols = std::min(kChainCols, dv);
  if (w.block.size() < static_cast<size_t>(dk * cols)) {
    w.block.resize(dk * cols);
    w.tmp.resize(dv);
  }
  if (w.pos_kv.size() < static_cast<size_t>(n * dv)) {
    w.pos_kn.resize(n * dk);
    w.pos_qn.resize(n * dk);
    w.pos_kv.resize(n * dv);
    w.pos_kq.resize(n);
    w.pos_in.resize(n);
  }
  HeadIn* in = w.pos_in.data();
  for (int64_t p = 0; p < n; ++p) {  // each position's inputs, from its own row
    in[p] = head_inputs(d, s, io, rows[p], h, w);
    w.pos_kq[p] = dot_kq(w.kn, w.qn, dk);
    std::copy(w.kn, w.kn + dk, w.pos_kn.data() + p * dk);
    std::copy(w.qn, w.qn + dk, w.pos_qn.data() + p * dk);
  }
  const S* start = io.ssm_states + (io.src_slots[rows[0]] * d.v_heads + h) * size;
  stream_copy(start, io.ssm_states + (io.slots[rows[0]] * d.v_heads + h) * size, size * sizeof(S));
  float* blk = w.block.data();
  for (int64_t j0 = 0; j0 < dv; j0 += cols) {  // columns [j0, j0 + m) over every position
    const int64_t m = std::min(cols, dv - j0);
    for (int64_t i = 0; i < dk; ++i) get_rows(start + i * dv + j0, blk + i * m, m);
    for (int64_t p = 0; p < n; ++p) {
      const float* kn = w.pos_kn.data() + p * dk;
      float* kv = w.pos_kv.data() + p * dv + j0;
      read_pass(blk, dk, m, m, kn, w.pos_qn.data() + p * dk, kv, w.qs);
      finish_read(in[p], w.pos_kq[p], in[p].v + j0, kv, w.qs,
                  io.y + rows[p] * d.value_dim + h * dv + j0, m);
      if (p + 1 < n) {  // (the state after the last position is not kept)
        update_block<S>(blk, dk, m, in[p].decay, kn, kv, w.tmp.data());
      }
    }
  }
  for (int64_t p = 0; p < n; ++p) {
    float* r = io.log + (io.slots[rows[p]] * d.v_heads + h) * rec;
    std::copy(w.pos_kn.data() + p * dk, w.pos_kn.data() + (p + 1) * dk, r);
    std::copy(w.pos_kv.data() + p * dv, w.pos_kv.data() + (p + 1) * dv, r + dk);
    r[dk + dv] = in[p].decay;
    gate_head(d, s, io, rows[p], h, io.y + rows[p] * d.value_dim + h * dv);
  }
}

template <typename C, typename S>
void run_layer(const Dims& d, const Small& s, const Io<C, S>& io) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = fused::thread_id(), nth = fused::num_threads();
    HeadScratch scratch(d.dk, d.dv);
    if (s.norm_w) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < d.batch; ++b) delta::norm_row(d, s.norm_w, s.norm_eps, io, b);
    }
    int64_t lo, hi;
    split(d.nin, fused::kRowBlock, tid, nth, lo, hi);
    delta::project_rows(d, io, lo, hi);
    const int64_t c1 = std::min(hi, d.conv_dim);
    for (int64_t b = 0; lo < c1 && b < d.batch; ++b) delta::conv_rows(d, s.conv_w, io, b, lo, c1);
#pragma omp barrier
    if (io.log) {  // logged chains: each head's chains on one thread, a chain's state kept
      split(d.v_heads, 1, tid, nth, lo, hi);
      for (int64_t h = lo; h < hi; ++h) {
        for (const std::vector<int64_t>& rows : *io.chains) {
          const int64_t n = static_cast<int64_t>(rows.size());
          if (n == 1) {
            delta_head(d, s, io, rows[0], h, scratch);
          } else {
            chain_head(d, s, io, rows.data(), n, h, scratch);
          }
        }
      }
    } else if (io.src_slots) {  // chains: each head's rows in order on one thread
      split(d.v_heads, 1, tid, nth, lo, hi);
      for (int64_t h = lo; h < hi; ++h) {
        for (int64_t b = 0; b < d.batch; ++b) delta_head(d, s, io, b, h, scratch);
      }
    } else {
      split(d.batch * d.v_heads, 1, tid, nth, lo, hi);
      for (int64_t t = lo; t < hi; ++t) delta_head(d, s, io, t / d.v_heads, t % d.v_heads, scratch);
    }
#pragma omp barrier
    split(d.hidden, fused::kRowBlock, tid, nth, lo, hi);
    gemv(*io.out_w, io.y, d.value_dim, d.batch, lo, hi, io.mixed + lo, d.hidden);
    for (int64_t b = 0; b < d.batch && s.norm_w; ++b) {
      float* m = io.mixed + b * d.hidden;
      const float* res = io.hidden + b * d.hidden;
      for (int64_t r = lo; r < hi; ++r) m[r] += res[r];
    }
  }
}

// The same layer for more rows than `kGemvMaxBatch` (no chains): the projections run as GEMMs
// (torch's, between the parallel stages) instead of weight-streaming products.
template <typename C, typename S>
void run_layer_gemm(const Dims& d, const Small& s, const Io<C, S>& io, const at::Tensor& xn,
                    at::Tensor& proj, const at::Tensor& y, at::Tensor& mixed) {
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) delta::norm_row(d, s.norm_w, s.norm_eps, io, b);
    });
  }
  for (int64_t i = 0; i < io.n_in; ++i) {
    const int64_t rows = io.in_off[i + 1] - io.in_off[i];
    at::Tensor part = at::empty({d.batch, rows}, proj.options());
    fused::project(xn, io.in_w[i], part);
    proj.narrow(1, io.in_off[i], rows).copy_(part);
  }
  at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) delta::conv_rows(d, s.conv_w, io, b, 0, d.conv_dim);
  });
  at::parallel_for(0, d.batch * d.v_heads, 1, [&](int64_t lo, int64_t hi) {
    HeadScratch scratch(d.dk, d.dv);
    for (int64_t t = lo; t < hi; ++t) delta_head(d, s, io, t / d.v_heads, t % d.v_heads, scratch);
  });
  fused::project(y, *io.out_w, mixed);
  if (s.norm_w) {
    at::parallel_for(0, d.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        fused::finish_row(io.mixed + b * d.hidden, nullptr, io.hidden + b * d.hidden, d.hidden);
      }
    });
  }
}

// The rows of each speculative chain in order: row b continues the chain of the last row
// before it whose slot is b's source slot; a row without one starts a chain (a plain decode
// reads and writes its own slot, a padding row neither: chains of one row).
std::vector<std::vector<int64_t>> chain_rows(const at::Tensor& slots, const at::Tensor& src) {
  const int64_t* dst = slots.data_ptr<int64_t>();
  const int64_t* from = src.data_ptr<int64_t>();
  const int64_t batch = slots.size(0);
  std::vector<std::vector<int64_t>> chains;
  std::vector<int64_t> chain_of(batch, -1);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t prev = -1;  // a padding row (slot -1) is a chain of one, as a plain decode
    for (int64_t a = b - 1; a >= 0 && dst[b] >= 0 && from[b] != dst[b]; --a) {
      if (dst[a] == from[b]) {
        prev = a;
        break;
      }
    }
    if (prev < 0) {
      chain_of[b] = static_cast<int64_t>(chains.size());
      chains.push_back({b});
    } else {
      TORCH_CHECK(chains[chain_of[prev]].back() == prev, "row ", b, " continues row ", prev,
                  ", which another row continues already");
      chain_of[b] = chain_of[prev];
      chains[chain_of[b]].push_back(b);
    }
  }
  return chains;
}

// A chain log of the states' slots: (S, Hv, Dk + Dv + 1) contiguous float32.
void check_log(const at::Tensor& log, const at::Tensor& ssm_states) {
  TORCH_CHECK(log.scalar_type() == at::kFloat && log.is_contiguous() && log.dim() == 3 &&
                  log.size(0) == ssm_states.size(0) && log.size(1) == ssm_states.size(1) &&
                  log.size(2) == ssm_states.size(2) + ssm_states.size(3) + 1,
              "chain_log must be contiguous float32 (S, Hv, Dk + Dv + 1) over the states' slots");
}

Dims check_dims(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& params,
                const at::Tensor& conv_states, const at::Tensor& ssm_states,
                const at::Tensor& slots) {
  Dims d = delta::check_dims(hidden, params.size(), kFirstIn, conv_states, ssm_states, slots);
  d.nin = d.conv_dim + d.value_dim + 2 * d.v_heads;
  return d;
}

at::Tensor fused_gdn_decode(const at::Tensor& hidden_in,
                            const c10::List<std::optional<at::Tensor>>& params,
                            at::Tensor& conv_states, at::Tensor& ssm_states,
                            const at::Tensor& state_indices, double norm_eps, double gate_eps,
                            double beta_scale, at::ScalarType out_dtype,
                            const std::optional<at::Tensor>& src_state_indices, bool int_dot,
                            const std::optional<at::Tensor>& chain_log) {
  const Dims d = check_dims(hidden_in, params, conv_states, ssm_states, state_indices);
  const at::Tensor src = fused::src_slots(src_state_indices, d.batch);
  TORCH_CHECK(!chain_log.has_value() || src.defined(),
              "chain_log needs src_state_indices (it logs speculative chains)");
  if (chain_log.has_value()) check_log(*chain_log, ssm_states);
  const int64_t n_in = static_cast<int64_t>(params.size() - kFirstIn) / 2;
  std::vector<Weight> in_w;
  std::vector<int64_t> in_off(1, 0);
  for (int64_t i = 0; i < n_in; ++i) {
    const size_t at = kFirstIn + 2 * static_cast<size_t>(i);
    const std::optional<at::Tensor> t = params.get(at);
    TORCH_CHECK(t.has_value() && t->dim() == 2, "input projection ", i,
                " must be a (rows, H) weight");
    const int64_t rows = t->size(0);
    in_w.push_back(fused::weight_of(params, at, at + 1, rows, d.hidden, "input projection weight",
                                    int_dot));
    in_off.push_back(in_off.back() + rows);
  }
  TORCH_CHECK(in_off.back() == d.nin, "the input projections must have 2 Hk Dk + 2 Hv Dv + 2 Hv = ",
              d.nin, " rows together ([q | k | v | z | b | a]), got ", in_off.back());
  const Weight out_w =
      fused::weight_of(params, kOutW, kOutScale, d.hidden, d.value_dim, "out_proj weight", int_dot);
  Small s{};
  s.norm_w = fused::param_f32(params, kNormW, d.hidden, "norm weight");
  s.conv_w = fused::param_f32(params, kConvW, d.conv_dim * d.kernel, "conv weight");
  s.A_log = fused::param_f32(params, kALog, d.v_heads, "A_log");
  s.dt_bias = fused::param_f32(params, kDtBias, d.v_heads, "dt_bias");
  s.gate_w = fused::param_f32(params, kGateW, d.dv, "gated norm weight");
  TORCH_CHECK(s.conv_w && s.A_log && s.dt_bias && s.gate_w,
              "conv weight, A_log, dt_bias and the gated norm weight are required");
  s.norm_eps = static_cast<float>(norm_eps);
  s.gate_eps = static_cast<float>(gate_eps);
  s.beta_scale = static_cast<float>(beta_scale);

  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const at::Tensor slots = as_index(state_indices);
  delta::check_slots(slots, conv_states.size(0), "state_indices");
  if (src.defined()) {
    delta::check_slots(src, conv_states.size(0), "src_state_indices");
    const int64_t *to = slots.data_ptr<int64_t>(), *from = src.data_ptr<int64_t>();
    for (int64_t b = 0; b < d.batch; ++b) {
      TORCH_CHECK(to[b] < 0 || from[b] >= 0, "row ", b, " writes slot ", to[b],
                  " but reads no slot (src_state_indices[", b, "] = -1)");
    }
  }
  const auto f32 = hidden.options();
  at::Tensor xn = s.norm_w ? at::empty({d.batch, d.hidden}, f32) : hidden;
  at::Tensor proj = at::empty({d.batch, d.nin}, f32);
  at::Tensor y = at::empty({d.batch, d.value_dim}, f32);
  at::Tensor mixed = at::empty({d.batch, d.hidden}, f32);
  if (d.batch == 0) return mixed.to(out_dtype);
  std::vector<std::vector<int64_t>> chains;
  if (chain_log.has_value()) chains = chain_rows(slots, src);
  auto run = [&](auto* c_tag, auto* s_tag) {
    using C = std::remove_pointer_t<decltype(c_tag)>;
    using S = std::remove_pointer_t<decltype(s_tag)>;
    Io<C, S> io{in_w.data(), in_off.data(), n_in, &out_w, conv_states.data_ptr<C>(),
                ssm_states.data_ptr<S>(), slots.data_ptr<int64_t>(),
                src.defined() ? src.data_ptr<int64_t>() : nullptr, hidden.data_ptr<float>(),
                xn.data_ptr<float>(), proj.data_ptr<float>(), y.data_ptr<float>(),
                mixed.data_ptr<float>(), chain_log ? chain_log->data_ptr<float>() : nullptr,
                &chains};
    if (d.batch <= fused::kGemvMaxBatch || io.src_slots != nullptr) {  // chains: rows in order
      run_layer(d, s, io);
    } else {
      run_layer_gemm(d, s, io, xn, proj, y, mixed);
    }
  };
  dispatch_float_bf16(conv_states, "conv_states", [&](auto* c_tag) {
    dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* s_tag) { run(c_tag, s_tag); });
  });
  return mixed.to(out_dtype);
}

// Rebuilds logged chains' states (`gdn_chain_replay`): state dst[i] = the state of slot
// start[i] advanced by the records of slots records[i, 0], records[i, 1], ... (up to the first
// -1), each position's row update and rounding exactly those of the chain's call.
void gdn_chain_replay(at::Tensor& ssm_states, const at::Tensor& chain_log, const at::Tensor& start_in,
                      const at::Tensor& records_in, const at::Tensor& dst_in) {
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.is_contiguous(),
              "ssm_states must be contiguous (S, Hv, Dk, Dv)");
  check_log(chain_log, ssm_states);
  const at::Tensor start = as_index(start_in), dst = as_index(dst_in);
  const at::Tensor records = records_in.to(at::kLong).contiguous();
  const int64_t n = start.numel(), slots = ssm_states.size(0);
  TORCH_CHECK(start.dim() == 1 && dst.dim() == 1 && dst.numel() == n && records.dim() == 2 &&
                  records.size(0) == n,
              "start and dst must be (n,), records (n, R)");
  delta::check_slots(start, slots, "start");
  delta::check_slots(dst, slots, "dst");
  delta::check_slots(records, slots, "records");
  const int64_t hv = ssm_states.size(1), dk = ssm_states.size(2), dv = ssm_states.size(3);
  const int64_t size = dk * dv, rec = dk + dv + 1, width = records.size(1);
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* to = dst.data_ptr<int64_t>();
  const int64_t* rs = records.data_ptr<int64_t>();
  const float* log = chain_log.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(st[i] >= 0 && to[i] >= 0, "replay ", i, " has a padding slot");
  }
  dispatch_float_bf16(ssm_states, "ssm_states", [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    S* states = ssm_states.data_ptr<S>();
    at::parallel_for(0, n * hv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(dv);
      std::vector<vec::bf16_t> tmp(dv);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t i = t / hv, h = t % hv;
        const S* from = states + (st[i] * hv + h) * size;
        S* out = states + (to[i] * hv + h) * size;
        for (int64_t k = 0; k < dk; ++k) {
          if constexpr (std::is_same_v<S, float>) {  // float32: each row updated where it lies
            const float* src = from + k * dv;
            for (int64_t j = 0; j < width && rs[i * width + j] >= 0; ++j) {
              const float* r = log + (rs[i * width + j] * hv + h) * rec;
              update_row(src, r[dk + dv], r[k], r + dk, out + k * dv, dv);
              src = out + k * dv;
            }
            if (src != out + k * dv) std::copy(src, src + dv, out + k * dv);
            continue;
          }
          get_rows(from + k * dv, row.data(), dv);
          for (int64_t j = 0; j < width && rs[i * width + j] >= 0; ++j) {
            const float* r = log + (rs[i * width + j] * hv + h) * rec;
            update_row(row.data(), r[dk + dv], r[k], r + dk, row.data(), dv);
            round_row(from, row.data(), tmp.data(), dv);
          }
          put_rows(row.data(), out + k * dv, dv);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "fused_gdn_decode(Tensor hidden, Tensor?[] params, Tensor(a!) conv_states, "
      "Tensor(b!) ssm_states, Tensor state_indices, float norm_eps, float gate_eps, "
      "float beta_scale, ScalarType out_dtype, Tensor? src_state_indices=None, "
      "bool int_dot=False, Tensor(c!)? chain_log=None) -> Tensor");
  m.def(
      "gdn_chain_replay(Tensor(a!) ssm_states, Tensor chain_log, Tensor start, Tensor records, "
      "Tensor dst) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("fused_gdn_decode", &fused_gdn_decode);
  m.impl("gdn_chain_replay", &gdn_chain_replay);
}

}  // namespace vllm_mamba
