// Integer dot products for many rows of x (prefill): a cache-blocked GEMM with the numerics of
// `int_dot.h` (every output bit for bit what `int_dot::rows_i8` / `rows_q4` give, so a row's
// result still never depends on the batch).
//
// The weight goes in strips of kStripRows output channels (2 panels of L = 16 rows on AVX-512,
// 8 on AVX2). A strip is repacked once per call into a scratch buffer (L2-resident: 32 rows x K
// bytes) with its rows interleaved by 4-byte groups: for block j and group i (bytes 4i..4i+3 of
// the block), one vector holds that group of each of the L rows. One vpdpbusd of it with the
// broadcast group i of an x row adds the 4 products of all L rows at once, so after the 8 groups
// of a block each lane holds its row's exact block sum: no horizontal reduction. All rows of x
// then stream through the strip, C at a time (the micro-kernel: 2 panels x C rows of x, 2C
// vectors of int32 block sums in registers).
//
// The float side is the contract of `int_dot.h`, lane by lane: block j's sum (converted to
// float) times d_j (w4a8: times d_j * s_j) is added by a fused multiply-add into partial sum
// j % 16 (kept in memory, one vector per partial, x row and panel), the padding blocks of the
// last group of 16 add +0, and the 16 partials are added as the same tree (p_i + p_(i+8), then
// + 4, + 2, + 1), then times the row scale (w8a8).
//
// vpdpbusd multiplies unsigned bytes (the register operand) by signed bytes (the broadcast x):
// the packed int8 weight is w + 128 (w ^ 0x80) and 128 * sum(q) of the x block is subtracted,
// the packed 4-bit code is c + 8 and 8 * sum(q) is subtracted (both exact in int32). Without
// VNNI (vpmaddubsw + vpmaddwd, whose pair sums saturate at int16) the int8 weight keeps its
// sign: |w| times x with w's sign (at most 128 * 127 * 2 per pair), the 4-bit codes as above.
//
// The generic level has no GEMM (`kAvailable` false): the ops keep `rows_i8` / `rows_q4`. No
// torch header; the ops in `int_dot_linear.cpp` split strips (and rows of x) over the threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "int_dot.h"
#include "vec.h"

namespace vllm_mamba {
namespace int_dot {
namespace gemm {

constexpr int64_t kMinRows = 16;  // rows of x from which the ops take the GEMM
constexpr int kPanels = 2;        // panels of L weight rows per strip

// A packed strip of kPanels * L weight rows: `w` holds, for block j, panel t, group i, lane l,
// the 4 bytes w[((j * kPanels + t) * 8 + i) * L + l]; `ws` (4-bit) the group scales as float32
// at [(j * kPanels + t) * L + l]; `scale` (int8) the row scales at [t * L + l]. Rows past the
// weight's N are zero weights with scale 0 (their outputs are not stored).
struct Strip {
  std::vector<uint32_t> w;
  std::vector<float> ws, scale;
  int64_t index = -1;  // the strip packed here, -1 for none
};

// How the micro-kernel multiplies bytes: vpdpbusd on unsigned (offset) weights, vpmaddubsw +
// vpmaddwd on unsigned 4-bit codes, or on |w| with w's sign moved to x (int8 without VNNI).
enum class Mul { kVnni, kMaddubs, kMaddubsSigned };

#if defined(VLLM_MAMBA_VEC_AVX512) || defined(VLLM_MAMBA_VEC_AVX2)
constexpr bool kAvailable = true;

#if defined(VLLM_MAMBA_VEC_AVX512)

#pragma GCC push_options
#pragma GCC target("avx512vnni")
// The vector operations of the micro-kernel on AVX-512: 16 lanes.
struct Isa {
  static constexpr int L = 16;     // weight rows per panel
  static constexpr int kMaxC = 8;  // rows of x per micro-kernel call
  using I = __m512i;
  using F = __m512;
  struct W {  // a loaded weight vector, ready for `dot`
    I u;      // the unsigned bytes
    __mmask64 neg;  // kMaddubsSigned: the bytes whose weight is negative
  };

  static I zero() { return _mm512_setzero_si512(); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  template <Mul kMul>
  static W load_w(const uint32_t* p) {
    const I v = _mm512_loadu_si512(p);
    if constexpr (kMul == Mul::kMaddubsSigned) return {_mm512_abs_epi8(v), _mm512_movepi8_mask(v)};
    return {v, 0};
  }
  // acc + the sums of 4 products (unsigned w bytes, signed x bytes) per int32 lane
  template <Mul kMul>
  static I dot(I acc, const W& w, I x) {
    if constexpr (kMul == Mul::kVnni) {
      return _mm512_dpbusd_epi32(acc, w.u, x);
    } else {
      if constexpr (kMul == Mul::kMaddubsSigned) {
        x = _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x);
      }
      const I pairs = _mm512_maddubs_epi16(w.u, x);
      return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
    }
  }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store_n(float* p, F v, int n) {  // the first n (0..L) lanes
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

#else  // AVX2

#pragma GCC push_options
#pragma GCC target("avxvnni")
// The vector operations of the micro-kernel on AVX2: 8 lanes.
struct Isa {
  static constexpr int L = 8;
  static constexpr int kMaxC = 4;
  using I = __m256i;
  using F = __m256;
  struct W {
    I u;  // the unsigned bytes
    I s;  // kMaddubsSigned: the signed weight bytes, whose signs move to x
  };

  static I zero() { return _mm256_setzero_si256(); }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  template <Mul kMul>
  static W load_w(const uint32_t* p) {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kMul == Mul::kMaddubsSigned) return {_mm256_abs_epi8(v), v};
    return {v, v};
  }
  template <Mul kMul>
  static I dot(I acc, const W& w, I x) {
    if constexpr (kMul == Mul::kVnni) {
      return _mm256_dpbusd_avx_epi32(acc, w.u, x);
    } else {
      if constexpr (kMul == Mul::kMaddubsSigned) x = _mm256_sign_epi8(x, w.s);
      const I pairs = _mm256_maddubs_epi16(w.u, x);
      return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store_n(float* p, F v, int n) {
    float t[8];
    _mm256_storeu_ps(t, v);
    std::memcpy(p, t, static_cast<size_t>(n) * sizeof(float));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

#endif

constexpr int L = Isa::L;
constexpr int64_t kStripRows = kPanels * L;  // output channels per strip

// The micro-kernel: rows [m0, m0 + C) of x times one packed strip (nb blocks); writes
// out[(m0 + c) * ldo + col] for the strip's first `cols` (1..kStripRows) output channels.
// kQ4: the strip holds 4-bit codes + 8 and group scales, else int8 weights and row scales.
// kShift: what the packed weights add per product (128 for w + 128, 8 for c + 8, or 0).
template <Mul kMul, bool kQ4, int kShift, int C>
void micro(const Strip& s, int64_t nb, const QActs& x, int64_t m0, float* out, int64_t ldo,
           int cols) {
  using I = Isa::I;
  using F = Isa::F;
  constexpr int T = kPanels;
  alignas(64) float part[C][T][kGroup][L];  // the partial sums, x row by panel by j % 16
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < kGroup; ++p) Isa::store(part[c][t][p], Isa::zerof());
  QRow xs[C];
  for (int c = 0; c < C; ++c) xs[c] = x.row(m0 + c);
  for (int64_t j = 0; j < nb; ++j) {
    I acc[T][C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const I init = kShift ? Isa::set1i(-kShift * xs[c].s[j]) : Isa::zero();
#pragma GCC unroll 2
      for (int t = 0; t < T; ++t) acc[t][c] = init;
    }
    const uint32_t* wj = s.w.data() + j * T * 8 * L;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      typename Isa::W w[T];
#pragma GCC unroll 2
      for (int t = 0; t < T; ++t) w[t] = Isa::load_w<kMul>(wj + (t * 8 + i) * L);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const I xb = Isa::bcast4(xs[c].q + j * kBlock + 4 * i);
#pragma GCC unroll 2
        for (int t = 0; t < T; ++t) acc[t][c] = Isa::dot<kMul>(acc[t][c], w[t], xb);
      }
    }
    F ws[T];
    if constexpr (kQ4) {
      for (int t = 0; t < T; ++t) ws[t] = Isa::load(s.ws.data() + (j * T + t) * L);
    }
    const int64_t p = j % kGroup;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const F d = Isa::set1(xs[c].d[j]);
#pragma GCC unroll 2
      for (int t = 0; t < T; ++t) {
        const F sc = kQ4 ? Isa::mul(d, ws[t]) : d;
        float* pp = part[c][t][p];
        Isa::store(pp, Isa::fmadd(Isa::cvt(acc[t][c]), sc, Isa::load(pp)));
      }
    }
  }
  // the padding blocks of the last group of 16: block term +0 (as `rows_i8` / `rows_q4` add)
  const int64_t tail = nb % kGroup == 0 ? kGroup : nb % kGroup;
  for (int c = 0; c < C; ++c) {
    for (int t = 0; t < T; ++t) {
      F v[kGroup];
      for (int p = 0; p < kGroup; ++p) {
        v[p] = Isa::load(part[c][t][p]);
        if (p >= tail) v[p] = Isa::add(v[p], Isa::zerof());
      }
      for (int h = kGroup / 2; h >= 1; h /= 2)  // the fixed tree
        for (int p = 0; p < h; ++p) v[p] = Isa::add(v[p], v[p + h]);
      F r = v[0];
      if constexpr (!kQ4) r = Isa::mul(r, Isa::load(s.scale.data() + t * L));
      const int n = std::clamp(cols - t * L, 0, L);
      float* o = out + (m0 + c) * ldo + t * L;
      if (n == L) {
        Isa::store(o, r);
      } else if (n > 0) {
        Isa::store_n(o, r, n);
      }
    }
  }
}

// Rows [m0, m1) of x times the packed strip: the micro-kernel kMaxC rows at a time, then the
// remaining rows in one call.
template <Mul kMul, bool kQ4, int kShift>
void strip_rows(const Strip& s, int64_t nb, const QActs& x, int64_t m0, int64_t m1, float* out,
                int64_t ldo, int cols) {
  constexpr int CM = Isa::kMaxC;
  int64_t m = m0;
  for (; m + CM <= m1; m += CM) micro<kMul, kQ4, kShift, CM>(s, nb, x, m, out, ldo, cols);
  switch (m1 - m) {
#define VLLM_MAMBA_INT_DOT_TAIL(n)                                         \
  case n:                                                                   \
    if constexpr (n < CM) micro<kMul, kQ4, kShift, n>(s, nb, x, m, out, ldo, cols); \
    break;
    VLLM_MAMBA_INT_DOT_TAIL(1)
    VLLM_MAMBA_INT_DOT_TAIL(2)
    VLLM_MAMBA_INT_DOT_TAIL(3)
    VLLM_MAMBA_INT_DOT_TAIL(4)
    VLLM_MAMBA_INT_DOT_TAIL(5)
    VLLM_MAMBA_INT_DOT_TAIL(6)
    VLLM_MAMBA_INT_DOT_TAIL(7)
#undef VLLM_MAMBA_INT_DOT_TAIL
    default: break;
  }
}
#pragma GCC pop_options

// Packs strip `index` (weight rows [index * kStripRows, +kStripRows) of n) of an int8 weight:
// bytes w ^ 0x80 (= w + 128 unsigned) when `offset`, else w as they are.
inline void pack_i8(const I8Rows& w, int64_t n, int64_t index, bool offset, Strip& s) {
  const int64_t nb = w.k / kBlock;
  const uint32_t flip = offset ? 0x80808080u : 0u;
  s.w.resize(nb * kStripRows * 8);
  s.scale.resize(kStripRows);
  for (int64_t r = 0; r < kStripRows; ++r) {
    const int64_t row = index * kStripRows + r, t = r / L, l = r % L;
    const bool real = row < n;
    s.scale[r] = real ? w.scale[row] : 0.0f;
    const int8_t* src = w.q + (real ? row : 0) * w.k;
    for (int64_t j = 0; j < nb; ++j) {
      uint32_t* dst = s.w.data() + (j * kPanels + t) * 8 * L + l;
      for (int i = 0; i < 8; ++i) {
        uint32_t v = 0;
        if (real) std::memcpy(&v, src + j * kBlock + 4 * i, 4);
        dst[i * L] = v ^ flip;
      }
    }
  }
  s.index = index;
}

// Packs strip `index` of a 4-bit weight: the codes c + 8 (one byte each, in the order of the
// block's 32 activations) and the group scales as float32.
inline void pack_q4(const gemv::Q4Rows& w, int64_t n, int64_t index, Strip& s) {
  const int64_t nb = w.k / kBlock;
  s.w.resize(nb * kStripRows * 8);
  s.ws.resize(nb * kStripRows);
  for (int64_t r = 0; r < kStripRows; ++r) {
    const int64_t row = index * kStripRows + r, t = r / L, l = r % L;
    const bool real = row < n;
    const uint8_t* src = w.q + (real ? row : 0) * (w.k / 2);
    for (int64_t j = 0; j < nb; ++j) {
      s.ws[(j * kPanels + t) * L + l] = real ? vec::f16_to_f32(w.scales[row * nb + j]) : 0.0f;
      uint8_t codes[kBlock];  // byte b: low nibble activation b, high nibble b + 16
      for (int b = 0; b < kBlock / 2; ++b) {
        const uint8_t v = real ? src[j * (kBlock / 2) + b] : 0x88;
        codes[b] = v & 0x0F;
        codes[b + kBlock / 2] = v >> 4;
      }
      uint32_t* dst = s.w.data() + (j * kPanels + t) * 8 * L + l;
      for (int i = 0; i < 8; ++i) std::memcpy(dst + i * L, codes + 4 * i, 4);
    }
  }
  s.index = index;
}

inline int64_t strips(int64_t n) { return (n + kStripRows - 1) / kStripRows; }

// out[b * ldo + r] = the w8a8 product of int8 weight row r and quantised x row b, for the rows
// r of strip `index` (of n) and b in [m0, m1); `s` is the caller's scratch (repacked unless it
// holds this strip already).
inline void strip_i8(const I8Rows& w, int64_t n, const QActs& x, int64_t index, int64_t m0,
                     int64_t m1, float* out, int64_t ldo, Strip& s) {
  const bool vnni = has_vnni();
  if (s.index != index) pack_i8(w, n, index, vnni, s);
  const int64_t nb = w.k / kBlock, col = index * kStripRows;
  const int cols = static_cast<int>(std::min(kStripRows, n - col));
  if (vnni) {
    strip_rows<Mul::kVnni, false, 128>(s, nb, x, m0, m1, out + col, ldo, cols);
  } else {
    strip_rows<Mul::kMaddubsSigned, false, 0>(s, nb, x, m0, m1, out + col, ldo, cols);
  }
}

// The same for a 4-bit weight (`gemv::Q4Rows`): the w4a8 product.
inline void strip_q4(const gemv::Q4Rows& w, int64_t n, const QActs& x, int64_t index,
                     int64_t m0, int64_t m1, float* out, int64_t ldo, Strip& s) {
  if (s.index != index) pack_q4(w, n, index, s);
  const int64_t nb = w.k / kBlock, col = index * kStripRows;
  const int cols = static_cast<int>(std::min(kStripRows, n - col));
  if (has_vnni()) {
    strip_rows<Mul::kVnni, true, 8>(s, nb, x, m0, m1, out + col, ldo, cols);
  } else {
    strip_rows<Mul::kMaddubs, true, 8>(s, nb, x, m0, m1, out + col, ldo, cols);
  }
}

#else  // generic (and NEON): no GEMM, the ops keep rows_i8 / rows_q4

constexpr bool kAvailable = false;
constexpr int64_t kStripRows = 16;
inline int64_t strips(int64_t n) { return (n + kStripRows - 1) / kStripRows; }
inline void strip_i8(const I8Rows&, int64_t, const QActs&, int64_t, int64_t, int64_t, float*,
                     int64_t, Strip&) {}
inline void strip_q4(const gemv::Q4Rows&, int64_t, const QActs&, int64_t, int64_t, int64_t,
                     float*, int64_t, Strip&) {}

#endif

}  // namespace gemm
}  // namespace int_dot
}  // namespace vllm_mamba
