// Building blocks of the fused decode layers (`fused_decode_mamba.cpp`,
// `fused_decode_mamba2.cpp`): matrix-vector products that stream a weight once for a few
// batch rows, the block RMSNorm, and the split of a range over the threads of one parallel
// region.
//
// Decode with a few sequences is bound by reading the weights from memory, so the products
// go through the weight in tiles of 4 rows, each read from memory once for every batch row
// (`gemv.h`: `dot_tile`, every row of x summed exactly as alone, so speculative chains equal
// one-by-one decoding). Weights are float32, bfloat16, int8 with one float32 scale per row
// (`quantization="int8"`) or 4-bit groups of 32 with a float16 scale each
// (`quantization="int4"`), widened on the fly;
// activations and accumulation are float32. With integer dot products (`Weight::int_dot`:
// `quantization="w8a8"` / `"w4a8"`) the int8 and 4-bit products quantise x to int8 blocks of
// 32 and multiply in integers instead (`int_dot.h`).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bf16_gemm.h"
#include "gemv.h"
#include "int_dot.h"
#include "kernel_math.h"
#include "onednn_linear.h"
#include "vec.h"

#if defined(VLLM_MAMBA_VEC_AVX512) || defined(VLLM_MAMBA_VEC_AVX2)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace vllm_mamba {
namespace fused {

constexpr int64_t kRowBlock = gemv::kRowBlock;  // weight rows per pass; ranges split on this unit
constexpr int64_t kGemvMaxBatch = 8;  // more rows than this: the projections run as GEMMs

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int num_threads() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// [lo, hi) of `n` items for thread `tid` of `nth`, in whole units of `unit` items.
inline void split(int64_t n, int64_t unit, int tid, int nth, int64_t& lo, int64_t& hi) {
  const int64_t units = (n + unit - 1) / unit;
  const int64_t per = units / nth, extra = units % nth;
  const int64_t u0 = tid * per + std::min<int64_t>(tid, extra);
  const int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
  lo = std::min(n, u0 * unit);
  hi = std::min(n, u1 * unit);
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

// c10::BFloat16 pointers as the raw bfloat16 type of `vec.h` (the same 16 bits).
inline const vec::bf16_t* raw(const c10::BFloat16* p) {
  return reinterpret_cast<const vec::bf16_t*>(p);
}
inline vec::bf16_t* raw(c10::BFloat16* p) { return reinterpret_cast<vec::bf16_t*>(p); }
inline const float* raw(const float* p) { return p; }
inline float* raw(float* p) { return p; }

// A float32 view of `n` state values for an update in place (`gemv::load_state`), written back
// by `store_state` (rounding to nearest even for a bfloat16 state).
template <typename S>
inline float* load_state(S* st, float* buf, int64_t n) {
  return gemv::load_state(raw(st), buf, n);
}
template <typename S>
inline void store_state(const float* buf, S* st, int64_t n) {
  gemv::store_state(buf, raw(st), n);
}

// The block norm of one row: out = weight * x / sqrt(mean(x^2) + eps), as `RMSNorm` in float32.
inline void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * r);
}

// A projection weight (rows, k) as the kernels read it: float32 or bfloat16, int8 with one
// float32 scale per row (row r stands for w[r] * scale[r]), or 4-bit (dtype uint8: `tensor`
// (rows, k / 2) packed as `gemv::Q4Rows`, `scale` (rows, k / 32) float16; or, with integer dot
// products only, Q4_K-style: `scale` (rows, ceil(k / 256) * 16) uint8, `int_dot::Q4KRows`).
struct Weight {
  at::Tensor tensor;  // (rows, k), contiguous; (rows, k / 2) uint8 for 4-bit
  at::Tensor scale;   // (rows,) float32 for int8, (rows, k / 32) float16 for 4-bit, else undefined
  const void* data = nullptr;
  const float* scales = nullptr;
  const uint16_t* q4_scales = nullptr;  // 4-bit: the float16 scales' bits
  const uint8_t* q4k_scales = nullptr;  // Q4_K-style 4-bit: the super-blocks' scale bytes
  at::ScalarType dtype = at::kFloat;
  int64_t k = 0;
  // Integer dot products (`quantization="w8a8"` / `"w4a8"`): an int8 or 4-bit weight whose
  // products quantise each row of x to int8 in blocks of 32 (one float32 scale per block, as
  // llama.cpp's Q8_0 activations) and multiply in integers; false: x stays float32 (exact
  // weight-only). Set by `weight_of` from the layer call's `int_dot` argument.
  bool int_dot = false;
};

// The rows of x of a `gemv` call with integer dot products, quantised by the calling thread
// into its own buffer (reused from call to call: each OpenMP thread keeps one).
inline const int_dot::QActs& quantized_rows(const float* x, int64_t ldx, int64_t batch,
                                            int64_t k) {
  static thread_local int_dot::QActs buf;
  int_dot::quantize(x, ldx, batch, k, buf);
  return buf;
}

// out[b, r - lo] (row stride ldo) = w[r] . x[b] for rows r in [lo, hi), whatever w's dtype,
// every row of x summed exactly as alone (`gemv::gemv_rows`; the 4-bit tiles and integer dot
// products, `int_dot.h`, too): a speculative chain's rows equal its tokens decoded one by one.
// With `w.int_dot` the calling thread quantises the rows of x once per call (all of them: each
// thread of a parallel region reads every row).
inline void gemv(const Weight& w, const float* x, int64_t ldx, int64_t batch, int64_t lo,
                 int64_t hi, float* out, int64_t ldo) {
  if (w.int_dot) {
    if (lo >= hi) return;
    const int_dot::QActs& q = quantized_rows(x, ldx, batch, w.k);
    const int64_t n = w.tensor.size(0);
    if (w.q4k_scales) {
      const int_dot::Q4KRows q4k{static_cast<const uint8_t*>(w.data), w.q4k_scales, w.k, n};
      int_dot::rows_q4k(q4k, q, lo, hi, out, ldo);
    } else if (w.dtype == at::kByte) {
      const int_dot::Q4Rows q4{static_cast<const uint8_t*>(w.data), w.q4_scales, w.k, n};
      int_dot::rows_q4(q4, q, lo, hi, out, ldo);
    } else {
      const int_dot::I8Rows i8{static_cast<const int8_t*>(w.data), w.scales, w.k, n};
      int_dot::rows_i8(i8, q, lo, hi, out, ldo);
    }
    return;
  }
  auto rows = [&](const auto* data) { gemv::gemv_rows(data, w.k, x, ldx, batch, lo, hi, out, ldo); };
  if (w.dtype == at::kFloat) {
    rows(static_cast<const float*>(w.data));
  } else if (w.dtype == at::kBFloat16) {
    rows(static_cast<const vec::bf16_t*>(w.data));
  } else if (w.dtype == at::kByte) {  // 4-bit, checked by `weight_of`
    const gemv::Q4Rows q4{static_cast<const uint8_t*>(w.data), w.q4_scales, w.k};
    gemv::gemv_rows_q4(q4, x, ldx, batch, lo, hi, out, ldo);
  } else {  // int8, checked by `weight_of`
    rows(static_cast<const int8_t*>(w.data));
    for (int64_t b = 0; b < batch; ++b) {
      float* o = out + b * ldo - lo;
#pragma omp simd
      for (int64_t r = lo; r < hi; ++r) o[r] *= w.scales[r];
    }
  }
}

// out (B, N) float32 = x (B, K) float32 @ w (N, K)^T by a GEMM (x may have a row stride):
// float32 weights through oneDNN where it is available (else MKL's `mm`);
// bfloat16 weights multiply bfloat16 activations where the CPU has bfloat16 instructions, as
// the unfused layer does (up to `bf16_gemm::kMaxRows` rows by `bf16_gemm`), and go through the
// `bf16_linear` op (widened to float32) where it has not; int8 and 4-bit weights go through the `int8_linear` and `int4_linear` ops, or with
// integer dot products (`w.int_dot`) the `w8a8_linear` and `w4a8_linear` ops (`int_dot.h`:
// the same per-row numerics as `gemv`).
inline void project(const at::Tensor& x, const Weight& w, at::Tensor& out) {
  using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&);
  if (w.int_dot) {
    static const auto w8a8_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("vllm_mamba::w8a8_linear", "")
                                    .typed<LinearOp>();
    static const auto w4a8_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("vllm_mamba::w4a8_linear", "")
                                    .typed<LinearOp>();
    const auto& op = w.dtype == at::kByte ? w4a8_op : w8a8_op;
    out.copy_(op.call(x, w.tensor, w.scale, std::nullopt));
    return;
  }
  if (w.dtype == at::kFloat) {
    if (!onednn_linear(x, w.tensor, at::Tensor(), out)) at::mm_out(out, x, w.tensor.t());
  } else if (w.dtype == at::kBFloat16 && vec::native_bf16()) {
    if (x.size(0) <= bf16_gemm::kMaxRows && bf16_gemm::available() && out.stride(1) == 1) {
      const at::Tensor xb = x.to(at::kBFloat16).contiguous();
      bf16_gemm::gemm(static_cast<const uint16_t*>(xb.data_ptr()), xb.size(1), xb.size(0),
                      static_cast<const uint16_t*>(w.tensor.data_ptr()), w.tensor.size(0), w.k,
                      out.data_ptr<float>(), out.stride(0));
    } else {
      out.copy_(at::mm(x.to(w.dtype), w.tensor.t()));
    }
  } else if (w.dtype == at::kBFloat16) {  // widened to float32 (`widening_linear.cpp`)
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("vllm_mamba::bf16_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&)>();
    out.copy_(op.call(x, w.tensor, std::nullopt));
  } else {
    static const auto int8_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("vllm_mamba::int8_linear", "")
                                    .typed<LinearOp>();
    static const auto int4_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("vllm_mamba::int4_linear", "")
                                    .typed<LinearOp>();
    const auto& op = w.dtype == at::kByte ? int4_op : int8_op;
    out.copy_(op.call(x, w.tensor, w.scale, std::nullopt));
  }
}

// mixed[:n] += bias (optional) + residual (optional): the end of a layer.
// (A `scale` other than 1, a residual multiplier, with the residual: residual[r] + scale *
// (mixed[r] + bias[r]), rounded as the unfused layer's `h + rm * o_proj(x)`.)
inline void finish_row(float* mixed, const float* bias, const float* residual, int64_t n,
                       float scale = 1.0f) {
  if (scale != 1.0f && residual) {
    for (int64_t r = 0; r < n; ++r) {
      mixed[r] = residual[r] + (mixed[r] + (bias ? bias[r] : 0.0f)) * scale;
    }
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    mixed[r] += (bias ? bias[r] : 0.0f) + (residual ? residual[r] : 0.0f);
  }
}

#ifdef VLLM_MAMBA_VEC_AVX512
// The permutes of `conv4_update16` (16 width-4 channels, float32 histories of 3 values each):
// - reading from contiguous loads (in place of gathers): tap t of channel c is weight 4 c + t
//   (channels 0-7 from the first two of four vectors, 8-15 from the last two, `tap` indexing
//   both pairs); history value k of channel c is 3 c + k of 48 (from the first two of three
//   vectors where 3 c + k < 32, `hist_lo`, else from the last two, `hist_hi`, the lanes of
//   `hist_from_hi`);
// - writing back the shifted histories: output vector o holds positions 16 o .. 16 o + 15 of
//   the 48 values, position p being value p % 3 of channel p / 3: h1 (index c of the pair h1,
//   h2), h2 (16 + c), or the new input x[c] (lanes of `from_x`).
struct Conv4Perm {
  int32_t tap[4][16] = {};
  int32_t hist_lo[3][16] = {};
  int32_t hist_hi[3][16] = {};
  uint16_t hist_from_hi[3] = {};
  int32_t from_h[3][16] = {};
  int32_t channel[3][16] = {};
  uint16_t from_x[3] = {};
};

constexpr Conv4Perm make_conv4_perm() {
  Conv4Perm t;
  for (int l = 0; l < 16; ++l) {
    for (int k = 0; k < 4; ++k) t.tap[k][l] = 4 * (l % 8) + k;
    for (int k = 0; k < 3; ++k) {
      const int p = 3 * l + k;  // read: value k of channel l
      t.hist_lo[k][l] = p < 32 ? p : 0;
      t.hist_hi[k][l] = p >= 32 ? p - 16 : 0;
      if (p >= 32) t.hist_from_hi[k] = static_cast<uint16_t>(t.hist_from_hi[k] | (1u << l));
    }
    for (int o = 0; o < 3; ++o) {
      const int p = 16 * o + l, c = p / 3, k = p % 3;  // write: position p of the 48
      t.from_h[o][l] = k == 0 ? c : 16 + c;
      t.channel[o][l] = c;
      if (k == 2) t.from_x[o] = static_cast<uint16_t>(t.from_x[o] | (1u << l));
    }
  }
  return t;
}

inline constexpr Conv4Perm kConv4Perm = make_conv4_perm();

// Width-4 conv of 16 channels at once (float32 histories, 3 values per channel, interleaved):
// the taps and histories are read with contiguous loads and sorted into one vector per tap by
// permutes (`kConv4Perm`), and the shifted histories interleaved back with two permutes per
// output vector. Returns the pre-activation values.
inline __m512 conv4_update16(const float* v, const float* from, float* hist, const float* conv_w,
                             const float* conv_b) {
  const __m512 xin = _mm512_loadu_ps(v);
  __m512 acc = conv_b ? _mm512_loadu_ps(conv_b) : _mm512_setzero_ps();
  __m512 w[4];  // w[t]: tap t of the 16 channels
  {
    const __m512 w0 = _mm512_loadu_ps(conv_w), w1 = _mm512_loadu_ps(conv_w + 16);
    const __m512 w2 = _mm512_loadu_ps(conv_w + 32), w3 = _mm512_loadu_ps(conv_w + 48);
    for (int t = 0; t < 4; ++t) {
      const __m512i idx = _mm512_loadu_si512(kConv4Perm.tap[t]);
      const __m512 lo = _mm512_permutex2var_ps(w0, idx, w1), hi = _mm512_permutex2var_ps(w2, idx, w3);
      w[t] = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
    }
  }
  acc = _mm512_fmadd_ps(w[3], xin, acc);
  const __m512 r0 = _mm512_loadu_ps(from), r1 = _mm512_loadu_ps(from + 16);
  const __m512 r2 = _mm512_loadu_ps(from + 32);
  __m512 h[3];
  for (int k = 0; k < 3; ++k) {
    const __m512 lo = _mm512_permutex2var_ps(r0, _mm512_loadu_si512(kConv4Perm.hist_lo[k]), r1);
    const __m512 hi = _mm512_permutex2var_ps(r1, _mm512_loadu_si512(kConv4Perm.hist_hi[k]), r2);
    h[k] = _mm512_mask_blend_ps(kConv4Perm.hist_from_hi[k], lo, hi);
    acc = _mm512_fmadd_ps(w[k], h[k], acc);
  }
  // New history of channel c: (h1[c], h2[c], x[c]) at hist[3c .. 3c + 2].
  for (int o = 0; o < 3; ++o) {
    __m512 out = _mm512_permutex2var_ps(h[1], _mm512_loadu_si512(kConv4Perm.from_h[o]), h[2]);
    out = _mm512_mask_permutexvar_ps(out, kConv4Perm.from_x[o],
                                     _mm512_loadu_si512(kConv4Perm.channel[o]), xin);
    _mm512_storeu_ps(hist + 16 * o, out);
  }
  return acc;
}
#endif

#ifdef VLLM_MAMBA_VEC_AVX2
// The AVX2 twin of `conv4_update16`, 8 channels at once, each channel's arithmetic the same
// (taps in the order w3 x + b, then w0 h0, w1 h1, w2 h2, each a fused multiply-add). Taps: the
// 8 channels' 32 weights transposed 4 x 4 per 128-bit lane (channel order 0 2 4 6 1 3 5 7),
// then put back in order by one permute a tap. Histories: value k of channel c is 3 c + k of
// the 24, gathered from the three vectors by permutes and blends; the shifted histories
// interleaved back the same way.
struct Conv4Avx2 {
  int32_t hist[3][3][8] = {};  // [k][source vector][lane]
  int32_t channel[3][8] = {};  // output vector o, lane l: channel (8 o + l) / 3
};

constexpr Conv4Avx2 make_conv4_avx2() {
  Conv4Avx2 t;
  for (int l = 0; l < 8; ++l) {
    for (int k = 0; k < 3; ++k) {
      const int p = 3 * l + k;
      t.hist[k][p / 8][l] = p % 8;
    }
    for (int o = 0; o < 3; ++o) t.channel[o][l] = (8 * o + l) / 3;
  }
  return t;
}

inline constexpr Conv4Avx2 kConv4Avx2 = make_conv4_avx2();

inline __m256i conv4_idx(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256 conv4_update8(const float* v, const float* from, float* hist, const float* conv_w,
                            const float* conv_b) {
  const __m256 xin = _mm256_loadu_ps(v);
  __m256 w[4];  // w[t]: tap t of the 8 channels
  {
    const __m256 w0 = _mm256_loadu_ps(conv_w), w1 = _mm256_loadu_ps(conv_w + 8);
    const __m256 w2 = _mm256_loadu_ps(conv_w + 16), w3 = _mm256_loadu_ps(conv_w + 24);
    const __m256d a = _mm256_castps_pd(_mm256_unpacklo_ps(w0, w1));
    const __m256d b = _mm256_castps_pd(_mm256_unpackhi_ps(w0, w1));
    const __m256d c = _mm256_castps_pd(_mm256_unpacklo_ps(w2, w3));
    const __m256d d = _mm256_castps_pd(_mm256_unpackhi_ps(w2, w3));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    w[0] = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, c)), order);
    w[1] = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(a, c)), order);
    w[2] = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(b, d)), order);
    w[3] = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(b, d)), order);
  }
  __m256 acc = _mm256_fmadd_ps(w[3], xin, conv_b ? _mm256_loadu_ps(conv_b) : _mm256_setzero_ps());
  const __m256 r[3] = {_mm256_loadu_ps(from), _mm256_loadu_ps(from + 8),
                       _mm256_loadu_ps(from + 16)};
  auto pick = [&](int k, int s) {
    return _mm256_permutevar8x32_ps(r[s], conv4_idx(kConv4Avx2.hist[k][s]));
  };
  __m256 h[3];  // lanes from vector 1 and 2 by k: 3 l + k in 8..15 and 16..23
  h[0] = _mm256_blend_ps(_mm256_blend_ps(pick(0, 0), pick(0, 1), 0x38), pick(0, 2), 0xC0);
  h[1] = _mm256_blend_ps(_mm256_blend_ps(pick(1, 0), pick(1, 1), 0x18), pick(1, 2), 0xE0);
  h[2] = _mm256_blend_ps(_mm256_blend_ps(pick(2, 0), pick(2, 1), 0x1C), pick(2, 2), 0xE0);
  for (int k = 0; k < 3; ++k) acc = _mm256_fmadd_ps(w[k], h[k], acc);
  // New history of channel c: (h1[c], h2[c], x[c]) at hist[3c .. 3c + 2]; output vector o's
  // lanes take h2 and x where (8 o + l) % 3 is 1 and 2.
  auto spread = [&](int o, __m256 src) {
    return _mm256_permutevar8x32_ps(src, conv4_idx(kConv4Avx2.channel[o]));
  };
  _mm256_storeu_ps(hist, _mm256_blend_ps(_mm256_blend_ps(spread(0, h[1]), spread(0, h[2]), 0x92),
                                         spread(0, xin), 0x24));
  _mm256_storeu_ps(hist + 8, _mm256_blend_ps(
                                 _mm256_blend_ps(spread(1, h[1]), spread(1, h[2]), 0x24),
                                 spread(1, xin), 0x49));
  _mm256_storeu_ps(hist + 16, _mm256_blend_ps(
                                  _mm256_blend_ps(spread(2, h[1]), spread(2, h[2]), 0x49),
                                  spread(2, xin), 0x92));
  return acc;
}
#endif

// Causal conv of channels [c0, c1) for one row: v[c] (the new input) becomes
// silu(bias[c] + w[c, K-1] v[c] + sum_j w[c, j] hist[c, j]), and each history (K - 1 values
// per channel, nullptr for a padding row: zeros, not written) shifts the input in. The SiLU
// runs as a second, vectorised pass (skipped when `silu` is false). Float32 histories of
// width-4 convs (every Mamba and Mamba2 checkpoint) go 16 channels at a time through
// `conv4_update16`. With `from`, the histories are read from there (a speculative chain's row
// continuing another row's history) and written shifted to `hist`.
template <typename H>
inline void conv_update(float* v, H* hist, const float* conv_w, const float* conv_b,
                        int64_t kernel, int64_t c0, int64_t c1, bool silu = true,
                        const H* from = nullptr) {
  const int64_t km1 = kernel - 1;
  if (from == nullptr) from = hist;
  int64_t c = c0;
#ifdef VLLM_MAMBA_VEC_AVX512
  if constexpr (std::is_same_v<H, float>) {
    if (kernel == 4 && hist) {
      for (; c + 16 <= c1; c += 16) {
        const __m512 acc =
            conv4_update16(v + c, from + c * 3, hist + c * 3, conv_w + c * 4, conv_b ? conv_b + c : nullptr);
        _mm512_storeu_ps(v + c, acc);
      }
    }
  }
#elif defined(VLLM_MAMBA_VEC_AVX2)
  if constexpr (std::is_same_v<H, float>) {
    if (kernel == 4 && hist) {
      for (; c + 8 <= c1; c += 8) {
        const __m256 acc =
            conv4_update8(v + c, from + c * 3, hist + c * 3, conv_w + c * 4, conv_b ? conv_b + c : nullptr);
        _mm256_storeu_ps(v + c, acc);
      }
    }
  }
#else
  if constexpr (std::is_same_v<H, float>) {
    if (kernel == 4 && hist) {  // channels in parallel, strided loads vectorised by the compiler
      const int64_t n = c1 - c;
      float* hb = hist + c * 3;
      const float* fb = from + c * 3;
      const float* wb = conv_w + c * 4;
      const float* bb = conv_b ? conv_b + c : nullptr;
      float* vb = v + c;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float h0 = fb[3 * j], h1 = fb[3 * j + 1], h2 = fb[3 * j + 2], xin = vb[j];
        float acc = wb[4 * j + 3] * xin + (bb ? bb[j] : 0.0f);
        acc += wb[4 * j] * h0;
        acc += wb[4 * j + 1] * h1;
        acc += wb[4 * j + 2] * h2;
        hb[3 * j] = h1;
        hb[3 * j + 1] = h2;
        hb[3 * j + 2] = xin;
        vb[j] = acc;
      }
      c = c1;
    }
  }
#endif
  for (; c < c1; ++c) {
    const float* w = conv_w + c * kernel;
    const float xin = v[c];
    float acc = w[km1] * xin + (conv_b ? conv_b[c] : 0.0f);
    if (hist) {
      H* h = hist + c * km1;
      const H* f = from + c * km1;
      for (int64_t j = 0; j < km1; ++j) acc += w[j] * widen(f[j]);
      for (int64_t j = 0; j + 1 < km1; ++j) h[j] = f[j + 1];
      if (km1 > 0) h[km1 - 1] = static_cast<H>(xin);
    }
    v[c] = acc;
  }
  if (!silu) return;
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) v[c] = silu_f32(v[c]);
}

// Reads an optional float32 parameter of a params list; nullptr when absent.
// The int64 `src_state_indices` of a layer call (undefined when absent): the slot each row
// reads its state from (chains of speculative decoding); such a call runs its rows in order
// (the small-batch layer, at any number of rows).
inline at::Tensor src_slots(const std::optional<at::Tensor>& src, int64_t batch) {
  if (!src.has_value()) return at::Tensor();
  TORCH_CHECK(src->dim() == 1 && src->size(0) == batch, "src_state_indices must be (B,)");
  return src->to(at::kLong).contiguous();
}

inline const float* param_f32(const c10::List<std::optional<at::Tensor>>& params, size_t i,
                              int64_t numel, const char* what) {
  const std::optional<at::Tensor> t = params.get(i);
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, what,
              " must be a contiguous float32 tensor of ", numel, " elements");
  return t->data_ptr<float>();
}

// A required projection weight of a params list, contiguous and shaped (rows, cols): float32,
// bfloat16, int8 with its (rows,) float32 scale at `scale_i`, or 4-bit (uint8 (rows, cols / 2),
// cols a multiple of 32) with its (rows, cols / 32) float16 scales at `scale_i` (absent
// otherwise). Each weight of a layer may have its own dtype. `int_dot`: the layer's integer
// weights multiply int8-quantised activations (`Weight::int_dot`); float weights ignore it.
inline Weight weight_of(const c10::List<std::optional<at::Tensor>>& params, size_t i,
                        size_t scale_i, int64_t rows, int64_t cols, const char* what,
                        bool int_dot = false) {
  const std::optional<at::Tensor> t = params.get(i);
  TORCH_CHECK(t.has_value(), what, " is required");
  Weight w;
  w.tensor = *t;
  w.dtype = w.tensor.scalar_type();
  w.k = cols;
  const std::optional<at::Tensor> scale = params.get(scale_i);
  if (w.dtype == at::kByte) {
    TORCH_CHECK(cols % gemv::kQ4Group == 0 && w.tensor.dim() == 2 && w.tensor.size(0) == rows &&
                    w.tensor.size(1) * 2 == cols && w.tensor.is_contiguous(),
                what, " is 4-bit: it must be contiguous uint8 (", rows, ", ", cols / 2,
                ") with ", cols, " a multiple of 32, got ", w.tensor.sizes());
    if (scale.has_value() && scale->scalar_type() == at::kByte) {  // Q4_K-style
      const int64_t sbytes = int_dot::super_blocks(cols) * int_dot::kSuperBytes;
      TORCH_CHECK(int_dot, what, " is Q4_K-style 4-bit: it needs integer dot products");
      TORCH_CHECK(scale->is_contiguous() && scale->dim() == 2 && scale->size(0) == rows &&
                      scale->size(1) == sbytes,
                  what, " is Q4_K-style 4-bit: its scales must be contiguous uint8 (", rows, ", ",
                  sbytes, ")");
      w.scale = *scale;
      w.q4k_scales = w.scale.data_ptr<uint8_t>();
      w.data = w.tensor.data_ptr();
      w.int_dot = true;
      return w;
    }
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kHalf &&
                    scale->is_contiguous() && scale->dim() == 2 && scale->size(0) == rows &&
                    scale->size(1) == cols / gemv::kQ4Group,
                what, " is 4-bit: its scales must be a contiguous float16 tensor (", rows, ", ",
                cols / gemv::kQ4Group, ")");
    w.scale = *scale;
    w.q4_scales = reinterpret_cast<const uint16_t*>(w.scale.data_ptr<at::Half>());
    w.data = w.tensor.data_ptr();
    w.int_dot = int_dot;
    return w;
  }
  TORCH_CHECK(w.tensor.dim() == 2 && w.tensor.size(0) == rows && w.tensor.size(1) == cols, what,
              " must be (", rows, ", ", cols, "), got ", w.tensor.sizes());
  TORCH_CHECK(w.tensor.is_contiguous() &&
                  (w.dtype == at::kFloat || w.dtype == at::kBFloat16 || w.dtype == at::kChar),
              what, " must be contiguous float32, bfloat16, int8 or 4-bit (uint8)");
  if (w.dtype == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat &&
                    scale->is_contiguous() && scale->numel() == rows,
                what, " is int8: its scale must be a contiguous float32 tensor of ", rows,
                " elements");
    w.scale = *scale;
    w.scales = w.scale.data_ptr<float>();
  } else {
    TORCH_CHECK(!scale.has_value(), what, " is not int8 but has a scale");
  }
  w.data = w.tensor.data_ptr();
  w.int_dot = int_dot && w.dtype == at::kChar;
  TORCH_CHECK(!w.int_dot || cols % int_dot::kBlock == 0, what,
              ": integer dot products need K a multiple of 32, got ", cols);
  return w;
}

}  // namespace fused
}  // namespace vllm_mamba
