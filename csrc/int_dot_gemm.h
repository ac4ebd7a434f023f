// Integer dot products for many rows of x (prefill): a cache-blocked GEMM with the numerics of
// `int_dot.h` (every output bit for bit what `int_dot::rows_i8` / `rows_q4` give, so a row's
// result still never depends on the batch).
//
// The weight goes in strips of L output channels (16 on AVX-512, 8 on AVX2), read where they
// are stored (`int_dot.h`'s strip layout: interleaved by 4-byte groups, 16 rows; only the last
// rows of a weight, outside a whole stored strip, are gathered into a copy, `Strip`): for
// block j and group i (bytes 4i..4i+3 of the block), one vector holds that group of each of
// the L rows; the micro-kernel offsets int8 bytes (w ^ 0x80) and widens 4-bit codes in
// registers. One vpdpbusd of it with the broadcast group i
// of an x row adds the 4 products of all L rows at once, so after the 8 groups of a block each
// lane holds its row's exact block sum: no horizontal reduction. The strips were repacked into
// a scratch copy per call before (2026-12-07): the same speed at 512 rows of x, but at 32
// rows (a b32 step) the copy cost more than the products (a 160 MiB int8 head: 35 ms a call,
// 119-120 GMAC/s; read in place 242-272; the layer shapes 1.3-2.2x, 128 rows 1.2-1.3x). The
// next block's strips are prefetched while a block is computed (`block_groups`). All rows of x then stream
// through the strips, C at a time, kPair strips side by side (the micro-kernel: C x kPair
// vectors of int32 block sums; on AVX-512 6 rows x 2 strips, so that each broadcast group of
// x feeds two vpdpbusd: 8 rows x 1 strip ran at 290 GMAC/s a thread on a Zen 5, 6 x 2 at
// 330). The rows of x are quantised straight into panels of C rows (`XPanels`), interleaved
// in the order the micro-kernel reads them. A block of strips (about 256 KiB, `block_strips`)
// meets each group of x in turn, so that the x panels are read once per block.
//
// The float side is the contract of `int_dot.h`, lane by lane: block j's sum (converted to
// float) times d_j (w4a8: times d_j * s_j; w4a8_k: times d_j * ds_j, then dm_j * d_j * sum(q)
// subtracted by a second one) is added by a fused multiply-add into partial sum p = j % 16, the padding blocks of the last group of 16 add +0, and the 16 partials are added
// as the same tree (p_i + p_(i+8), then + 4, + 2, + 1), then times the row scale (w8a8). The
// micro-kernel computes the partials in registers two at a time (p and p + 8, whose sum is the
// tree's first level), the pairs in the order 0 4 2 6 1 5 3 7, so that the tree's other levels
// complete as soon as their operands do (a stack of 3 vectors per x row in memory).
//
// vpdpbusd multiplies unsigned bytes (the register operand) by signed bytes (the broadcast x):
// the int8 weight is read as w + 128 (w ^ 0x80) and 128 * sum(q) of the x block is subtracted,
// the stored 4-bit code is c + 8 and 8 * sum(q) is subtracted (both exact in int32). Without
// VNNI (vpmaddubsw + vpmaddwd, whose pair sums saturate at int16) the int8 weight keeps its
// sign: |w| times x with w's sign (at most 128 * 127 * 2 per pair), the 4-bit codes as above.
//
// The generic level has no GEMM (`kAvailable` false): the ops keep `rows_i8` / `rows_q4`. No
// torch header; the ops in `int_dot_linear.cpp` split blocks of strips (and groups of x) over
// the threads. Measured on a 2-core Zen 4 (AVX512-VNNI), M = 512, one thread: 310-350 GOPS
// (the rows path 95-115), 70% of vpdpbusd's peak; the fixed float order costs a cvt and an FMA
// per block and x row (8 vpdpbusd), about 12%.
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

// A strip of L weight rows as the micro-kernel reads it: for block j, its G group vectors
// (G = 8 groups of int8 bytes, or 4 groups of 4-bit codes, two to a byte) at
// w[(j * G + k) * kLanes + l] for lane l < L, the block's 4-bit scales (float16 bits) at
// hs[j * kLanes + l], the int8 row scales at scale[l], the Q4_K-style block scales and mins at
// ds[j * L + l], dm[j * L + l]. A strip in a whole stored strip (`int_dot.h`: kLanes rows) is
// read where it is stored; else (the weight's last rows) its rows are gathered into the
// `own_*` copies, laid out the same (the lanes past the weight's N repeat its last row,
// computed and never stored). The stride kLanes is a constant of the micro-kernel (a runtime
// stride took GPRs it then spilled). Only the Q4_K-style scales are decoded per call.
struct Strip {
  const uint32_t* w = nullptr;
  const uint16_t* hs = nullptr;
  const float* scale = nullptr;
  std::vector<uint32_t> own_w;
  std::vector<uint16_t> own_hs;
  std::vector<float> own_scale, ds, dm;
  int64_t index = -1;  // the strip set up here, -1 for none
};

// How the micro-kernel multiplies bytes: vpdpbusd on unsigned (offset) weights, vpmaddubsw +
// vpmaddwd on unsigned 4-bit codes, or on |w| with w's sign moved to x (int8 without VNNI).
enum class Mul { kVnni, kMaddubs, kMaddubsSigned };

// The weight's layout: int8 with row scales, 4-bit with float16 group scales (Q4_0-style), or
// Q4_K-style 4-bit (block scales and mins from super-blocks, `Q4KRows`).
enum class Fmt { kI8, kQ4, kQ4K };

#if defined(VLLM_MAMBA_VEC_AVX512) || defined(VLLM_MAMBA_VEC_AVX2)
constexpr bool kAvailable = true;

#if defined(VLLM_MAMBA_VEC_AVX512)

#pragma GCC push_options
#pragma GCC target("avx512vnni")
// The vector operations of the micro-kernel on AVX-512: 16 lanes.
struct Isa {
  static constexpr int L = 16;  // weight rows per strip
  static constexpr int C = 6;      // rows of x per micro-kernel
  static constexpr int kPair = 2;  // strips per micro-kernel: 2 C int32 and 2 C float
                                   // accumulators, 2 weight vectors and a broadcast of x
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
  static I loadu(const uint32_t* p) { return _mm512_loadu_si512(p); }
  // a vector of weight bytes, ready for `dot`
  template <Mul kMul>
  static W prep(I v) {
    if constexpr (kMul == Mul::kMaddubsSigned) return {_mm512_abs_epi8(v), _mm512_movepi8_mask(v)};
    return {v, 0};
  }
  static I offset(I v) { return _mm512_xor_si512(v, _mm512_set1_epi32(0x80808080u)); }  // w + 128
  static I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
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
  // kMaddubs (4-bit codes): the int16 pair sums of a block's 8 groups, added in int16
  // (`kCodeSumBound`), then widened into acc once
  static I pairs(I acc16, const W& w, I x) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w.u, x)); }
  static I widen(I acc, I acc16) { return _mm512_add_epi32(acc, _mm512_madd_epi16(acc16, _mm512_set1_epi16(1))); }
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
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // L float16 values (raw bits) widened as `row_q4` does
  static F halves(const uint16_t* h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  }
  // packing: the block scales and mins of lanes [h, h + L) of a whole Q4_K-style super-block
  // (`decode_q4k`), into ds[i * L + l] and dm[i * L + l]
  static void q4k_super(const uint8_t* p, int lanes, int h, float* ds, float* dm) {
    (void)h;  // 0: a GEMM strip is a stored strip
    F vs[kSuper], vm[kSuper];
    decode_q4k(p, lanes, static_cast<__mmask16>((1u << lanes) - 1u), vs, vm);
    for (int i = 0; i < kSuper; ++i) {
      store(ds + i * L, vs[i]);
      store(dm + i * L, vm[i]);
    }
  }
};

#else  // AVX2

#pragma GCC push_options
#pragma GCC target("avxvnni")
// The vector operations of the micro-kernel on AVX2: 8 lanes.
struct Isa {
  static constexpr int L = 8;
  static constexpr int C = 3;      // 3C + 4 of the 16 registers
  static constexpr int kPair = 1;  // one strip per micro-kernel
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
  static I loadu(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <Mul kMul>
  static W prep(I v) {
    if constexpr (kMul == Mul::kMaddubsSigned) return {_mm256_abs_epi8(v), v};
    return {v, v};
  }
  static I offset(I v) { return _mm256_xor_si256(v, _mm256_set1_epi32(0x80808080u)); }
  static I low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
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
  // kMaddubs (4-bit codes): the int16 pair sums of a block's 8 groups, added in int16
  // (`kCodeSumBound`), then widened into acc once
  static I pairs(I acc16, const W& w, I x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w.u, x)); }
  static I widen(I acc, I acc16) { return _mm256_add_epi32(acc, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1))); }
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
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F halves(const uint16_t* h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  }
  static void q4k_super(const uint8_t* p, int lanes, int h, float* ds, float* dm) {
    F vs[kSuper], vm[kSuper];
    decode_q4k(p, lanes, h, L, vs, vm);
    for (int i = 0; i < kSuper; ++i) {
      store(ds + i * L, vs[i]);
      store(dm + i * L, vm[i]);
    }
  }
};

#endif

constexpr int L = Isa::L;
constexpr int C = Isa::C;
constexpr int kPair = Isa::kPair;
constexpr int64_t kStripRows = L;  // output channels per strip

// The pairs of partial sums (p, p + 8) in the order the micro-kernel computes them.
constexpr int kPairOrder[8] = {0, 4, 2, 6, 1, 5, 3, 7};

// The order of a strip's blocks (`slot`), the micro-kernel's: by pair (`kPairOrder`), then
// partial sum p (the pair's first, then + 8), then block (p, p + 16, ...). `f(j, slot)` for
// each block j < nb.
template <typename Fn>
inline void for_each_slot(int64_t nb, Fn&& f) {
  int64_t slot = 0;
  for (int a : kPairOrder)
    for (int64_t p = a; p < kGroup; p += kGroup / 2)
      for (int64_t j = p; j < nb; j += kGroup) f(j, slot++);
}

// The rows of x in groups of C (the last padded with zero rows), each group interleaved by
// block in the micro-kernel's order (`for_each_slot`), so that it reads them in order: for
// group g, the block in position `slot`, row c: codes q[((g * nb + slot) * C + c) * 32 + ...],
// scale d[(g * nb + slot) * C + c], the block's correction corr[...] = -shift * sum(q) (the
// weights' offset times the x codes, `Strip`) and its d * sum(q) in xsum[...] (`x_block_sum`,
// the Q4_K-style min term's factor).
struct XPanels {
  std::vector<int8_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> corr;
  int64_t rows = 0, groups = 0, nb = 0;

  // Sizes the panels for m rows of nb blocks.
  void resize(int64_t m, int64_t nblocks) {
    rows = m;
    nb = nblocks;
    groups = (rows + C - 1) / C;
    q.resize(groups * nb * C * kBlock);
    d.resize(groups * nb * C);
    xsum.resize(groups * nb * C);
    corr.resize(groups * nb * C);
  }
  // Quantises rows [g0 * C, g1 * C) of x (row stride ldx; padding rows past `rows` zero) into
  // their groups, for weights offset by `shift`.
  void fill(const float* x, int64_t ldx, int shift, int64_t g0, int64_t g1) {
    std::vector<int8_t> rq(nb * kBlock);  // one quantised row
    std::vector<float> rd(nb);
    std::vector<int32_t> rs(nb);
    for (int64_t b = g0 * C; b < g1 * C; ++b) {
      const int64_t g = b / C, c = b % C;
      const bool real = b < rows;
      if (real) quantize_row(x + b * ldx, nb * kBlock, rq.data(), rd.data(), rs.data(), nb);
      for_each_slot(nb, [&](int64_t j, int64_t slot) {
        const int64_t at = (g * nb + slot) * C + c;
        if (real) {
          std::memcpy(q.data() + at * kBlock, rq.data() + j * kBlock, kBlock);
        } else {
          std::memset(q.data() + at * kBlock, 0, kBlock);
        }
        d[at] = real ? rd[j] : 0.0f;
        xsum[at] = real ? x_block_sum(QRow{rq.data(), rd.data(), rs.data()}, j) : 0.0f;
        corr[at] = real ? -shift * rs[j] : 0;
      });
    }
  }
  // The same from rows already quantised: panel row b is row `rows_of[b]` of `src` (the same
  // bits `fill` gives from that row's floats), for groups [g0, g1).
  void fill_from(const QActs& src, const int64_t* rows_of, int shift, int64_t g0, int64_t g1) {
    for (int64_t b = g0 * C; b < g1 * C; ++b) {
      const int64_t g = b / C, c = b % C;
      const bool real = b < rows;
      const QRow r = real ? src.row(rows_of[b]) : QRow{nullptr, nullptr, nullptr};
      for_each_slot(nb, [&](int64_t j, int64_t slot) {
        const int64_t at = (g * nb + slot) * C + c;
        if (real) {
          std::memcpy(q.data() + at * kBlock, r.q + j * kBlock, kBlock);
        } else {
          std::memset(q.data() + at * kBlock, 0, kBlock);
        }
        d[at] = real ? r.d[j] : 0.0f;
        xsum[at] = real ? x_block_sum(r, j) : 0.0f;
        corr[at] = real ? -shift * r.s[j] : 0;
      });
    }
  }
};

// The micro-kernel: x group g (its first `rows` rows real) times S strips side by side (each
// broadcast group of x feeds S vpdpbusd); writes out[(g * C + c) * ldo + i * L + l] for
// c < rows, strip i < S, and the strips' first `cols` (1..S L) channels. kFmt: the strips hold
// int8 weights and row scales (offset here by w ^ 0x80 for vpdpbusd), 4-bit codes + 8 and
// group scales (kQ4), or 4-bit codes with block scales and mins (kQ4K), the codes widened to
// bytes here (the low nibbles of a group vector are x group k, the high ones group k + 4).
// kCorr: the weights are offset (the x panels hold the corrections), else not
// (kMaddubsSigned, kQ4K). Each lane's sums are the same whatever S.
template <Mul kMul, Fmt kFmt, bool kCorr, int S>
void micro(const Strip* const* s, const XPanels& x, int64_t g, int rows, float* out,
           int64_t ldo, int cols) {
  using I = Isa::I;
  using F = Isa::F;
  const int64_t nb = x.nb;
  const int64_t tail = nb % kGroup == 0 ? kGroup : nb % kGroup;  // partials p >= tail: + 0
  constexpr bool kQ4 = kFmt != Fmt::kI8;
  constexpr int kG = kQ4 ? 4 : 8;  // group vectors per block
  // the x group's blocks, in order (`for_each_slot`)
  const int8_t* xj = x.q.data() + g * nb * C * kBlock;
  const float* xd = x.d.data() + g * nb * C;
  const float* xsm = x.xsum.data() + g * nb * C;
  const int32_t* xc = x.corr.data() + g * nb * C;
  // f (C x S vectors) = partial sum p: blocks p, p + 16, ... (the x panels' next in order)
  auto chain = [&](int64_t p, F (*f)[S]) __attribute__((always_inline)) {
    const uint32_t* wj[S];  // block j's group vectors of strip i
    const uint16_t* hj[S];
    const float* dsj[S];
    const float* dmj[S];
    for (int i = 0; i < S; ++i) {
      wj[i] = s[i]->w + p * kG * kLanes;
      if constexpr (kFmt == Fmt::kQ4) hj[i] = s[i]->hs + p * kLanes;
      if constexpr (kFmt == Fmt::kQ4K) {
        dsj[i] = s[i]->ds.data() + p * L;
        dmj[i] = s[i]->dm.data() + p * L;
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < S; ++i) f[c][i] = Isa::zerof();
    for (int64_t j = p; j < nb; j += kGroup, xj += C * kBlock, xd += C, xsm += C, xc += C) {
      I acc[C][S];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < S; ++i) acc[c][i] = kCorr ? Isa::set1i(xc[c]) : Isa::zero();
      if constexpr (kQ4) {
        // 4 group vectors of nibbles: x groups k (low nibbles) and k + 4 (high)
        I acc16[C][S];
        if constexpr (kMul == Mul::kMaddubs) {
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c)
            for (int i = 0; i < S; ++i) acc16[c][i] = Isa::zero();
        }
#pragma GCC unroll 8
        for (int h = 0; h < 8; ++h) {  // the low nibbles of group vector h, then the high ones
          const int k = h % 4;
          typename Isa::W w[S];
          for (int i = 0; i < S; ++i) {
            const I v = Isa::loadu(wj[i] + k * kLanes);
            w[i] = Isa::prep<kMul>(h < 4 ? Isa::low4(v) : Isa::high4(v));
          }
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const I xb = Isa::bcast4(xj + c * kBlock + 4 * (k + (h < 4 ? 0 : 4)));
            for (int i = 0; i < S; ++i) {
              if constexpr (kMul == Mul::kMaddubs) {
                acc16[c][i] = Isa::pairs(acc16[c][i], w[i], xb);
              } else {
                acc[c][i] = Isa::dot<kMul>(acc[c][i], w[i], xb);
              }
            }
          }
        }
        if constexpr (kMul == Mul::kMaddubs) {
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c)
            for (int i = 0; i < S; ++i) acc[c][i] = Isa::widen(acc[c][i], acc16[c][i]);
        }
      } else {
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          typename Isa::W w[S];
          for (int i = 0; i < S; ++i) {
            const I v = Isa::loadu(wj[i] + k * kLanes);
            w[i] = Isa::prep<kMul>(kMul == Mul::kVnni ? Isa::offset(v) : v);
          }
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const I xb = Isa::bcast4(xj + c * kBlock + 4 * k);
            for (int i = 0; i < S; ++i) acc[c][i] = Isa::dot<kMul>(acc[c][i], w[i], xb);
          }
        }
      }
      F ws[S], wm[S];
      for (int i = 0; i < S; ++i) {
        if constexpr (kFmt == Fmt::kQ4) {
          ws[i] = Isa::halves(hj[i]);
          hj[i] += kGroup * kLanes;
        }
        if constexpr (kFmt == Fmt::kQ4K) {
          ws[i] = Isa::load(dsj[i]);
          wm[i] = Isa::load(dmj[i]);
          dsj[i] += kGroup * L;
          dmj[i] += kGroup * L;
        }
        wj[i] += kGroup * kG * kLanes;
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const F d = Isa::set1(xd[c]);
        for (int i = 0; i < S; ++i) {
          const F sc = kQ4 ? Isa::mul(d, ws[i]) : d;
          f[c][i] = Isa::fmadd(Isa::cvt(acc[c][i]), sc, f[c][i]);
          if constexpr (kFmt == Fmt::kQ4K) f[c][i] = Isa::fnmadd(wm[i], Isa::set1(xsm[c]), f[c][i]);
        }
      }
    }
    if (p >= tail) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < S; ++i) f[c][i] = Isa::add(f[c][i], Isa::zerof());
    }
  };
  alignas(64) float stack[3][C][S][L];  // the tree's pending sums of levels 2, 3, 4
  alignas(64) float low[C][S][L];       // a pair's first partial while the second runs
  for (int k = 0; k < kGroup / 2; ++k) {
    F part[C][S];
    chain(kPairOrder[k], part);
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < S; ++i) Isa::store(low[c][i], part[c][i]);
    chain(kPairOrder[k] + kGroup / 2, part);
    // the tree: level 1 (p + (p + 8)) here, levels 2, 3, 4 with the pending sums
    int level = 0;
    while (level < 3 && (k >> level & 1)) ++level;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      for (int i = 0; i < S; ++i) {
        F v = Isa::add(Isa::load(low[c][i]), part[c][i]);
        for (int e = 0; e < level; ++e) v = Isa::add(Isa::load(stack[e][c][i]), v);
        if (level < 3) {
          Isa::store(stack[level][c][i], v);
        } else if (c < rows && i * L < cols) {
          if constexpr (kFmt == Fmt::kI8) v = Isa::mul(v, Isa::load(s[i]->scale));
          float* o = out + (g * C + c) * ldo + i * L;
          if (cols - i * L >= L) {
            Isa::store(o, v);
          } else {
            Isa::store_n(o, v, cols - i * L);
          }
        }
      }
    }
  }
}

// Weight bytes to prefetch while a block of strips is computed.
struct Span {
  const uint8_t* p = nullptr;
  int64_t bytes = 0;
};

// x groups [g0, g1) times the strips [s0, s1) of n output channels (`s[i]`: strip s0 + i), a
// group at a time against every strip of the block, kPair strips a call. The bytes of `ahead`
// (the next block's strips, `Next`) are prefetched into L2 over the first half of the groups:
// read in the micro-kernel's block order, a strip is 16 short streams the hardware prefetchers
// follow poorly, and the first group of each block waited on memory.
template <Mul kMul, Fmt kFmt, bool kCorr>
void block_groups(const std::vector<Strip>& s, int64_t s0, int64_t s1, int64_t n,
                  const XPanels& x, int64_t g0, int64_t g1, float* out, int64_t ldo,
                  const Span (&ahead)[2]) {
  const int64_t lines0 = (ahead[0].bytes + 63) / 64, lines = lines0 + (ahead[1].bytes + 63) / 64;
  const int64_t per = (lines + std::max<int64_t>(1, (g1 - g0) / 2) - 1) /
                      std::max<int64_t>(1, (g1 - g0) / 2);  // lines per group
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t e = (g - g0) * per, end = std::min(lines, e + per); e < end; ++e)
      vec::prefetch_l2(e < lines0 ? ahead[0].p + e * 64 : ahead[1].p + (e - lines0) * 64);
    const int rows = static_cast<int>(std::min<int64_t>(C, x.rows - g * C));
    int64_t i = s0;
    for (; i + kPair <= s1; i += kPair) {
      const Strip* st[kPair];
      for (int p = 0; p < kPair; ++p) st[p] = &s[i - s0 + p];
      const int cols = static_cast<int>(std::min<int64_t>(kPair * L, n - i * L));
      micro<kMul, kFmt, kCorr, kPair>(st, x, g, rows, out + i * L, ldo, cols);
    }
    for (; i < s1; ++i) {
      const Strip* st[1] = {&s[i - s0]};
      const int cols = static_cast<int>(std::min<int64_t>(L, n - i * L));
      micro<kMul, kFmt, kCorr, 1>(st, x, g, rows, out + i * L, ldo, cols);
    }
  }
}
#pragma GCC pop_options

// The weight rows of strip `index` (of n): row index * L + l, or the last row for the lanes
// past n (computed, never stored).
inline void strip_rows_of(int64_t n, int64_t index, int64_t (&rows)[L]) {
  for (int l = 0; l < L; ++l) rows[l] = std::min(index * L + l, n - 1);
}

// Where strip `index` (of n rows) lies in the stored strip layout (`int_dot.h`): stored strip
// `st` of `lanes` rows, from lane h; `whole` when that strip has kLanes rows (then it is read
// in place), else its rows are gathered (`set_strip`).
struct Place {
  int64_t st;
  int lanes, h;
  bool whole;
};

inline Place place_of(int64_t n, int64_t index) {
  const int64_t r0 = index * L, st = r0 / kLanes;
  const int lanes = strip_lanes(n, st), h = static_cast<int>(r0 % kLanes);
  return {st, lanes, h, lanes == kLanes};
}

// Points s at strip `index` of a weight stored with `row_bytes` bytes per row (its group
// vectors; `hs`: 4-bit block scales, null for none), gathering the strip's rows into s's own
// copies where they are not all in one stored strip.
inline void set_strip(const void* base, int64_t row_bytes, const uint16_t* scales, int64_t n,
                      int64_t index, Strip& s) {
  const Place at = place_of(n, index);
  const int64_t groups = row_bytes / 4, nb = row_bytes * 2 / kBlock;  // nb: 4-bit blocks
  s.index = index;
  if (at.whole) {
    s.w = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(base) +
                                            at.st * kLanes * row_bytes) + at.h;
    s.hs = scales ? scales + at.st * kLanes * nb + at.h : nullptr;
    return;
  }
  int64_t rows[L];
  strip_rows_of(n, index, rows);
  s.own_w.assign(groups * kLanes, 0u);
  for (int64_t g = 0; g < groups; ++g) {
    for (int l = 0; l < L; ++l) {
      const int64_t r = rows[l], sr = r / kLanes;
      std::memcpy(&s.own_w[g * kLanes + l],
                  static_cast<const uint8_t*>(base) + sr * kLanes * row_bytes +
                      (g * strip_lanes(n, sr) + r % kLanes) * 4,
                  4);
    }
  }
  s.w = s.own_w.data();
  s.hs = nullptr;
  if (scales) {
    s.own_hs.assign(nb * kLanes, 0);
    for (int64_t j = 0; j < nb; ++j) {
      for (int l = 0; l < L; ++l) {
        const int64_t r = rows[l], sr = r / kLanes;
        s.own_hs[j * kLanes + l] = scales[sr * kLanes * nb + j * strip_lanes(n, sr) + r % kLanes];
      }
    }
    s.hs = s.own_hs.data();
  }
}

// Strip `index` of an int8 weight: its bytes and row scales.
inline void pack_i8(const I8Rows& w, int64_t n, int64_t index, Strip& s) {
  set_strip(w.q, w.k, nullptr, n, index, s);
  if (place_of(n, index).whole) {
    s.scale = w.scale + index * L;
    return;
  }
  int64_t rows[L];
  strip_rows_of(n, index, rows);
  s.own_scale.resize(L);
  for (int l = 0; l < L; ++l) s.own_scale[l] = w.scale[rows[l]];
  s.scale = s.own_scale.data();
}

// Strip `index` of a Q4_0-style weight: its codes and block scales.
inline void pack_q4(const Q4Rows& w, int64_t n, int64_t index, Strip& s) {
  set_strip(w.q, w.k / 2, w.scales, n, index, s);
}

// Strip `index` of a Q4_K-style weight: its codes, and the block scales d * sc into `ds` and
// the mins dmin * m into `dm`, decoded a super-block at a time for L rows of one stored strip
// (`Isa::q4k_super`; a decode per block and lane cost as much as the products of a 32-row
// call), else lane by lane (`q4k_lane_scales`, the same exact values).
inline void pack_q4k(const Q4KRows& w, int64_t n, int64_t index, Strip& s) {
  const int64_t nb = w.k / kBlock, ns = super_blocks(w.k), sbytes = ns * kSuperBytes;
  set_strip(w.q, w.k / 2, nullptr, n, index, s);
  s.ds.resize(ns * kSuper * L);  // block j's at [j * L, j * L + L)
  s.dm.resize(ns * kSuper * L);
  const Place at = place_of(n, index);
  if (at.whole) {
    const uint8_t* strip = w.scales + at.st * kLanes * sbytes;
    for (int64_t t = 0; t < ns; ++t) {
      Isa::q4k_super(strip + t * kSuperBytes * at.lanes, at.lanes, at.h,
                     s.ds.data() + t * kSuper * L, s.dm.data() + t * kSuper * L);
    }
    return;
  }
  int64_t rows[L];
  strip_rows_of(n, index, rows);
  for (int64_t j = 0; j < nb; ++j) {
    for (int l = 0; l < L; ++l) {
      const int64_t r = rows[l], sr = r / kLanes;
      const int lr = strip_lanes(n, sr);
      const uint8_t* p = w.scales + sr * kLanes * sbytes + j / kSuper * kSuperBytes * lr;
      q4k_lane_scales(p, lr, static_cast<int>(r % kLanes), static_cast<int>(j % kSuper),
                      s.ds[j * L + l], s.dm[j * L + l]);
    }
  }
}

inline int64_t strips(int64_t n) { return (n + kStripRows - 1) / kStripRows; }

// What the packed weights add per product: 128 (int8 with VNNI: w + 128), 0 (int8 without),
// 8 (4-bit codes c + 8); the x panels' corrections are -shift * sum(q).
inline int i8_shift() { return has_vnni() ? 128 : 0; }
constexpr int kQ4Shift = 8;

// Strips per block (`block_i8` / `block_q4`) for K input features, a multiple of kPair (the
// strips a micro-kernel reads side by side): as many as about 256 KiB of L2 hold (up to 8), so
// that a group of x is read from memory once per block instead of once per strip; with one
// strip a call, 1 while a strip (L * K bytes) stays in L1 beside a group of x (on a Zen 5 at
// the AVX2 level: 251-252 GMAC/s over the layer shapes against 238-243 with L2 blocks, where
// the AVX-512 pairs ran 317-321 with L2 blocks against 278-280 with one pair a block).
inline int64_t block_strips(int64_t k) {
  const int64_t bytes = L * k;
  const bool l1 = kPair == 1 && bytes <= (24 << 10);
  const int64_t n = l1 ? 1 : std::clamp<int64_t>((256 << 10) / bytes, 1, 8);
  return std::max<int64_t>(kPair, n / kPair * kPair);
}

// The strips [s0, s1) of the next block a thread computes (`block_groups` prefetches them);
// s0 == s1: none.
struct Next {
  int64_t s0 = 0, s1 = 0;
};

// The bytes of strips [next.s0, next.s1) in an array of n rows of `row_bytes` bytes stored in
// the strip layout (whole stored strips lie one after another).
inline Span span_of(const void* base, int64_t row_bytes, int64_t n, const Next& next) {
  if (next.s0 >= next.s1) return {};
  const int64_t r0 = next.s0 * L / kLanes * kLanes;
  const int64_t r1 = std::min(n, (next.s1 * L + kLanes - 1) / kLanes * kLanes);
  return {static_cast<const uint8_t*>(base) + r0 * row_bytes, (r1 - r0) * row_bytes};
}

// out[b * ldo + r] = the w8a8 product of int8 weight row r and quantised x row b, for the rows
// r of strips [s0, s1) (of n rows) and the rows b of x groups [g0, g1) (`XPanels` built with
// `i8_shift()`); `s` is the caller's scratch, strip s0 + i in s[i] (set up unless it holds
// that strip already).
inline void block_i8(const I8Rows& w, int64_t n, const XPanels& x, int64_t s0, int64_t s1,
                     int64_t g0, int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s,
                     const Next& next) {
  if (static_cast<int64_t>(s.size()) < s1 - s0) s.resize(s1 - s0);
  for (int64_t i = s0; i < s1; ++i)
    if (s[i - s0].index != i) pack_i8(w, n, i, s[i - s0]);
  const Span ahead[2] = {span_of(w.q, w.k, n, next), {}};
  if (has_vnni()) {
    block_groups<Mul::kVnni, Fmt::kI8, true>(s, s0, s1, n, x, g0, g1, out, ldo, ahead);
  } else {
    block_groups<Mul::kMaddubsSigned, Fmt::kI8, false>(s, s0, s1, n, x, g0, g1, out, ldo, ahead);
  }
}

// The same for a 4-bit weight: strips [s0, s1) set up by `pack(i, strip)` where `s` does not
// hold them yet, then multiplied as kFmt (kCorr: the x panels hold the codes' offset).
template <Fmt kFmt, bool kCorr, typename Pack>
inline void block_4bit(int64_t n, const XPanels& x, int64_t s0, int64_t s1, int64_t g0,
                       int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s,
                       const Span (&ahead)[2], Pack&& pack) {
  if (static_cast<int64_t>(s.size()) < s1 - s0) s.resize(s1 - s0);
  for (int64_t i = s0; i < s1; ++i)
    if (s[i - s0].index != i) pack(i, s[i - s0]);
  if (has_vnni()) {
    block_groups<Mul::kVnni, kFmt, kCorr>(s, s0, s1, n, x, g0, g1, out, ldo, ahead);
  } else {
    block_groups<Mul::kMaddubs, kFmt, kCorr>(s, s0, s1, n, x, g0, g1, out, ldo, ahead);
  }
}

// A Q4_0-style weight (`Q4Rows`, `XPanels` built with kQ4Shift): the w4a8 product.
inline void block_q4(const Q4Rows& w, int64_t n, const XPanels& x, int64_t s0, int64_t s1,
                     int64_t g0, int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s,
                     const Next& next) {
  const Span ahead[2] = {span_of(w.q, w.k / 2, n, next),
                         span_of(w.scales, w.k / kBlock * 2, n, next)};
  block_4bit<Fmt::kQ4, true>(n, x, s0, s1, g0, g1, out, ldo, s, ahead,
                             [&](int64_t i, Strip& st) { pack_q4(w, n, i, st); });
}

// A Q4_K-style weight (`Q4KRows`, `XPanels` built with shift 0): the w4a8_k product.
inline void block_q4k(const Q4KRows& w, int64_t n, const XPanels& x, int64_t s0, int64_t s1,
                      int64_t g0, int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s,
                      const Next& next) {
  const Span ahead[2] = {span_of(w.q, w.k / 2, n, next),
                         span_of(w.scales, super_blocks(w.k) * kSuperBytes, n, next)};
  block_4bit<Fmt::kQ4K, false>(n, x, s0, s1, g0, g1, out, ldo, s, ahead,
                               [&](int64_t i, Strip& st) { pack_q4k(w, n, i, st); });
}

#else  // generic (and NEON): no GEMM, the ops keep rows_i8 / rows_q4

constexpr bool kAvailable = false;
constexpr int C = 1;
constexpr int64_t kStripRows = 16;
struct XPanels {
  int64_t groups = 0;
  void resize(int64_t, int64_t) {}
  void fill(const float*, int64_t, int, int64_t, int64_t) {}
  void fill_from(const QActs&, const int64_t*, int, int64_t, int64_t) {}
};
inline int64_t strips(int64_t n) { return (n + kStripRows - 1) / kStripRows; }
inline int64_t block_strips(int64_t) { return 1; }
inline int i8_shift() { return 0; }
constexpr int kQ4Shift = 8;
struct Next {
  int64_t s0 = 0, s1 = 0;
};
inline void block_i8(const I8Rows&, int64_t, const XPanels&, int64_t, int64_t, int64_t, int64_t,
                     float*, int64_t, std::vector<Strip>&, const Next&) {}
inline void block_q4(const Q4Rows&, int64_t, const XPanels&, int64_t, int64_t, int64_t,
                     int64_t, float*, int64_t, std::vector<Strip>&, const Next&) {}
inline void block_q4k(const Q4KRows&, int64_t, const XPanels&, int64_t, int64_t, int64_t,
                      int64_t, float*, int64_t, std::vector<Strip>&, const Next&) {}

#endif

}  // namespace gemm
}  // namespace int_dot
}  // namespace vllm_mamba
