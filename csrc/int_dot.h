// Integer dot products (`quantization="w8a8"` / `"w4a8"`): each row of x is quantised to int8
// in blocks of 32 with one float32 scale per block (llama.cpp's Q8_0 activations), and the
// weight rows (int8 with one float32 scale per row, or 4-bit groups of 32 with a float16 scale
// each) are multiplied with it in integers, block by block:
//
//   x block j:  d_j = amax_j / 127,  q_i = round_half_even(x_i / d_j)  (all zero when amax_j = 0)
//   int8:   out = scale_row * sum_j (d_j * dot_j),   dot_j = sum_i q_i w_i  (int32, exact)
//   4-bit:  out = sum_j ((d_j * s_j) * dot_j),       dot_j = sum_i q_i c_i  (c_i in [-8, 7])
//   4-bit, Q4_K-style (`quantization="w4a8_k"`): super-blocks of 8 blocks (256 weights) per
//           row, each with float16 d and dmin and 6-bit sc_j, m_j per block; weight i of block
//           j is (d sc_j) c_i - (dmin m_j), c_i in [0, 15]:
//           out = sum_j ((d_j * ds_j) * dot_j - dm_j * (d_j * sum_j(q))),  dot_j = sum_i q_i c_i
//           with ds_j = d sc_j and dm_j = dmin m_j (exact in float32: a float16 times an
//           integer under 64)
//
// The block sums are exact integers (|dot_j| <= 32 * 127 * 128); only the float sum over blocks
// rounds. Its order is fixed, the same for every number of rows of x (so a row's result never
// depends on the batch) and on the AVX2 and AVX-512 levels: block j is added (by a fused
// multiply-add) into partial sum j % 16, in block order (Q4_K-style: then the min term
// dm_j * (d_j * sum_j(q)) subtracted by a second one), and the 16 partial sums are added as
// a tree (p_i + p_(i+8), then + 4, + 2, + 1). The generic level rounds the product and the sum
// separately (no FMA there). `vllm_mamba/ops/int_dot_linear.py` is the reference.
//
// ISA: the avx512 build multiplies with AVX512-VNNI's vpdpbusd where the CPU has it (a runtime
// check; x86-64-v4 does not include it), else AVX-512BW's vpmaddubsw + vpmaddwd; the avx2 build
// with AVX-VNNI's vpdpbusd where present, else AVX2's vpmaddubsw + vpmaddwd; the generic build
// in scalar loops. vpdpbusd multiplies unsigned by signed bytes: an int8 weight is read as
// w + 128 (w ^ 0x80) and 128 * sum(q) is subtracted per block; without VNNI its sign moves to x
// (|w| * sign(w) x, as vpmaddubsw's pairs would saturate otherwise). A 4-bit code is stored
// unsigned (c + 8) and 8 * sum(q) is subtracted per block; without VNNI a 4-bit block's 8
// vpmaddubsw results are added in int16 and widened by one vpmaddwd (`kCodeSumBound`: 9
// multiplies a block and row instead of 16, 10-15% off a 5-row call on a Zen 3).
//
// The weights are stored in strips of 16 rows interleaved by 4-byte groups (below), so that a
// vector holds one group of 16 rows and the kernels never sum across a vector's lanes.
//
// Shapes: K input features (a multiple of 32), NB = K / 32 blocks, padded to NBP (a multiple of
// 16, `padded_blocks`) in the quantised rows, whose padding is zero. No torch header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "vec.h"

namespace vllm_mamba {
namespace int_dot {

constexpr int64_t kBlock = 32;  // activations sharing one scale
constexpr int64_t kGroup = 16;  // blocks per step: the float partial sums
constexpr int kMaxRows = 5;     // rows of x sharing one pass over a weight strip
constexpr int kPairRows = 2;    // rows of x from which two strips go side by side (`kPairs`)

// The largest |sum| of a 4-bit block's 8 vpmaddubsw pair sums (codes in [0, 15], |q| <= 127:
// 16 products of at most 15 * 127 per int16 lane), which the maddubs kernels add in int16.
constexpr int32_t kCodeSumBound = 16 * 15 * 127;
static_assert(kCodeSumBound <= 32767, "the 4-bit maddubs sums must fit int16");

inline int64_t padded_blocks(int64_t k) {
  const int64_t nb = k / kBlock;
  return (nb + kGroup - 1) / kGroup * kGroup;
}

// One quantised row of x: codes q (NBP * 32), block scales d (NBP), block code sums s (NBP).
struct QRow {
  const int8_t* q;
  const float* d;
  const int32_t* s;
};

// Quantises x[:k] (k a multiple of 32) into q (nbp * 32), d (nbp), s (nbp); blocks past k / 32
// are zero. Scalar code: the rounding every level's `quantize_row` gives (the reference).
inline void quantize_row_scalar(const float* x, int64_t k, int8_t* q, float* d, int32_t* s,
                                int64_t nbp) {
  const int64_t nb = k / kBlock;
  for (int64_t j = 0; j < nb; ++j) {
    const float* xb = x + j * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.0f;
    int8_t* qb = q + j * kBlock;
    int32_t sum = 0;
    if (scale > 0.0f) {
      for (int i = 0; i < kBlock; ++i) {
        float v = std::nearbyint(xb[i] / scale);  // the current rounding: to nearest even
        v = std::min(127.0f, std::max(-127.0f, v));
        const int32_t c = static_cast<int32_t>(v);
        qb[i] = static_cast<int8_t>(c);
        sum += c;
      }
    } else {
      std::memset(qb, 0, kBlock);
    }
    d[j] = scale > 0.0f ? scale : 0.0f;
    s[j] = sum;
  }
  std::memset(q + nb * kBlock, 0, static_cast<size_t>((nbp - nb) * kBlock));
  for (int64_t j = nb; j < nbp; ++j) {
    d[j] = 0.0f;
    s[j] = 0;
  }
}

// The same, vectorised on AVX-512 and AVX2 (the same float operations: |x| maxima, an IEEE
// division by the scale, rounding in the current mode, the clamp; the same bits for finite x);
// a row holding an infinity or a NaN goes through `quantize_row_scalar` itself. The scalar loop
// (nearbyint is a library call there) took 29 us for 5 rows of 3584 on a Zen 5, each thread of
// every weight-streaming product quantising its rows of x: about 1 ms of a 5-row speculative
// chain's step on Qwen3.5-0.8B.
inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* s,
                         int64_t nbp) {
  const int64_t nb = k / kBlock;
#if defined(VLLM_MAMBA_VEC_AVX512)
  const __m512 sign = _mm512_set1_ps(-0.0f), lo = _mm512_set1_ps(-127.0f),
               hi = _mm512_set1_ps(127.0f);
  __mmask16 odd = 0;  // lanes that met an infinity or a NaN
  for (int64_t j = 0; j < nb; ++j) {
    const __m512 x0 = _mm512_loadu_ps(x + j * kBlock), x1 = _mm512_loadu_ps(x + j * kBlock + 16);
    odd |= _mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99);
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    const float scale = amax / 127.0f;
    int8_t* qb = q + j * kBlock;
    if (scale > 0.0f) {
      const __m512 sv = _mm512_set1_ps(scale);
      auto codes = [&](__m512 v) {  // nearbyint(v / scale) clamped to [-127, 127], as int32
        v = _mm512_roundscale_ps(_mm512_div_ps(v, sv), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
        return _mm512_cvttps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
      };
      const __m512i c0 = codes(x0), c1 = codes(x1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(c1));
      s[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
      d[j] = scale;
    } else {
      std::memset(qb, 0, kBlock);
      s[j] = 0;
      d[j] = 0.0f;
    }
  }
  if (odd) {
    quantize_row_scalar(x, k, q, d, s, nbp);
    return;
  }
#elif defined(VLLM_MAMBA_VEC_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f),
               hi = _mm256_set1_ps(127.0f);
  const __m256i exp = _mm256_set1_epi32(0x7f800000);
  __m256i odd = _mm256_setzero_si256();  // lanes that met an infinity or a NaN
  for (int64_t j = 0; j < nb; ++j) {
    __m256 xv[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      xv[i] = _mm256_loadu_ps(x + j * kBlock + 8 * i);
      const __m256i bits = _mm256_castps_si256(xv[i]);
      odd = _mm256_or_si256(odd, _mm256_cmpeq_epi32(_mm256_and_si256(bits, exp), exp));
      m = _mm256_max_ps(_mm256_andnot_ps(sign, xv[i]), m);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float scale = _mm_cvtss_f32(m4) / 127.0f;
    int8_t* qb = q + j * kBlock;
    if (scale > 0.0f) {
      const __m256 sv = _mm256_set1_ps(scale);
      __m256i c[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 v = _mm256_round_ps(_mm256_div_ps(xv[i], sv),
                                         _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
        c[i] = _mm256_cvttps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      }
      // int32 -> int8 (no saturation: |c| <= 127), then the lanes back in order
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                           _mm256_packs_epi32(c[2], c[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                          _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      s[j] = _mm_cvtsi128_si32(t4);
      d[j] = scale;
    } else {
      std::memset(qb, 0, kBlock);
      s[j] = 0;
      d[j] = 0.0f;
    }
  }
  if (!_mm256_testz_si256(odd, odd)) {
    quantize_row_scalar(x, k, q, d, s, nbp);
    return;
  }
#else
  quantize_row_scalar(x, k, q, d, s, nbp);
  return;
#endif
  std::memset(q + nb * kBlock, 0, static_cast<size_t>((nbp - nb) * kBlock));
  for (int64_t j = nb; j < nbp; ++j) {
    d[j] = 0.0f;
    s[j] = 0;
  }
}

// Quantised rows of x, owning their storage (reused between calls: `quantize` grows it).
struct QActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  int64_t rows = 0, nbp = 0;

  void resize(int64_t m, int64_t k) {
    rows = m;
    nbp = padded_blocks(k);
    if (static_cast<int64_t>(d.size()) < m * nbp) {
      q.resize(m * nbp * kBlock);
      d.resize(m * nbp);
      s.resize(m * nbp);
    }
  }
  QRow row(int64_t b) const {
    return {q.data() + b * nbp * kBlock, d.data() + b * nbp, s.data() + b * nbp};
  }
  // Quantises row b of x (k values).
  void quantize(int64_t b, const float* x, int64_t k) {
    quantize_row(x, k, q.data() + b * nbp * kBlock, d.data() + b * nbp, s.data() + b * nbp, nbp);
  }
  // Row b as row sb of `src` (quantised for the same k).
  void copy_row(int64_t b, const QActs& src, int64_t sb) {
    std::memcpy(q.data() + b * nbp * kBlock, src.q.data() + sb * nbp * kBlock, nbp * kBlock);
    std::memcpy(d.data() + b * nbp, src.d.data() + sb * nbp, nbp * sizeof(float));
    std::memcpy(s.data() + b * nbp, src.s.data() + sb * nbp, nbp * sizeof(int32_t));
  }
};

// Rows (row stride ldx) of x quantised into `out`, one after another.
inline void quantize(const float* x, int64_t ldx, int64_t rows, int64_t k, QActs& out) {
  out.resize(rows, k);
  for (int64_t b = 0; b < rows; ++b) out.quantize(b, x + b * ldx, k);
}

// ---------------------------------------------------------------------------------------------
// The weights' layout: strips of kLanes (16) rows, interleaved by 4-byte groups.
//
// An integer-dot weight is stored as its rows' bytes permuted (same shape, same size as the
// plain (rows, k) int8 / (rows, k / 2) 4-bit layout; `vllm_mamba.ops.int_dot_linear.
// pack_strips` makes it at load time): rows [16 s, 16 s + L) form strip s (L = 16, the last
// strip the rows left), stored one after another; within a strip, 4-byte group g of every row
// is together, lane by lane: byte offset (g * L + l) * 4 of the strip holds group g of row
// 16 s + l. A block of 32 activations is 8 groups of an int8 row (32 bytes) and 4 groups of a
// 4-bit row (16 bytes: byte i holds activation i in its low nibble, i + 16 in its high one);
// the 4-bit block scales (rows, k / 32) float16 are interleaved the same way with groups of
// one value. One vector load then holds a group of 16 rows, and one vpdpbusd with the
// broadcast group of x adds 4 products to each row's lane: no horizontal sum per row, and
// each strip is one contiguous stream of 16 * k bytes (the hardware prefetchers follow it).
//
// Per lane the float side is exactly the contract above: block j's exact sum, converted, is
// added by a fused multiply-add into partial j % 16, and the partials are added as the tree.

constexpr int64_t kLanes = 16;  // weight rows per strip

// An int8 weight of n rows in the strip layout, with one float32 scale per row.
struct I8Rows {
  const int8_t* q;
  const float* scale;
  int64_t k;
  int64_t n;
};

// A 4-bit weight of n rows in the strip layout (codes c + 8), block scales float16 bits.
struct Q4Rows {
  const uint8_t* q;
  const uint16_t* scales;
  int64_t k;
  int64_t n;
};

// A Q4_K-style 4-bit weight of n rows in the strip layout: codes c in [0, 15] packed as
// `Q4Rows`' (no offset), and per row and super-block of kSuper blocks (the last one of a row
// may be partial) kSuperBytes scale bytes: d (float16, bytes 0-1, little-endian), dmin
// (bytes 2-3), byte 4 + i = sc_i & 15 | (m_i & 15) << 4 for block i of the super-block, byte
// 12 + i / 2 the high two bits of sc and m of blocks 2 (i / 2) (bits 0-1, 2-3) and 2 (i / 2) + 1
// (bits 4-5, 6-7). The scale bytes (rows, S * 16), S = ceil(k / 256), are interleaved in strips
// with groups of one byte: byte b of super-block t of lane l at (t * 16 + b) * L + l.
struct Q4KRows {
  const uint8_t* q;
  const uint8_t* scales;
  int64_t k;
  int64_t n;
};

constexpr int64_t kSuper = 8;         // blocks per super-block (256 weights)
constexpr int64_t kSuperBytes = 16;   // scale bytes per row and super-block

inline int64_t super_blocks(int64_t k) { return (k / kBlock + kSuper - 1) / kSuper; }

// The scale and min of block i (0..7) of a super-block of lane l, from the super-block's strip
// bytes p (byte b of lane l at p[b * lanes + l]): ds = d * sc_i, dm = dmin * m_i (exact).
inline void q4k_lane_scales(const uint8_t* p, int lanes, int l, int i, float& ds, float& dm) {
  const uint16_t d = static_cast<uint16_t>(p[l] | p[lanes + l] << 8);
  const uint16_t dmin = static_cast<uint16_t>(p[2 * lanes + l] | p[3 * lanes + l] << 8);
  const int lo = p[(4 + i) * lanes + l];
  const int hi = p[(12 + i / 2) * lanes + l] >> (4 * (i & 1));
  const int sc = (lo & 15) | (hi & 3) << 4;
  const int m = (lo >> 4) | (hi >> 2 & 3) << 4;
  ds = vec::f16_to_f32(d) * static_cast<float>(sc);
  dm = vec::f16_to_f32(dmin) * static_cast<float>(m);
}

// The Q4_K-style min term's x factor of block j of x row r: d_j * sum_j(q) (float32, exact
// product rounded once: the same in every kernel).
inline float x_block_sum(const QRow& r, int64_t j) { return r.d[j] * static_cast<float>(r.s[j]); }

// Rows in strip s of n rows (1..16).
inline int strip_lanes(int64_t n, int64_t s) {
  return static_cast<int>(std::min<int64_t>(kLanes, n - s * kLanes));
}

// The weight bytes a fixed distance ahead of the strip being computed (`ahead_bytes`),
// prefetched (into L2) block by block while this one is read: a strip's compute per block grows
// with the rows of x (5 rows of a speculative chain take 40 vpdpbusd per block of an int8
// strip), and without prefetches the hardware prefetchers' lead no longer hides the memory
// latency, so a 5-row pass took 1.6-1.9x one row on a 256 MiB weight (2 threads, Zen 4) where
// it is bound by the same reads. `p` null: none.
// `vec::prefetch_l2` that the compiler keeps: GCC 12 removed every `__builtin_prefetch` of
// `Ahead::block` (at -O1 too) once it held a second strip's, as code without effect.
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  vec::prefetch_l2(p);
#endif
}

struct Ahead {
  const uint8_t* p = nullptr;      // the weight bytes of the strip ahead
  const uint8_t* scales = nullptr;  // 4-bit: its scale bytes (2 per row and block on average
                                     // in both layouts: a float16, or 16 per 8 blocks)
  int64_t block_bytes = 0;           // weight bytes per block of 32 columns of that strip
  int64_t strips = 1;                // strips ahead, one after another (2: a pair's)
  int64_t strip_bytes = 0;           // weight bytes per strip (with `strips` 2)
  int64_t scale_strip_bytes = 0;     // 4-bit: scale bytes per strip (with `strips` 2)

  // Prefetches the ahead strips' block j (their weight lines and, for 4-bit, their scales).
  inline void block(int64_t j, int lanes) const {
    if (!p) return;
    const uint8_t* b = p + j * block_bytes;
    for (int64_t off = 0; off < block_bytes; off += 64) prefetch_l2(b + off);
    if (scales) prefetch_l2(scales + j * 2 * lanes);
    if (strips < 2) return;
    b += strip_bytes;
    for (int64_t off = 0; off < block_bytes; off += 64) prefetch_l2(b + off);
    if (scales) prefetch_l2(scales + scale_strip_bytes + j * 2 * lanes);
  }
};

// Whether the kernels may use VNNI where the CPU has it: unless VLLM_MAMBA_INT_DOT_VNNI=0 (read
// once per process), which runs the maddubs kernels instead (the tests compare both).
inline bool vnni_allowed() {
  const char* env = std::getenv("VLLM_MAMBA_INT_DOT_VNNI");
  return !(env && env[0] == '0');
}

// The 4-byte group g of x row `x` (groups 0..7 of block j are x.q[32 j ..]).
inline int32_t x_group(const int8_t* q, int64_t g) {
  int32_t v;
  std::memcpy(&v, q + 4 * g, 4);
  return v;
}

// ---------------------------------------------------------------------------------------------
// The strip kernels: one strip (L lanes) times B rows of x; out[b][l] = row l's result with x
// row xs[b] (lanes past L undefined). Each level defines `Kernels<kVnni>::strip_i8<B>` and
// `strip_4bit<B, kK>` (Q4_0-style, or Q4_K-style with kK).

#if defined(VLLM_MAMBA_VEC_AVX512) || defined(VLLM_MAMBA_VEC_AVX2)
// The 6-bit scales `sc` and mins `mn` of block i (0..7) of a Q4_K-style super-block, a byte per
// lane, from the lanes' scale bytes 4 + i (`lo`) and 12 + i / 2 (`hi`) (`Q4KRows`).
inline void q4k_six_bits(__m128i lo, __m128i hi, int i, __m128i& sc, __m128i& mn) {
  const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
  hi = _mm_srli_epi16(hi, 4 * (i & 1));
  sc = _mm_or_si128(_mm_and_si128(lo, m4), _mm_slli_epi16(_mm_and_si128(hi, m2), 4));
  mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), m4),
                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hi, 2), m2), 4));
}
#endif

#if defined(VLLM_MAMBA_VEC_AVX512)

// The fixed tree over 16 partials, lane by lane: (p_i + p_(i+8)), then + 4, + 2, + 1.
inline __m512 tree16(__m512 (&p)[kGroup]) {
  for (int i = 0; i < 8; ++i) p[i] = _mm512_add_ps(p[i], p[i + 8]);
  for (int i = 0; i < 4; ++i) p[i] = _mm512_add_ps(p[i], p[i + 4]);
  for (int i = 0; i < 2; ++i) p[i] = _mm512_add_ps(p[i], p[i + 2]);
  return _mm512_add_ps(p[0], p[1]);
}

// The B x 16 partial sums of a strip kernel, zeroed; then each row's tree into out[b].
template <int B>
inline void zero_partials(__m512 (&acc)[B][kGroup]) {
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < kGroup; ++p) acc[b][p] = _mm512_setzero_ps();
}
template <int B>
inline void store_trees(__m512 (&acc)[B][kGroup], float (*out)[kLanes]) {
  for (int b = 0; b < B; ++b) _mm512_storeu_ps(out[b], tree16(acc[b]));
}

// The block scales ds[i] = d * sc_i and mins dm[i] = dmin * m_i of the L lanes of a Q4_K-style
// super-block (`Q4KRows`; p its strip bytes, byte b of lane l at p[b * lanes + l]; lanes past
// L zero).
inline void decode_q4k(const uint8_t* p, int lanes, __mmask16 m, __m512 (&ds)[kSuper],
                       __m512 (&dm)[kSuper]) {
  auto bytes = [&](int b) { return _mm_maskz_loadu_epi8(m, p + b * lanes); };
  auto half = [&](int b) {  // the float16 of bytes b, b + 1
    const __m256i lo = _mm256_cvtepu8_epi16(bytes(b)), hi = _mm256_cvtepu8_epi16(bytes(b + 1));
    return _mm512_cvtph_ps(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 8)));
  };
  const __m512 d = half(0), dmin = half(2);
  for (int i = 0; i < kSuper; ++i) {
    __m128i sc, mn;
    q4k_six_bits(bytes(4 + i), bytes(12 + i / 2), i, sc, mn);
    ds[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    dm[i] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
  }
}

// The region is compiled with AVX512-VNNI enabled so that `Kernels<true>` may use it (the
// callers check the CPU: `has_vnni`); `Kernels<false>` holds no VNNI instruction.
#pragma GCC push_options
#pragma GCC target("avx512vnni")
template <bool kVnni>
struct Kernels {
  // acc + the 4-byte dots of unsigned a with signed b, per int32 lane
  static inline __m512i dot(__m512i acc, __m512i a, __m512i b) {
    if constexpr (kVnni) {
      return _mm512_dpbusd_epi32(acc, a, b);
    } else {
      return _mm512_add_epi32(
          acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
    }
  }

  // The exact int32 dots of block j of x row q with a 4-bit block's code groups (lo: its
  // bytes 0..15, hi: 16..31). Without VNNI the 8 vpmaddubsw pair sums are added in int16 and
  // widened once by vpmaddwd (`kCodeSumBound`).
  static inline __m512i dot4(const __m512i (&lo)[4], const __m512i (&hi)[4], const int8_t* q,
                             int64_t j) {
    auto xg = [&](int g) { return _mm512_set1_epi32(x_group(q, 8 * j + g)); };
    if constexpr (kVnni) {
      __m512i s = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) s = dot(dot(s, lo[i], xg(i)), hi[i], xg(4 + i));
      return s;
    } else {
      __m512i s = _mm512_maddubs_epi16(lo[0], xg(0));
      s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[0], xg(4)));
      for (int i = 1; i < 4; ++i) {
        s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[i], xg(i)));
        s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[i], xg(4 + i)));
      }
      return _mm512_madd_epi16(s, _mm512_set1_epi16(1));
    }
  }

  // The L lanes of the 4-byte groups g, g + 1, ... of a strip (group stride 4 L bytes).
  static inline __m512i group(const uint8_t* p, int lanes, __mmask16 m) {
    return lanes == kLanes ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(m, p);
  }

  // Two whole strips side by side for several rows of x (`pair_i8`, `pair_4bit`): each
  // broadcast group of x feeds two vpdpbusd instead of one. A broadcast from memory costs
  // about as much as the vpdpbusd it feeds on a Zen 5 (a loop of both ran at 4.97 G vpdpbusd
  // a second against 7.7 G with full-vector loads of x). In cache 2-3 rows ran 1.2-1.6x
  // faster with pairs (5 rows gained from the rolled loop below); from memory, alike.
  static constexpr bool kPairs = true;

  // f(j, j % 16) for the blocks j < nb in order. One row of x keeps its 16 partial sums in
  // registers (the loop unrolled 16 times, the partials' indices constants); several rows'
  // do not fit (32 registers) and the loop stays rolled: unrolled, 5 rows' pass was about 240
  // instructions a block, which the front end (not the op cache) fed at about 4 a cycle. Rolled,
  // on a Zen 5 (one thread, 1024 x 1024 in cache, best of 4 alternating runs, with
  // pairs): 5 rows int8 152 -> 214 GMAC/s, Q4_0-style 189 -> 228, Q4_K-style 167 -> 185-190.
  template <int B, typename F>
  static inline __attribute__((always_inline)) void for_blocks(int64_t nb, F&& f) {
    for (int64_t j0 = 0; j0 < nb; j0 += kGroup) {
      const int n = static_cast<int>(std::min<int64_t>(kGroup, nb - j0));
      if constexpr (B == 1) {
#pragma GCC unroll 16
        for (int p = 0; p < kGroup; ++p) {
          if (p >= n) break;
          f(j0 + p, p);
        }
      } else {
#pragma GCC unroll 1
        for (int p = 0; p < n; ++p) f(j0 + p, p);
      }
    }
  }

  // NS (1 or 2) strips of L lanes (L = 16 with 2), one after another (strip t at w + t *
  // stride); out[t * kMaxRows + b] = strip t times x row b.
  template <int B, int NS>
  static void strips_i8(const uint8_t* w, int64_t stride, int lanes, int64_t nb,
                        const QRow* xs, float (*out)[kLanes], const Ahead& ahead) {
    const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1u);
    const int64_t gs = 4 * lanes;  // bytes per group of the strip
    __m512 acc[NS][B][kGroup];
    for (int t = 0; t < NS; ++t) zero_partials(acc[t]);
    for_blocks<B>(nb, [&](int64_t j, int p) __attribute__((always_inline)) {
      ahead.block(j, lanes);
      __m512i wv[NS][8];
      __mmask64 neg[NS][8];
      for (int t = 0; t < NS; ++t) {
        const uint8_t* wj = w + t * stride + j * 8 * gs;
        for (int i = 0; i < 8; ++i) {
          const __m512i v = group(wj + i * gs, lanes, m);
          if constexpr (kVnni) {
            wv[t][i] = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));  // w + 128
          } else {
            wv[t][i] = _mm512_abs_epi8(v);
            neg[t][i] = _mm512_movepi8_mask(v);
          }
        }
      }
      for (int b = 0; b < B; ++b) {
        __m512i s[NS];
        for (int t = 0; t < NS; ++t) s[t] = _mm512_setzero_si512();
        for (int i = 0; i < 8; ++i) {
          const __m512i xg = _mm512_set1_epi32(x_group(xs[b].q, 8 * j + i));
          for (int t = 0; t < NS; ++t) {
            if constexpr (kVnni) {
              s[t] = dot(s[t], wv[t][i], xg);
            } else {
              s[t] = dot(s[t], wv[t][i],
                         _mm512_mask_sub_epi8(xg, neg[t][i], _mm512_setzero_si512(), xg));
            }
          }
        }
        for (int t = 0; t < NS; ++t) {
          if constexpr (kVnni) s[t] = _mm512_sub_epi32(s[t], _mm512_set1_epi32(128 * xs[b].s[j]));
          acc[t][b][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_set1_ps(xs[b].d[j]),
                                         acc[t][b][p]);
        }
      }
    });
    for (int t = 0; t < NS; ++t) store_trees(acc[t], out + t * kMaxRows);
  }

  template <int B>
  static void strip_i8(const uint8_t* w, int lanes, int64_t nb, const QRow* xs,
                       float (*out)[kLanes], const Ahead& ahead) {
    strips_i8<B, 1>(w, 0, lanes, nb, xs, out, ahead);
  }
  template <int B>
  static void pair_i8(const uint8_t* w, int64_t stride, int64_t nb, const QRow* xs,
                      float (*out)[kLanes], const Ahead& ahead) {
    strips_i8<B, 2>(w, stride, kLanes, nb, xs, out, ahead);
  }

  // A 4-bit strip: Q4_0-style (`Q4Rows`: codes c + 8, float16 block scales; 8 * sum(q)
  // subtracted per block) or, with kK, Q4_K-style (`Q4KRows`: codes c, the block scales and
  // mins of a super-block decoded by `decode_q4k` at its first block). `scales`: the strip's
  // scale bytes.
  // NS (1 or 2) strips as `strips_i8`, their scale bytes at scales + t * sstride.
  template <int B, bool kK, int NS>
  static void strips_4bit(const uint8_t* w, const uint8_t* scales, int64_t stride,
                          int64_t sstride, int lanes, int64_t nb, const QRow* xs,
                          float (*out)[kLanes], const Ahead& ahead) {
    const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1u);
    const int64_t gs = 4 * lanes;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[NS][B][kGroup];
    __m512 ds[NS][kSuper], dm[NS][kSuper];  // kK: the super-blocks' block scales and mins
    for (int t = 0; t < NS; ++t) zero_partials(acc[t]);
    for_blocks<B>(nb, [&](int64_t j, int p) __attribute__((always_inline)) {
      if constexpr (kK) {
        if (p % kSuper == 0) {
          for (int t = 0; t < NS; ++t) {
            decode_q4k(scales + t * sstride + j / kSuper * kSuperBytes * lanes, lanes, m,
                       ds[t], dm[t]);
          }
        }
      }
      ahead.block(j, lanes);
      __m512i lo[NS][4], hi[NS][4];
      __m512 ws[NS];
      for (int t = 0; t < NS; ++t) {
        const uint8_t* wj = w + t * stride + j * 4 * gs;
        for (int i = 0; i < 4; ++i) {
          const __m512i v = group(wj + i * gs, lanes, m);
          lo[t][i] = _mm512_and_si512(v, low);
          hi[t][i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if constexpr (kK) {
          ws[t] = ds[t][p % kSuper];
        } else {
          ws[t] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
              m, reinterpret_cast<const uint16_t*>(scales + t * sstride) + j * lanes));
        }
      }
      for (int b = 0; b < B; ++b) {
        __m512i s[NS];
        if constexpr (kVnni) {  // one broadcast group of x for the NS strips (exact sums)
          for (int t = 0; t < NS; ++t) s[t] = _mm512_setzero_si512();
          for (int i = 0; i < 4; ++i) {
            const __m512i xl = _mm512_set1_epi32(x_group(xs[b].q, 8 * j + i));
            for (int t = 0; t < NS; ++t) s[t] = dot(s[t], lo[t][i], xl);
            const __m512i xh = _mm512_set1_epi32(x_group(xs[b].q, 8 * j + 4 + i));
            for (int t = 0; t < NS; ++t) s[t] = dot(s[t], hi[t][i], xh);
          }
        } else {
          for (int t = 0; t < NS; ++t) s[t] = dot4(lo[t], hi[t], xs[b].q, j);
        }
        for (int t = 0; t < NS; ++t) {
          if constexpr (!kK) s[t] = _mm512_sub_epi32(s[t], _mm512_set1_epi32(8 * xs[b].s[j]));
          const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(xs[b].d[j]), ws[t]);
          __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), sc, acc[t][b][p]);
          if constexpr (kK) {
            a = _mm512_fnmadd_ps(dm[t][p % kSuper], _mm512_set1_ps(x_block_sum(xs[b], j)), a);
          }
          acc[t][b][p] = a;
        }
      }
    });
    for (int t = 0; t < NS; ++t) store_trees(acc[t], out + t * kMaxRows);
  }

  template <int B, bool kK>
  static void strip_4bit(const uint8_t* w, const uint8_t* scales, int lanes, int64_t nb,
                         const QRow* xs, float (*out)[kLanes], const Ahead& ahead) {
    strips_4bit<B, kK, 1>(w, scales, 0, 0, lanes, nb, xs, out, ahead);
  }
  template <int B, bool kK>
  static void pair_4bit(const uint8_t* w, const uint8_t* scales, int64_t stride,
                        int64_t sstride, int64_t nb, const QRow* xs, float (*out)[kLanes],
                        const Ahead& ahead) {
    strips_4bit<B, kK, 2>(w, scales, stride, sstride, kLanes, nb, xs, out, ahead);
  }
};
#pragma GCC pop_options

inline bool has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") && vnni_allowed();
  return has;
}
constexpr const char* kVnniName = "avx512vnni";

#elif defined(VLLM_MAMBA_VEC_AVX2)

// The fixed tree over 16 partials of 8 lanes.
inline __m256 tree16(__m256 (&p)[kGroup]) {
  for (int i = 0; i < 8; ++i) p[i] = _mm256_add_ps(p[i], p[i + 8]);
  for (int i = 0; i < 4; ++i) p[i] = _mm256_add_ps(p[i], p[i + 4]);
  for (int i = 0; i < 2; ++i) p[i] = _mm256_add_ps(p[i], p[i + 2]);
  return _mm256_add_ps(p[0], p[1]);
}

// The B x 16 partial sums of a strip kernel's half, zeroed; then each row's tree into out[b] + h.
template <int B>
inline void zero_partials(__m256 (&acc)[B][kGroup]) {
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < kGroup; ++p) acc[b][p] = _mm256_setzero_ps();
}
template <int B>
inline void store_trees(__m256 (&acc)[B][kGroup], float (*out)[kLanes], int h) {
  for (int b = 0; b < B; ++b) _mm256_storeu_ps(out[b] + h, tree16(acc[b]));
}

// The same for a whole strip's two halves (`acc[b][p][h]`: partial p of half h).
template <int B>
inline void zero_partials(__m256 (&acc)[B][kGroup][2]) {
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < kGroup; ++p) acc[b][p][0] = acc[b][p][1] = _mm256_setzero_ps();
}
template <int B>
inline void store_trees(__m256 (&acc)[B][kGroup][2], float (*out)[kLanes]) {
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < 2; ++h) {
      __m256 t[kGroup];
      for (int p = 0; p < kGroup; ++p) t[p] = acc[b][p][h];
      _mm256_storeu_ps(out[b] + 8 * h, tree16(t));
    }
  }
}

// The int32 lane mask of lanes [h, lanes) of 8 starting at lane h (for maskload).
inline __m256i lane_mask(int lanes, int h) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes - h), idx);
}

// The block scales and mins of lanes [h, h + n) (n <= 8) of a Q4_K-style super-block (as the
// AVX-512 `decode_q4k`; lanes past n zero).
inline void decode_q4k(const uint8_t* p, int lanes, int h, int n, __m256 (&ds)[kSuper],
                       __m256 (&dm)[kSuper]) {
  auto bytes = [&](int b) {
    const uint8_t* q = p + b * lanes + h;
    if (n == 8) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
    alignas(16) uint8_t t[16] = {};
    std::memcpy(t, q, static_cast<size_t>(n));
    return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  };
  auto half = [&](int b) {  // the float16 of bytes b, b + 1
    const __m128i lo = _mm_cvtepu8_epi16(bytes(b)), hi = _mm_cvtepu8_epi16(bytes(b + 1));
    return _mm256_cvtph_ps(_mm_or_si128(lo, _mm_slli_epi16(hi, 8)));
  };
  const __m256 d = half(0), dmin = half(2);
  for (int i = 0; i < kSuper; ++i) {
    __m128i sc, mn;
    q4k_six_bits(bytes(4 + i), bytes(12 + i / 2), i, sc, mn);
    ds[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    dm[i] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
  }
}

#pragma GCC push_options
#pragma GCC target("avxvnni")
// A strip's 16 lanes are two halves of 8: for a few rows of x both go in one pass over the
// blocks (`strip_i8_whole`, `strip_4bit_whole`), else each half over all blocks in turn.
template <bool kVnni>
struct Kernels {
  static inline __m256i dot(__m256i acc, __m256i a, __m256i b) {
    if constexpr (kVnni) {
      return _mm256_dpbusd_avx_epi32(acc, a, b);
    } else {
      return _mm256_add_epi32(
          acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
    }
  }

  // The exact int32 dots of block j of x row q with a 4-bit block's code groups (lo: its
  // bytes 0..15, hi: 16..31). Without VNNI the 8 vpmaddubsw pair sums are added in int16 and
  // widened once by vpmaddwd (`kCodeSumBound`).
  static inline __m256i dot4(const __m256i (&lo)[4], const __m256i (&hi)[4],
                             const __m256i (&xg)[8]) {
    if constexpr (kVnni) {
      __m256i s = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) s = dot(dot(s, lo[i], xg[i]), hi[i], xg[4 + i]);
      return s;
    } else {
      __m256i s = _mm256_maddubs_epi16(lo[0], xg[0]);
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], xg[4]));
      for (int i = 1; i < 4; ++i) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[i], xg[i]));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[i], xg[4 + i]));
      }
      return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    }
  }

  // The 8 broadcast 4-byte groups of block j of x row q.
  static inline void x_groups(const int8_t* q, int64_t j, __m256i (&xg)[8]) {
    for (int g = 0; g < 8; ++g) xg[g] = _mm256_set1_epi32(x_group(q, 8 * j + g));
  }

  // Rows of x up to which a whole strip goes in one pass (below), int8 and 4-bit. Measured in
  // one process, alternating calls with the half-strip kernels, on a Zen 3 without VNNI
  // (6144 x 1024 from memory, 2 threads), time against theirs: int8 0.90x at one row, 0.80x
  // at two, 0.87x at three, 1.10x at five; Q4_0-style 0.76-0.82x at one row, 0.89-0.94x at
  // two, 1.28x at five; Q4_K-style 0.79-0.82x, 0.98x, 0.99x (the half-strip kernels keep a
  // half's weights in registers across the rows of x). The same bits either way.
  static constexpr int kWholeRowsI8 = 3;
  static constexpr int kWholeRows4 = 2;
  static constexpr bool kPairs = false;  // one strip at a time (`run_strips`)

  // A whole strip's kernel (16 lanes, both halves of 8 in one pass over the blocks): a
  // block's broadcast groups of x, its bookkeeping and its loads serve 16 rows instead of 8,
  // unmasked. Each lane's sums are those of the half-strip kernel, in the same order.
  template <int B, bool kK>
  static void strip_4bit_whole(const uint8_t* w, const uint8_t* scales, int64_t nb,
                               const QRow* xs, float (*out)[kLanes], const Ahead& ahead) {
    constexpr int64_t gs = 4 * kLanes;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[B][kGroup][2];
    __m256 ds[2][kSuper], dm[2][kSuper];  // kK: the super-block's block scales and mins
    zero_partials(acc);
    for (int64_t j = 0; j < nb; ++j) {
      if constexpr (kK) {
        if (j % kSuper == 0) {
          const uint8_t* sb = scales + j / kSuper * kSuperBytes * kLanes;
          decode_q4k(sb, kLanes, 0, 8, ds[0], dm[0]);
          decode_q4k(sb, kLanes, 8, 8, ds[1], dm[1]);
        }
      }
      ahead.block(j, kLanes);
      const uint8_t* wj = w + j * 4 * gs;
      __m256i lo[2][4], hi[2][4];
      __m256 ws[2];
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 4; ++i) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + i * gs + 32 * h));
          lo[h][i] = _mm256_and_si256(v, low);
          hi[h][i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        if constexpr (kK) {
          ws[h] = ds[h][j % kSuper];
        } else {
          const uint16_t* sj = reinterpret_cast<const uint16_t*>(scales) + j * kLanes + 8 * h;
          ws[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sj)));
        }
      }
      const int64_t p = j % kGroup;
      for (int b = 0; b < B; ++b) {
        __m256i xg[8];
        x_groups(xs[b].q, j, xg);
        const __m256 dx = _mm256_set1_ps(xs[b].d[j]);
        for (int h = 0; h < 2; ++h) {
          __m256i s = dot4(lo[h], hi[h], xg);
          if constexpr (!kK) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * xs[b].s[j]));
          __m256& a = acc[b][p][h];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dx, ws[h]), a);
          if constexpr (kK) {
            a = _mm256_fnmadd_ps(dm[h][j % kSuper], _mm256_set1_ps(x_block_sum(xs[b], j)), a);
          }
        }
      }
    }
    store_trees(acc, out);
  }

  static inline __m256i group(const uint8_t* p, int lanes, int h, __m256i m) {
    return lanes - h >= 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                          : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), m);
  }

  template <int B>
  static void strip_i8_whole(const uint8_t* w, int64_t nb, const QRow* xs, float (*out)[kLanes],
                             const Ahead& ahead) {
    constexpr int64_t gs = 4 * kLanes;
    __m256 acc[B][kGroup][2];
    zero_partials(acc);
    for (int64_t j = 0; j < nb; ++j) {
      ahead.block(j, kLanes);
      const uint8_t* wj = w + j * 8 * gs;
      const int64_t p = j % kGroup;
      for (int b = 0; b < B; ++b) {
        __m256i xg[8];
        x_groups(xs[b].q, j, xg);
        const __m256 dx = _mm256_set1_ps(xs[b].d[j]);
        for (int h = 0; h < 2; ++h) {
          __m256i s = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i v =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + i * gs + 32 * h));
            if constexpr (kVnni) {
              s = dot(s, _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))), xg[i]);
            } else {
              s = dot(s, _mm256_abs_epi8(v), _mm256_sign_epi8(xg[i], v));
            }
          }
          if constexpr (kVnni) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * xs[b].s[j]));
          __m256& a = acc[b][p][h];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dx, a);
        }
      }
    }
    store_trees(acc, out);
  }

  // An int8 strip: whole ones for up to kWholeRowsI8 rows of x (above), else by halves.
  template <int B>
  static void strip_i8(const uint8_t* w, int lanes, int64_t nb, const QRow* xs,
                       float (*out)[kLanes], const Ahead& ahead) {
    if (B <= kWholeRowsI8 && lanes == kLanes) {
      strip_i8_whole<B>(w, nb, xs, out, ahead);
      return;
    }
    const int64_t gs = 4 * lanes;
    for (int h = 0; h < lanes; h += 8) {
      const __m256i m = lane_mask(lanes, h);
      __m256 acc[B][kGroup];
      zero_partials(acc);
      for (int64_t j = 0; j < nb; ++j) {
        if (h == 0) ahead.block(j, lanes);
        const uint8_t* wj = w + j * 8 * gs + 4 * h;
        __m256i wv[8], sv[8];
        for (int i = 0; i < 8; ++i) {
          const __m256i v = group(wj + i * gs, lanes, h, m);
          if constexpr (kVnni) {
            wv[i] = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
          } else {
            wv[i] = _mm256_abs_epi8(v);
            sv[i] = v;
          }
        }
        for (int b = 0; b < B; ++b) {
          __m256i s = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i xg = _mm256_set1_epi32(x_group(xs[b].q, 8 * j + i));
            if constexpr (kVnni) {
              s = dot(s, wv[i], xg);
            } else {
              s = dot(s, wv[i], _mm256_sign_epi8(xg, sv[i]));
            }
          }
          if constexpr (kVnni) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * xs[b].s[j]));
          __m256& a = acc[b][j % kGroup];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xs[b].d[j]), a);
        }
      }
      store_trees(acc, out, h);
    }
  }

  // A 4-bit strip: whole ones for up to kWholeRows4 rows of x above; otherwise a half of 8
  // lanes at a time, each run over all blocks with its own 16 partials.
  template <int B, bool kK>
  static void strip_4bit(const uint8_t* w, const uint8_t* scales, int lanes, int64_t nb,
                         const QRow* xs, float (*out)[kLanes], const Ahead& ahead) {
    if (B <= kWholeRows4 && lanes == kLanes) {
      strip_4bit_whole<B, kK>(w, scales, nb, xs, out, ahead);
      return;
    }
    const int64_t gs = 4 * lanes;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < lanes; h += 8) {
      const __m256i m = lane_mask(lanes, h);
      const int n = std::min(8, lanes - h);
      __m256 acc[B][kGroup];
      __m256 ds[kSuper], dm[kSuper];  // kK: the super-block's block scales and mins
      zero_partials(acc);
      for (int64_t j = 0; j < nb; ++j) {
        if constexpr (kK) {
          if (j % kSuper == 0) {
            decode_q4k(scales + j / kSuper * kSuperBytes * lanes, lanes, h, n, ds, dm);
          }
        }
        if (h == 0) ahead.block(j, lanes);
        const uint8_t* wj = w + j * 4 * gs + 4 * h;
        __m256i lo[4], hi[4];
        for (int i = 0; i < 4; ++i) {
          const __m256i v = group(wj + i * gs, lanes, h, m);
          lo[i] = _mm256_and_si256(v, low);
          hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        __m256 ws;
        if constexpr (kK) {
          ws = ds[j % kSuper];
        } else {
          const uint16_t* sj = reinterpret_cast<const uint16_t*>(scales) + j * lanes + h;
          if (n == 8) {  // a whole half: one load (the copy below cost a third of a call)
            ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sj)));
          } else {
            alignas(16) uint16_t hs[8] = {};
            std::memcpy(hs, sj, static_cast<size_t>(n) * 2);
            ws = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hs)));
          }
        }
        for (int b = 0; b < B; ++b) {
          __m256i xg[8];
          x_groups(xs[b].q, j, xg);
          __m256i s = dot4(lo, hi, xg);
          if constexpr (!kK) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * xs[b].s[j]));
          const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(xs[b].d[j]), ws);
          __m256& a = acc[b][j % kGroup];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, a);
          if constexpr (kK) {
            a = _mm256_fnmadd_ps(dm[j % kSuper], _mm256_set1_ps(x_block_sum(xs[b], j)), a);
          }
        }
      }
      store_trees(acc, out, h);
    }
  }
};
#pragma GCC pop_options

inline bool has_vnni() {
  static const bool has = __builtin_cpu_supports("avxvnni") && vnni_allowed();
  return has;
}
constexpr const char* kVnniName = "avxvnni";

#else  // generic (and NEON, for now): scalar loops

inline float tree16(const float* p) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

// The product and the sum round separately here (no FMA). The scalar loops are bound by their
// arithmetic: `ahead` is not used.
template <bool kVnni>
struct Kernels {
  static constexpr bool kPairs = false;  // one strip at a time (`run_strips`)

  template <int B>
  static void strip_i8(const uint8_t* w, int lanes, int64_t nb, const QRow* xs,
                       float (*out)[kLanes], const Ahead& ahead) {
    const int64_t gs = 4 * lanes;
    for (int l = 0; l < lanes; ++l) {
      for (int b = 0; b < B; ++b) {
        float acc[kGroup] = {};
        for (int64_t j = 0; j < nb; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < 8; ++i) {
            const int8_t* wg = reinterpret_cast<const int8_t*>(w + (j * 8 + i) * gs + 4 * l);
            const int8_t* xg = xs[b].q + (8 * j + i) * 4;
            for (int e = 0; e < 4; ++e) dot += static_cast<int32_t>(wg[e]) * xg[e];
          }
          const float prod = static_cast<float>(dot) * xs[b].d[j];
          acc[j % kGroup] = acc[j % kGroup] + prod;
        }
        out[b][l] = tree16(acc);
      }
    }
  }

  template <int B, bool kK>
  static void strip_4bit(const uint8_t* w, const uint8_t* scales, int lanes, int64_t nb,
                         const QRow* xs, float (*out)[kLanes], const Ahead& ahead) {
    const int64_t gs = 4 * lanes;
    const int32_t offset = kK ? 0 : 8;  // Q4_0-style codes are c + 8
    for (int l = 0; l < lanes; ++l) {
      for (int b = 0; b < B; ++b) {
        float acc[kGroup] = {};
        for (int64_t j = 0; j < nb; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i) {
            const uint8_t* wg = w + (j * 4 + i) * gs + 4 * l;
            const int8_t* xg = xs[b].q + j * kBlock + 4 * i;
            for (int e = 0; e < 4; ++e) {
              dot += (static_cast<int32_t>(wg[e] & 0x0F) - offset) * xg[e];
              dot += (static_cast<int32_t>(wg[e] >> 4) - offset) * xg[e + kBlock / 2];
            }
          }
          float& a = acc[j % kGroup];
          if constexpr (kK) {
            float ds, dm;
            q4k_lane_scales(scales + j / kSuper * kSuperBytes * lanes, lanes, l,
                            static_cast<int>(j % kSuper), ds, dm);
            a = a + static_cast<float>(dot) * (xs[b].d[j] * ds);
            a = a - dm * x_block_sum(xs[b], j);
          } else {
            const uint16_t s = reinterpret_cast<const uint16_t*>(scales)[j * lanes + l];
            a = a + static_cast<float>(dot) * (xs[b].d[j] * vec::f16_to_f32(s));
          }
        }
        out[b][l] = tree16(acc);
      }
    }
  }
};

inline bool has_vnni() { return false; }
constexpr const char* kVnniName = "none";

#endif

// The multiply instruction the kernels use on this CPU: "vpdpbusd" or "maddubs" (the level's
// vpmaddubsw + vpmaddwd), "scalar" on the generic level.
inline const char* instruction() {
#if defined(VLLM_MAMBA_VEC_AVX512) || defined(VLLM_MAMBA_VEC_AVX2)
  return has_vnni() ? "vpdpbusd" : "maddubs";
#else
  return "scalar";
#endif
}

// ---------------------------------------------------------------------------------------------
// Whether one row of x prefetches the strip ahead too, by CPU (read once). Measured with one
// row of x on 4-bit and int8 weights streamed from memory (2 threads):
// - Zen 3 (AVX2, no VNNI): a 4-bit call at 18-20 GB/s without, 23-30 with (int8 unchanged);
// - Zen 4 (AVX-512): one row's pass kept the hardware prefetchers' lead, and the prefetches
//   slowed a 4-bit Qwen3.5-0.8B's b1 step by 5-20% (session 6): off on AMD family 19h;
// - Zen 5 (AVX-512, family 1Ah): 4-bit 14.8 GB/s without, 32.4 with; int8 24.4 and 30.8.
// Other CPUs (Intel's) were not measured and prefetch. How far ahead: `ahead_bytes`.
inline bool amd_family_19h() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // AuthenticAMD
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned base = (a >> 8) & 0xfu, ext = (a >> 20) & 0xffu;
  return (base == 0xfu ? base + ext : base) == 0x19u;
#else
  return false;
#endif
}

inline bool ahead_one_row() {
#if defined(VLLM_MAMBA_VEC_AVX512)
  static const bool on = !amd_family_19h();
  return on;
#elif defined(VLLM_MAMBA_VEC_AVX2)
  return true;
#else
  return false;  // the scalar loops are bound by their arithmetic
#endif
}

// How far ahead of a strip's first byte the prefetches run (`Ahead`), for a weight of
// `strip_bytes` bytes per whole strip (code bytes; the 4-bit scales in proportion): with
// several rows of x the strip two ahead (measured on a Zen 4); with one row a fixed 8 KiB, up
// to the range's end and past it. On a Zen 5 (2 threads, one row, 768 MiB of weights at each
// of four LFM2-1.2B / Qwen3.5 shapes, ratios to `x.sum()` in the same run) int8 calls ran at
// 0.69-0.79 of the read rate two strips ahead (64 KiB for K = 2048, 256 KiB for K = 8192),
// stopping two strips before the range's end, and at 0.92-1.01 so; 4-bit calls 0.89-1.00
// before and 0.91-1.04 after (4, 8 and 16 KiB were alike in a first trial).
inline int64_t ahead_bytes(int64_t rows, int64_t strip_bytes) {
  return rows > 1 ? 2 * strip_bytes : 8 << 10;
}

// Rows [lo, hi) of a weight times rows [0, x.rows) of x: out[b * ldo + (r - lo)].
//
// The strips that hold rows [lo, hi) are read in order, each once per kMaxRows rows of x (with
// up to kMaxRows rows, decode, the weight is read from memory once); a strip only partly in
// the range is computed whole and stored in part (the callers split ranges on whole strips:
// `gemv::kRowBlock`). `strip(s, ns, lanes, nbx, xs, o, ahead)` computes strips s .. s + ns - 1
// (ns 2 only where `pairs`, for two whole strips in the range) into o[t * kMaxRows + b],
// prefetching the weight `ahead` bytes past the first strip's start (`ahead_bytes`; -1: none).
template <typename Strip>
inline void run_strips(const QActs& x, int64_t n, int64_t lo, int64_t hi, int64_t strip_bytes,
                       bool pairs, float* out, int64_t ldo, Strip&& strip) {
  QRow xs[kMaxRows];
  float o[2 * kMaxRows][kLanes];
  // several rows of x prefetch while the strip two ahead is in the range (the first pass over
  // this one fetches it), one row where `ahead_one_row()` (past the range's end too: a
  // prefetch never faults)
  const bool prefetch = x.rows > 1 || ahead_one_row();
  const int64_t dist = ahead_bytes(x.rows, strip_bytes);
  pairs = pairs && x.rows >= kPairRows;
  for (int64_t s = lo / kLanes; s * kLanes < hi;) {
    const int ns = pairs && s * kLanes >= lo && (s + 2) * kLanes <= std::min(hi, n) ? 2 : 1;
    const int lanes = strip_lanes(n, s);
    const int64_t r0 = std::max(lo, s * kLanes);
    const int64_t r1 = std::min(hi, s * kLanes + (ns == 2 ? 2 * kLanes : lanes));
    const bool in_range = x.rows == 1 || (s + 2) * kLanes < hi;
    const int64_t ahead = prefetch && in_range ? dist : -1;
    for (int64_t b0 = 0; b0 < x.rows; b0 += kMaxRows) {
      const int nbx = static_cast<int>(std::min<int64_t>(kMaxRows, x.rows - b0));
      for (int b = 0; b < nbx; ++b) xs[b] = x.row(b0 + b);
      strip(s, ns, lanes, nbx, xs, o, b0 == 0 ? ahead : -1);
      for (int b = 0; b < nbx; ++b) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t i = r - s * kLanes;
          out[(b0 + b) * ldo + (r - lo)] = o[i / kLanes * kMaxRows + b][i % kLanes];
        }
      }
    }
    s += ns;
  }
}

// Calls K::f<B> for B = nbx (1..kMaxRows).
#define VLLM_MAMBA_INT_DOT_BY_ROWS(nbx, CALL) \
  switch (nbx) {                              \
    case 1: CALL(1); break;                   \
    case 2: CALL(2); break;                   \
    case 3: CALL(3); break;                   \
    case 4: CALL(4); break;                   \
    default: CALL(5); break;                  \
  }

// out[b * ldo + (r - lo)] = the w8a8 product of int8 weight row r and quantised x row b, for
// rows r in [lo, hi) (w.k a multiple of 32, the k of x).
template <typename K>
inline void rows_i8_with(const I8Rows& w, const QActs& x, int64_t lo, int64_t hi, float* out,
                         int64_t ldo) {
  const int64_t nb = w.k / kBlock;
  const int64_t sb = kLanes * w.k;  // bytes per whole strip
  run_strips(x, w.n, lo, hi, sb, K::kPairs, out, ldo,
             [&](int64_t s, int ns, int lanes, int nbx, const QRow* xs, float (*o)[kLanes],
                 int64_t a) {
               const uint8_t* ws = reinterpret_cast<const uint8_t*>(w.q) + s * sb;
               Ahead ahead;
               if (a >= 0) ahead = {ws + a, nullptr, kLanes * kBlock, ns, sb, 0};
               if constexpr (K::kPairs) {
                 if (ns == 2) {
#define CALL(B) K::template pair_i8<B>(ws, sb, nb, xs, o, ahead)
                   VLLM_MAMBA_INT_DOT_BY_ROWS(nbx, CALL)
#undef CALL
                 }
               }
               if (ns == 1) {
#define CALL(B) K::template strip_i8<B>(ws, lanes, nb, xs, o, ahead)
                 VLLM_MAMBA_INT_DOT_BY_ROWS(nbx, CALL)
#undef CALL
               }
               const int ls = ns == 2 ? kLanes : lanes;  // lanes per strip
               for (int t = 0; t < ns; ++t) {
                 const float* sc = w.scale + (s + t) * kLanes;
                 for (int b = 0; b < nbx; ++b)
                   for (int l = 0; l < ls; ++l) o[t * kMaxRows + b][l] *= sc[l];
               }
             });
}

inline void rows_i8(const I8Rows& w, const QActs& x, int64_t lo, int64_t hi, float* out,
                    int64_t ldo) {
  if (lo >= hi) return;
  if (has_vnni()) {
    rows_i8_with<Kernels<true>>(w, x, lo, hi, out, ldo);
  } else {
    rows_i8_with<Kernels<false>>(w, x, lo, hi, out, ldo);
  }
}

// The same for a 4-bit weight: Q4_0-style (`rows_q4`, the w4a8 product) or, with kK,
// Q4_K-style (`rows_q4k`, w4a8_k); `scale_row_bytes` scale bytes per weight row.
template <typename K, bool kK>
inline void rows_4bit_with(const uint8_t* q, const uint8_t* scales, int64_t scale_row_bytes,
                           int64_t k, int64_t n, const QActs& x, int64_t lo, int64_t hi,
                           float* out, int64_t ldo) {
  const int64_t nb = k / kBlock;
  const int64_t sb = kLanes * (k / 2), ssb = kLanes * scale_row_bytes;  // per whole strip
  run_strips(x, n, lo, hi, sb, K::kPairs, out, ldo,
             [&](int64_t s, int ns, int lanes, int nbx, const QRow* xs, float (*o)[kLanes],
                 int64_t a) {
               const uint8_t* ws = q + s * sb;
               const uint8_t* ss = scales + s * ssb;
               Ahead ahead;
               if (a >= 0) {  // the scales as far ahead in proportion
                 ahead = {ws + a, ss + a * scale_row_bytes / (k / 2), kLanes * kBlock / 2, ns, sb,
                          ssb};
               }
               if constexpr (K::kPairs) {
                 if (ns == 2) {
#define CALL(B) K::template pair_4bit<B, kK>(ws, ss, sb, ssb, nb, xs, o, ahead)
                   VLLM_MAMBA_INT_DOT_BY_ROWS(nbx, CALL)
#undef CALL
                 }
               }
               if (ns == 1) {
#define CALL(B) K::template strip_4bit<B, kK>(ws, ss, lanes, nb, xs, o, ahead)
                 VLLM_MAMBA_INT_DOT_BY_ROWS(nbx, CALL)
#undef CALL
               }
             });
}

template <bool kK>
inline void rows_4bit(const uint8_t* q, const uint8_t* scales, int64_t scale_row_bytes,
                      int64_t k, int64_t n, const QActs& x, int64_t lo, int64_t hi, float* out,
                      int64_t ldo) {
  if (lo >= hi) return;
  if (has_vnni()) {
    rows_4bit_with<Kernels<true>, kK>(q, scales, scale_row_bytes, k, n, x, lo, hi, out, ldo);
  } else {
    rows_4bit_with<Kernels<false>, kK>(q, scales, scale_row_bytes, k, n, x, lo, hi, out, ldo);
  }
}

inline void rows_q4(const Q4Rows& w, const QActs& x, int64_t lo, int64_t hi, float* out,
                    int64_t ldo) {
  rows_4bit<false>(w.q, reinterpret_cast<const uint8_t*>(w.scales), 2 * (w.k / kBlock), w.k,
                   w.n, x, lo, hi, out, ldo);
}

inline void rows_q4k(const Q4KRows& w, const QActs& x, int64_t lo, int64_t hi, float* out,
                     int64_t ldo) {
  rows_4bit<true>(w.q, w.scales, super_blocks(w.k) * kSuperBytes, w.k, w.n, x, lo, hi, out,
                  ldo);
}

#undef VLLM_MAMBA_INT_DOT_BY_ROWS

}  // namespace int_dot
}  // namespace vllm_mamba
