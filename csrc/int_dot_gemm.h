// Integer dot products for many rows of x (prefill): a cache-blocked GEMM with the numerics of
// `int_dot.h` (every output bit for bit what `int_dot::rows_i8` / `rows_q4` give, so a row's
// result still never depends on the batch).
//
// The weight goes in strips of L output channels (16 on AVX-512, 8 on AVX2). A strip is
// repacked once per call from the stored strip layout (`int_dot.h`: already interleaved by
// 4-byte groups, 16 rows) into a scratch buffer (L1 / L2-resident: L rows x K bytes), with the
// weights offset, the 4-bit codes widened to bytes and the blocks in the micro-kernel's order:
// for block j and group i (bytes 4i..4i+3 of the block), one
// vector holds that group of each of the L rows. One vpdpbusd of it with the broadcast group i
// of an x row adds the 4 products of all L rows at once, so after the 8 groups of a block each
// lane holds its row's exact block sum: no horizontal reduction. All rows of x then stream
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
// the packed int8 weight is w + 128 (w ^ 0x80) and 128 * sum(q) of the x block is subtracted,
// the packed 4-bit code is c + 8 and 8 * sum(q) is subtracted (both exact in int32). Without
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

// A packed strip of L weight rows: `w` holds, for the block in position `slot` (`for_each_slot`),
// group i and lane l, the 4 bytes w[(slot * 8 + i) * L + l]; `ws` (4-bit) the group scales as
// float32 at [slot * L + l] (Q4_K-style: d * sc, and `wm` the mins dmin * m); `scale` (int8)
// the row scales at [l]. The lanes past the weight's N repeat its last row (computed, never
// stored).
struct Strip {
  std::vector<uint32_t> w;
  std::vector<float> ws, wm, scale;
  int64_t index = -1;  // the strip packed here, -1 for none
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
  // packing: L float16 values (raw bits) widened as `row_q4` does
  static void halves(const uint16_t* h, float* out) {
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
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
  static void halves(const uint16_t* h, float* out) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
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
};

// The micro-kernel: x group g (its first `rows` rows real) times S packed strips side by side
// (each broadcast group of x feeds S vpdpbusd); writes out[(g * C + c) * ldo + i * L + l] for
// c < rows, strip i < S, and the strips' first `cols` (1..S L) channels. kFmt: the strips hold
// int8 weights and row scales, 4-bit codes + 8 and group scales (kQ4), or 4-bit codes with
// block scales and mins (kQ4K). kCorr: the weights are offset (the x panels hold the
// corrections), else not (kMaddubsSigned, kQ4K). Each lane's sums are the same whatever S.
template <Mul kMul, Fmt kFmt, bool kCorr, int S>
void micro(const Strip* const* s, const XPanels& x, int64_t g, int rows, float* out,
           int64_t ldo, int cols) {
  using I = Isa::I;
  using F = Isa::F;
  const int64_t nb = x.nb;
  const int64_t tail = nb % kGroup == 0 ? kGroup : nb % kGroup;  // partials p >= tail: + 0
  // the strips' and the x group's blocks, in order (`for_each_slot`)
  constexpr bool kQ4 = kFmt != Fmt::kI8;
  const uint32_t* wj[S];
  const float* wsj[S];
  const float* wmj[S];
  for (int i = 0; i < S; ++i) {
    wj[i] = s[i]->w.data();
    wsj[i] = s[i]->ws.data();
    wmj[i] = s[i]->wm.data();
  }
  const int8_t* xj = x.q.data() + g * nb * C * kBlock;
  const float* xd = x.d.data() + g * nb * C;
  const float* xsm = x.xsum.data() + g * nb * C;
  const int32_t* xc = x.corr.data() + g * nb * C;
  // f (C x S vectors) = partial sum p: blocks p, p + 16, ... (the next in order)
  auto chain = [&](int64_t p, F (*f)[S]) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < S; ++i) f[c][i] = Isa::zerof();
    for (int64_t j = p; j < nb; j += kGroup, xj += C * kBlock, xd += C, xsm += C, xc += C) {
      I acc[C][S];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < S; ++i) acc[c][i] = kCorr ? Isa::set1i(xc[c]) : Isa::zero();
      if constexpr (kMul == Mul::kMaddubs) {
        I acc16[C][S];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          for (int i = 0; i < S; ++i) acc16[c][i] = Isa::zero();
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          typename Isa::W w[S];
          for (int i = 0; i < S; ++i) w[i] = Isa::load_w<kMul>(wj[i] + k * L);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const I xb = Isa::bcast4(xj + c * kBlock + 4 * k);
            for (int i = 0; i < S; ++i) acc16[c][i] = Isa::pairs(acc16[c][i], w[i], xb);
          }
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          for (int i = 0; i < S; ++i) acc[c][i] = Isa::widen(acc[c][i], acc16[c][i]);
      } else {
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          typename Isa::W w[S];
          for (int i = 0; i < S; ++i) w[i] = Isa::load_w<kMul>(wj[i] + k * L);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const I xb = Isa::bcast4(xj + c * kBlock + 4 * k);
            for (int i = 0; i < S; ++i) acc[c][i] = Isa::dot<kMul>(acc[c][i], w[i], xb);
          }
        }
      }
      F ws[S], wm[S];
      for (int i = 0; i < S; ++i) {
        if constexpr (kQ4) ws[i] = Isa::load(wsj[i]);
        if constexpr (kFmt == Fmt::kQ4K) wm[i] = Isa::load(wmj[i]);
        wj[i] += 8 * L;
        wsj[i] += L;
        wmj[i] += L;
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
          if constexpr (kFmt == Fmt::kI8) v = Isa::mul(v, Isa::load(s[i]->scale.data()));
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

// x groups [g0, g1) times the packed strips [s0, s1) of n output channels (`s[i]`: strip
// s0 + i), a group at a time against every strip of the block, kPair strips a call.
template <Mul kMul, Fmt kFmt, bool kCorr>
void block_groups(const std::vector<Strip>& s, int64_t s0, int64_t s1, int64_t n,
                  const XPanels& x, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  for (int64_t g = g0; g < g1; ++g) {
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

// The 4-byte group g of weight row r, stored in the strip layout (`int_dot.h`) with
// `row_bytes` bytes per row.
inline uint32_t stored_group(const void* base, int64_t row_bytes, int64_t n, int64_t r,
                             int64_t g) {
  const int64_t st = r / kLanes;
  const int lanes = strip_lanes(n, st);
  uint32_t v;
  std::memcpy(&v,
              static_cast<const uint8_t*>(base) + st * kLanes * row_bytes +
                  (g * lanes + r % kLanes) * 4,
              4);
  return v;
}

// Groups [g * 8, g * 8 + 8) of the L rows of this strip, from the stored strip layout, into
// dst[i * L + l] (each XORed with `flip`). Rows past n repeat the last row.
inline void gather_groups(const void* base, int64_t row_bytes, int64_t n, const int64_t (&rows)[L],
                          int64_t g0, int count, uint32_t flip, uint32_t* dst) {
  const int64_t st = rows[0] / kLanes;
  const bool whole = strip_lanes(n, st) == kLanes && rows[L - 1] == rows[0] + L - 1;
  if (whole) {  // the L rows' groups are contiguous: one copy per group
    const uint8_t* src = static_cast<const uint8_t*>(base) + st * kLanes * row_bytes +
                         (rows[0] % kLanes) * 4;
    for (int i = 0; i < count; ++i) {
      std::memcpy(dst + i * L, src + (g0 + i) * kLanes * 4, L * 4);
      for (int l = 0; l < L; ++l) dst[i * L + l] ^= flip;
    }
    return;
  }
  for (int i = 0; i < count; ++i)
    for (int l = 0; l < L; ++l) dst[i * L + l] = stored_group(base, row_bytes, n, rows[l], g0 + i) ^ flip;
}

// Packs strip `index` (weight rows [index * L, index * L + L) of n) of an int8 weight: bytes
// w ^ 0x80 (= w + 128 unsigned) when `offset`, else w as they are.
inline void pack_i8(const I8Rows& w, int64_t n, int64_t index, bool offset, Strip& s) {
  const int64_t nb = w.k / kBlock;
  s.w.resize(nb * L * 8);
  s.scale.resize(L);
  int64_t rows[L];
  strip_rows_of(n, index, rows);
  for (int l = 0; l < L; ++l) s.scale[l] = w.scale[rows[l]];
  const uint32_t flip = offset ? 0x80808080u : 0u;
  for_each_slot(nb, [&](int64_t j, int64_t slot) {
    gather_groups(w.q, w.k, n, rows, j * 8, 8, flip, s.w.data() + slot * 8 * L);
  });
  s.index = index;
}

// Packs strip `index` of a 4-bit weight: the codes c + 8 (one byte each, in the order of the
// block's 32 activations: stored byte i of a block holds activation i in its low nibble, i + 16
// in its high one) and the group scales as float32.
// The 4-bit codes of block j of the L rows `rows` (k columns, of n), one byte each in the order
// of the block's 32 activations, into dst[i * L + l] for the 8 groups i.
inline void pack_nibbles(const uint8_t* q, int64_t k, int64_t n, const int64_t (&rows)[L],
                         int64_t j, uint32_t* dst) {
  gather_groups(q, k / 2, n, rows, j * 4, 4, 0u, dst);
  for (int i = 0; i < 4; ++i) {
    for (int l = 0; l < L; ++l) {
      const uint32_t v = dst[i * L + l];
      dst[i * L + l] = v & 0x0F0F0F0Fu;
      dst[(i + 4) * L + l] = (v >> 4) & 0x0F0F0F0Fu;
    }
  }
}

inline void pack_q4(const Q4Rows& w, int64_t n, int64_t index, Strip& s) {
  const int64_t nb = w.k / kBlock;
  s.w.resize(nb * L * 8);
  s.ws.resize(nb * L);
  int64_t rows[L];
  strip_rows_of(n, index, rows);
  const int64_t st = rows[0] / kLanes;
  const int lanes = strip_lanes(n, st);
  const int64_t h = rows[0] % kLanes;
  // L rows of one stored strip: each block's L scales lie together
  const bool whole = rows[L - 1] == rows[0] + L - 1 && h + L <= lanes;
  for_each_slot(nb, [&](int64_t j, int64_t slot) {
    pack_nibbles(w.q, w.k, n, rows, j, s.w.data() + slot * 8 * L);
    if (whole) {
      Isa::halves(w.scales + st * kLanes * nb + j * lanes + h, s.ws.data() + slot * L);
      return;
    }
    alignas(32) uint16_t hs[L];
    for (int l = 0; l < L; ++l) {
      const int64_t r = rows[l], sr = r / kLanes;
      hs[l] = w.scales[sr * kLanes * nb + j * strip_lanes(n, sr) + r % kLanes];
    }
    Isa::halves(hs, s.ws.data() + slot * L);
  });
  s.index = index;
}

// Packs strip `index` of a Q4_K-style weight: the codes as `pack_q4`'s (without an offset),
// the block scales d * sc into `ws` and the mins dmin * m into `wm`: decoded a super-block at
// a time for L consecutive rows of one stored strip (`Isa::q4k_super`; a decode per block and
// lane cost as much as the products of a 32-row call), else lane by lane (`q4k_lane_scales`,
// the same exact values).
inline void pack_q4k(const Q4KRows& w, int64_t n, int64_t index, Strip& s) {
  const int64_t nb = w.k / kBlock, ns = super_blocks(w.k), sbytes = ns * kSuperBytes;
  s.w.resize(nb * L * 8);
  s.ws.resize(nb * L);
  s.wm.resize(nb * L);
  int64_t rows[L];
  strip_rows_of(n, index, rows);
  static thread_local std::vector<float> ds, dm;  // block j's at [j * L, j * L + L)
  ds.resize(ns * kSuper * L);
  dm.resize(ns * kSuper * L);
  const int64_t st = rows[0] / kLanes;
  const int lanes = strip_lanes(n, st);
  const int h = static_cast<int>(rows[0] % kLanes);
  const uint8_t* strip = w.scales + st * kLanes * sbytes;
  if (rows[L - 1] == rows[0] + L - 1 && h + L <= lanes) {  // L rows of one stored strip
    for (int64_t t = 0; t < ns; ++t) {
      Isa::q4k_super(strip + t * kSuperBytes * lanes, lanes, h, ds.data() + t * kSuper * L,
                     dm.data() + t * kSuper * L);
    }
  } else {
    for (int64_t j = 0; j < nb; ++j) {
      for (int l = 0; l < L; ++l) {
        const int64_t r = rows[l], sr = r / kLanes;
        const int lr = strip_lanes(n, sr);
        const uint8_t* p = w.scales + sr * kLanes * sbytes + j / kSuper * kSuperBytes * lr;
        q4k_lane_scales(p, lr, static_cast<int>(r % kLanes), static_cast<int>(j % kSuper),
                        ds[j * L + l], dm[j * L + l]);
      }
    }
  }
  for_each_slot(nb, [&](int64_t j, int64_t slot) {
    pack_nibbles(w.q, w.k, n, rows, j, s.w.data() + slot * 8 * L);
    std::memcpy(s.ws.data() + slot * L, ds.data() + j * L, L * sizeof(float));
    std::memcpy(s.wm.data() + slot * L, dm.data() + j * L, L * sizeof(float));
  });
  s.index = index;
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

// out[b * ldo + r] = the w8a8 product of int8 weight row r and quantised x row b, for the rows
// r of strips [s0, s1) (of n rows) and the rows b of x groups [g0, g1) (`XPanels` built with
// `i8_shift()`); `s` is the caller's scratch, strip s0 + i in s[i] (repacked unless it holds
// that strip already).
inline void block_i8(const I8Rows& w, int64_t n, const XPanels& x, int64_t s0, int64_t s1,
                     int64_t g0, int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s) {
  const bool vnni = has_vnni();
  if (static_cast<int64_t>(s.size()) < s1 - s0) s.resize(s1 - s0);
  for (int64_t i = s0; i < s1; ++i)
    if (s[i - s0].index != i) pack_i8(w, n, i, vnni, s[i - s0]);
  if (vnni) {
    block_groups<Mul::kVnni, Fmt::kI8, true>(s, s0, s1, n, x, g0, g1, out, ldo);
  } else {
    block_groups<Mul::kMaddubsSigned, Fmt::kI8, false>(s, s0, s1, n, x, g0, g1, out, ldo);
  }
}

// The same for a 4-bit weight: strips [s0, s1) packed by `pack(i, strip)` where `s` does not
// hold them yet, then multiplied as kFmt (kCorr: the x panels hold the codes' offset).
template <Fmt kFmt, bool kCorr, typename Pack>
inline void block_4bit(int64_t n, const XPanels& x, int64_t s0, int64_t s1, int64_t g0,
                       int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s, Pack&& pack) {
  if (static_cast<int64_t>(s.size()) < s1 - s0) s.resize(s1 - s0);
  for (int64_t i = s0; i < s1; ++i)
    if (s[i - s0].index != i) pack(i, s[i - s0]);
  if (has_vnni()) {
    block_groups<Mul::kVnni, kFmt, kCorr>(s, s0, s1, n, x, g0, g1, out, ldo);
  } else {
    block_groups<Mul::kMaddubs, kFmt, kCorr>(s, s0, s1, n, x, g0, g1, out, ldo);
  }
}

// A Q4_0-style weight (`Q4Rows`, `XPanels` built with kQ4Shift): the w4a8 product.
inline void block_q4(const Q4Rows& w, int64_t n, const XPanels& x, int64_t s0, int64_t s1,
                     int64_t g0, int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s) {
  block_4bit<Fmt::kQ4, true>(n, x, s0, s1, g0, g1, out, ldo, s,
                             [&](int64_t i, Strip& st) { pack_q4(w, n, i, st); });
}

// A Q4_K-style weight (`Q4KRows`, `XPanels` built with shift 0): the w4a8_k product.
inline void block_q4k(const Q4KRows& w, int64_t n, const XPanels& x, int64_t s0, int64_t s1,
                      int64_t g0, int64_t g1, float* out, int64_t ldo, std::vector<Strip>& s) {
  block_4bit<Fmt::kQ4K, false>(n, x, s0, s1, g0, g1, out, ldo, s,
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
};
inline int64_t strips(int64_t n) { return (n + kStripRows - 1) / kStripRows; }
inline int64_t block_strips(int64_t) { return 1; }
inline int i8_shift() { return 0; }
constexpr int kQ4Shift = 8;
inline void block_i8(const I8Rows&, int64_t, const XPanels&, int64_t, int64_t, int64_t, int64_t,
                     float*, int64_t, std::vector<Strip>&) {}
inline void block_q4(const Q4Rows&, int64_t, const XPanels&, int64_t, int64_t, int64_t,
                     int64_t, float*, int64_t, std::vector<Strip>&) {}
inline void block_q4k(const Q4KRows&, int64_t, const XPanels&, int64_t, int64_t, int64_t,
                      int64_t, float*, int64_t, std::vector<Strip>&) {}

#endif

}  // namespace gemm
}  // namespace int_dot
}  // namespace vllm_mamba
