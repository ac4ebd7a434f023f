// Integer dot products (`quantization="w8a8"` / `"w4a8"`): each row of x is quantised to int8
// in blocks of 32 with one float32 scale per block (llama.cpp's Q8_0 activations), and the
// weight rows (int8 with one float32 scale per row, or the 4-bit groups of `gemv::Q4Rows`) are
// multiplied with it in integers, block by block:
//
//   x block j:  d_j = amax_j / 127,  q_i = round_half_even(x_i / d_j)  (all zero when amax_j = 0)
//   int8:   out = scale_row * sum_j (d_j * dot_j),   dot_j = sum_i q_i w_i  (int32, exact)
//   4-bit:  out = sum_j ((d_j * s_j) * dot_j),       dot_j = sum_i q_i c_i  (c_i in [-8, 7])
//
// The block sums are exact integers (|dot_j| <= 32 * 127 * 128); only the float sum over blocks
// rounds. Its order is fixed, the same for every number of rows of x (so a row's result never
// depends on the batch) and on the AVX2 and AVX-512 levels: block j is added (by a fused
// multiply-add) into partial sum j % 16, in block order, and the 16 partial sums are added as
// a tree (p_i + p_(i+8), then + 4, + 2, + 1). The generic level rounds the product and the sum
// separately (no FMA there). `vllm_mamba/ops/int_dot_linear.py` is the reference.
//
// ISA: the avx512 build multiplies with AVX512-VNNI's vpdpbusd where the CPU has it (a runtime
// check; x86-64-v4 does not include it), else AVX-512BW's vpmaddubsw + vpmaddwd; the avx2 build
// with AVX-VNNI's vpdpbusd where present, else AVX2's vpmaddubsw + vpmaddwd; the generic build
// in scalar loops. vpdpbusd multiplies unsigned by signed bytes: an int8 weight's sign moves to
// x (|w| * sign(w) x), a 4-bit code is unsigned (c + 8) and 8 * sum(q) is subtracted per block.
//
// Shapes: K input features (a multiple of 32), NB = K / 32 blocks, padded to NBP (a multiple of
// 16, `padded_blocks`) in the quantised rows, whose padding is zero. No torch header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "vec.h"

namespace vllm_mamba {
namespace int_dot {

constexpr int64_t kBlock = 32;  // activations sharing one scale
constexpr int64_t kGroup = 16;  // blocks per step: the float partial sums
constexpr int kMaxRows = 4;     // rows of x sharing one pass over a weight row

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
// are zero. Scalar code the compiler vectorises: the same rounding on every level.
inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* s,
                         int64_t nbp) {
  const int64_t nb = k / kBlock;
  for (int64_t j = 0; j < nb; ++j) {
    const float* xb = x + j * kBlock;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.0f;
    int8_t* qb = q + j * kBlock;
    int32_t sum = 0;
    if (scale > 0.0f) {
#pragma omp simd reduction(+ : sum)
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
};

// Rows (row stride ldx) of x quantised into `out`, one after another.
inline void quantize(const float* x, int64_t ldx, int64_t rows, int64_t k, QActs& out) {
  out.resize(rows, k);
  for (int64_t b = 0; b < rows; ++b) out.quantize(b, x + b * ldx, k);
}

// An int8 weight (rows, k) with one float32 scale per row.
struct I8Rows {
  const int8_t* q;
  const float* scale;
  int64_t k;
};

// Whether the kernels may use VNNI where the CPU has it: unless VLLM_MAMBA_INT_DOT_VNNI=0 (read
// once per process), which runs the maddubs kernels instead (the tests compare both).
inline bool vnni_allowed() {
  const char* env = std::getenv("VLLM_MAMBA_INT_DOT_VNNI");
  return !(env && env[0] == '0');
}

// ---------------------------------------------------------------------------------------------
// The kernels of one weight row and B rows of x: out[b] = the row's result with x row xs[b].
// Each level defines `Vnni::row_i8<B>`, `row_q4<B>` (and `Plain::` where it has a VNNI and a
// non-VNNI variant) with the same arguments.

#if defined(VLLM_MAMBA_VEC_AVX512)

// The 16 lanes of the fixed tree sum.
inline float sum16(__m512 acc) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// Byte mask of the first n of 64 bytes (n clamped to [0, 64]).
inline __mmask64 byte_mask(int64_t n) {
  return n >= 64 ? ~__mmask64{0} : n <= 0 ? __mmask64{0} : (__mmask64{1} << n) - 1;
}

// The exact sums of 16 blocks, in block order, from 8 vectors of 16 int32 partial sums
// (vector c: lanes 0-7 block 2c, lanes 8-15 block 2c + 1).
inline __m512i reduce16(const __m512i v[8]) {
  __m512i t[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit chunk: the pairs of v[2i] and v[2i + 1]
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  }
  // chunk q of u0: the sums of chunk q of v[0..3]; of u1: of v[4..7]
  const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]),
                                      _mm512_unpackhi_epi64(t[0], t[1]));
  const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]),
                                      _mm512_unpackhi_epi64(t[2], t[3]));
  // chunk 0 + 1 of a vector is its first block, 2 + 3 its second: lanes hold blocks
  // 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15, put in order by one permute.
  const __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order =
      _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  return _mm512_permutexvar_epi32(order, s);
}

// The kernels, written once for both multiply instructions (kVnni: vpdpbusd). The region is
// compiled with AVX512-VNNI enabled so that `Kernels<true>` may use it (the callers check the
// CPU: `has_vnni`); `Kernels<false>` holds no VNNI instruction (checked with objdump on GCC 12:
// the compiler does not fuse vpmaddubsw + vpmaddwd, whose first saturates).
#pragma GCC push_options
#pragma GCC target("avx512vnni")
template <bool kVnni>
struct Kernels {
  // sum over 4-byte groups of u8 a times s8 b, into 16 int32 lanes
  static inline __m512i dot(__m512i a, __m512i b) {
    if constexpr (kVnni) {
      return _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
    } else {
      return _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1));
    }
  }

  template <int B>
  static void row_i8(const int8_t* w, float scale, int64_t nb, const QRow* xs, float* out) {
    __m512 acc[B];
    for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g * kGroup < nb; ++g) {
      const int64_t bytes = (nb - g * kGroup) * kBlock;  // of this row, from the group on
      const int8_t* wg = w + g * kGroup * kBlock;
      __m512i aw[8];
      __mmask64 neg[8];
      for (int c = 0; c < 8; ++c) {
        const __m512i v = bytes >= kGroup * kBlock
                              ? _mm512_loadu_si512(wg + 64 * c)
                              : _mm512_maskz_loadu_epi8(byte_mask(bytes - 64 * c), wg + 64 * c);
        aw[c] = _mm512_abs_epi8(v);
        neg[c] = _mm512_movepi8_mask(v);
      }
      for (int b = 0; b < B; ++b) {
        const int8_t* xg = xs[b].q + g * kGroup * kBlock;
        __m512i v[8];
        for (int c = 0; c < 8; ++c) {
          const __m512i x = _mm512_loadu_si512(xg + 64 * c);
          v[c] = dot(aw[c], _mm512_mask_sub_epi8(x, neg[c], _mm512_setzero_si512(), x));
        }
        const __m512 dots = _mm512_cvtepi32_ps(reduce16(v));
        acc[b] = _mm512_fmadd_ps(dots, _mm512_loadu_ps(xs[b].d + g * kGroup), acc[b]);
      }
    }
    for (int b = 0; b < B; ++b) out[b] = sum16(acc[b]) * scale;
  }

  template <int B>
  static void row_q4(const uint8_t* w, const uint16_t* scales, int64_t nb, const QRow* xs,
                     float* out) {
    __m512 acc[B];
    for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g * kGroup < nb; ++g) {
      const int64_t blocks = std::min<int64_t>(kGroup, nb - g * kGroup);
      const uint8_t* wg = w + g * kGroup * (kBlock / 2);
      __m512i cw[8];
      for (int c = 0; c < 8; ++c) {  // blocks 2c, 2c + 1: bytes [A | B] -> [A lo A hi B lo B hi]
        const __m256i v = _mm256_maskz_loadu_epi8(
            static_cast<__mmask32>(byte_mask(blocks * 16 - 32 * c)), wg + 32 * c);
        const __m512i v2 = _mm512_castsi256_si512(v);
        const __m512i aabb = _mm512_shuffle_i32x4(v2, v2, _MM_SHUFFLE(1, 1, 0, 0));
        cw[c] = _mm512_and_si512(
            _mm512_mask_srli_epi16(aabb, __mmask32{0xFF00FF00u}, aabb, 4), low);
      }
      const __m512 ws = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
          static_cast<__mmask16>((1u << blocks) - 1u), scales + g * kGroup));
      for (int b = 0; b < B; ++b) {
        const int8_t* xg = xs[b].q + g * kGroup * kBlock;
        __m512i v[8];
        for (int c = 0; c < 8; ++c) v[c] = dot(cw[c], _mm512_loadu_si512(xg + 64 * c));
        const __m512i sums = _mm512_loadu_si512(xs[b].s + g * kGroup);
        const __m512i exact = _mm512_sub_epi32(reduce16(v), _mm512_slli_epi32(sums, 3));
        const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(xs[b].d + g * kGroup), ws);
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), sc, acc[b]);
      }
    }
    for (int b = 0; b < B; ++b) out[b] = sum16(acc[b]);
  }
};
#pragma GCC pop_options

inline bool has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") && vnni_allowed();
  return has;
}
constexpr const char* kVnniName = "avx512vnni";

#elif defined(VLLM_MAMBA_VEC_AVX2)

inline float sum16(__m256 lo, __m256 hi) {
  const __m256 h = _mm256_add_ps(lo, hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// The exact sums of 8 blocks, in order, from their vectors of 8 int32 partial sums.
inline __m256i reduce8(const __m256i v[8]) {
  const __m256i a =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

#pragma GCC push_options
#pragma GCC target("avxvnni")
template <bool kVnni>
struct Kernels {
  static inline __m256i dot(__m256i a, __m256i b) {
    if constexpr (kVnni) {
      return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
    } else {
      return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
    }
  }

  // The exact dots of blocks [j0, j0 + 8) (those below nb; the others 0) of an int8 row.
  static inline __m256i load32(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }

  static inline __m256i dots_i8(const int8_t* w, int64_t j0, int64_t nb, const int8_t* x) {
    __m256i v[8];
    for (int c = 0; c < 8; ++c) {
      if (j0 + c < nb) {
        const __m256i wv = load32(w + (j0 + c) * kBlock);
        const __m256i xv = load32(x + (j0 + c) * kBlock);
        v[c] = dot(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
      } else {
        v[c] = _mm256_setzero_si256();
      }
    }
    return reduce8(v);
  }

  static inline __m256i dots_q4(const uint8_t* w, int64_t j0, int64_t nb, const int8_t* x,
                                const int32_t* sums) {
    __m256i v[8];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int c = 0; c < 8; ++c) {
      if (j0 + c < nb) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (j0 + c) * 16));
        const __m256i cw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low),
                                            _mm_and_si128(b, low));
        v[c] = dot(cw, load32(x + (j0 + c) * kBlock));
      } else {
        v[c] = _mm256_setzero_si256();
      }
    }
    const __m256i s = load32(sums + j0);
    return _mm256_sub_epi32(reduce8(v), _mm256_slli_epi32(s, 3));
  }

  template <int B>
  static void row_i8(const int8_t* w, float scale, int64_t nb, const QRow* xs, float* out) {
    for (int b = 0; b < B; ++b) {
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t j0 = 0; j0 < nb; j0 += kGroup) {
        for (int h = 0; h < 2; ++h) {
          const __m256 dots = _mm256_cvtepi32_ps(dots_i8(w, j0 + 8 * h, nb, xs[b].q));
          acc[h] = _mm256_fmadd_ps(dots, _mm256_loadu_ps(xs[b].d + j0 + 8 * h), acc[h]);
        }
      }
      out[b] = sum16(acc[0], acc[1]) * scale;
    }
  }

  template <int B>
  static void row_q4(const uint8_t* w, const uint16_t* scales, int64_t nb, const QRow* xs,
                     float* out) {
    for (int b = 0; b < B; ++b) {
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t j0 = 0; j0 < nb; j0 += kGroup) {
        for (int h = 0; h < 2; ++h) {
          const int64_t j = j0 + 8 * h;
          uint16_t ws[8] = {};
          std::memcpy(ws, scales + j, static_cast<size_t>(std::clamp<int64_t>(nb - j, 0, 8)) * 2);
          const __m256 w16 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws)));
          const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(xs[b].d + j), w16);
          const __m256 dots = _mm256_cvtepi32_ps(dots_q4(w, j, nb, xs[b].q, xs[b].s));
          acc[h] = _mm256_fmadd_ps(dots, sc, acc[h]);
        }
      }
      out[b] = sum16(acc[0], acc[1]);
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

inline float sum16(const float* p) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

template <bool kVnni>
struct Kernels {
  template <int B>
  static void row_i8(const int8_t* w, float scale, int64_t nb, const QRow* xs, float* out) {
    for (int b = 0; b < B; ++b) {
      float acc[kGroup] = {};
      for (int64_t j = 0; j < nb; ++j) {
        const int8_t* wb = w + j * kBlock;
        const int8_t* xb = xs[b].q + j * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(wb[i]) * xb[i];
        const float prod = static_cast<float>(dot) * xs[b].d[j];
        acc[j % kGroup] = acc[j % kGroup] + prod;
      }
      out[b] = sum16(acc) * scale;
    }
  }

  template <int B>
  static void row_q4(const uint8_t* w, const uint16_t* scales, int64_t nb, const QRow* xs,
                     float* out) {
    for (int b = 0; b < B; ++b) {
      float acc[kGroup] = {};
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* wb = w + j * (kBlock / 2);
        const int8_t* xb = xs[b].q + j * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock / 2; ++i) {
          dot += (static_cast<int32_t>(wb[i] & 0x0F) - 8) * xb[i];
          dot += (static_cast<int32_t>(wb[i] >> 4) - 8) * xb[i + kBlock / 2];
        }
        const float sc = xs[b].d[j] * vec::f16_to_f32(scales[j]);
        const float prod = static_cast<float>(dot) * sc;
        acc[j % kGroup] = acc[j % kGroup] + prod;
      }
      out[b] = sum16(acc);
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
// Rows [lo, hi) of a weight times rows [0, x.rows) of x: out[b * ldo + (r - lo)].
//
// Weight rows go in tiles that stay in L1 (`kTileBytes`); each tile meets the rows of x in
// groups of up to kMaxRows, one weight row at a time (its vectors loaded once per group). With
// up to kMaxRows rows of x (decode) each weight row is read from memory once, in order, the
// rows kPrefetchRows ahead prefetched (rows of 512 bytes to 2 KiB are streams too short for the
// hardware prefetchers, as `gemv.h` measured).

constexpr int64_t kTileBytes = 16 << 10;
constexpr int64_t kPrefetchRows = 4;

// `base` / `row_bytes`: the weight's rows, for the prefetches; `base2` / `row_bytes2` a second
// per-row array (4-bit scales) or nullptr.
template <typename Row>
inline void run_rows(const QActs& x, int64_t lo, int64_t hi, float* out, int64_t ldo,
                     const char* base, int64_t row_bytes, const char* base2, int64_t row_bytes2,
                     Row&& row) {
  const int64_t tile = std::max<int64_t>(1, kTileBytes / std::max<int64_t>(row_bytes, 1));
  QRow xs[kMaxRows];
  float o[kMaxRows];
  for (int64_t r0 = lo; r0 < hi; r0 += tile) {
    const int64_t r1 = std::min(hi, r0 + tile);
    for (int64_t b0 = 0; b0 < x.rows; b0 += kMaxRows) {
      const int nbx = static_cast<int>(std::min<int64_t>(kMaxRows, x.rows - b0));
      for (int b = 0; b < nbx; ++b) xs[b] = x.row(b0 + b);
      for (int64_t r = r0; r < r1; ++r) {
        if (b0 == 0 && r + kPrefetchRows < hi) {
          const char* p = base + (r + kPrefetchRows) * row_bytes;
          for (int64_t off = 0; off < row_bytes; off += 64) vec::prefetch_l2(p + off);
          if (base2) vec::prefetch_l2(base2 + (r + kPrefetchRows) * row_bytes2);
        }
        row(r, nbx, xs, o);
        for (int b = 0; b < nbx; ++b) out[(b0 + b) * ldo + (r - lo)] = o[b];
      }
    }
  }
}

// One weight row with nbx (1..kMaxRows) rows of x, by kernel set K.
template <typename K>
inline void i8_row(const I8Rows& w, int64_t r, int nbx, const QRow* xs, float* o) {
  const int8_t* wr = w.q + r * w.k;
  const int64_t nb = w.k / kBlock;
  switch (nbx) {
    case 1: K::template row_i8<1>(wr, w.scale[r], nb, xs, o); break;
    case 2: K::template row_i8<2>(wr, w.scale[r], nb, xs, o); break;
    case 3: K::template row_i8<3>(wr, w.scale[r], nb, xs, o); break;
    default: K::template row_i8<4>(wr, w.scale[r], nb, xs, o); break;
  }
}

template <typename K>
inline void q4_row(const gemv::Q4Rows& w, int64_t r, int nbx, const QRow* xs, float* o) {
  const int64_t nb = w.k / kBlock;
  const uint8_t* wr = w.q + r * (w.k / 2);
  const uint16_t* sr = w.scales + r * nb;
  switch (nbx) {
    case 1: K::template row_q4<1>(wr, sr, nb, xs, o); break;
    case 2: K::template row_q4<2>(wr, sr, nb, xs, o); break;
    case 3: K::template row_q4<3>(wr, sr, nb, xs, o); break;
    default: K::template row_q4<4>(wr, sr, nb, xs, o); break;
  }
}

// out[b * ldo + (r - lo)] = the w8a8 product of int8 weight row r and quantised x row b, for
// rows r in [lo, hi) (w.k a multiple of 32, the k of x).
inline void rows_i8(const I8Rows& w, const QActs& x, int64_t lo, int64_t hi, float* out,
                    int64_t ldo) {
  const char* base = reinterpret_cast<const char*>(w.q);
  auto run = [&](auto row) { run_rows(x, lo, hi, out, ldo, base, w.k, nullptr, 0, row); };
  if (has_vnni()) {
    run([&](int64_t r, int n, const QRow* xs, float* o) { i8_row<Kernels<true>>(w, r, n, xs, o); });
  } else {
    run([&](int64_t r, int n, const QRow* xs, float* o) {
      i8_row<Kernels<false>>(w, r, n, xs, o);
    });
  }
}

// The same for a 4-bit weight (`gemv::Q4Rows`): the w4a8 product.
inline void rows_q4(const gemv::Q4Rows& w, const QActs& x, int64_t lo, int64_t hi, float* out,
                    int64_t ldo) {
  const char* base = reinterpret_cast<const char*>(w.q);
  const char* scales = reinterpret_cast<const char*>(w.scales);
  auto run = [&](auto row) {
    run_rows(x, lo, hi, out, ldo, base, w.k / 2, scales, w.k / kBlock * 2, row);
  };
  if (has_vnni()) {
    run([&](int64_t r, int n, const QRow* xs, float* o) { q4_row<Kernels<true>>(w, r, n, xs, o); });
  } else {
    run([&](int64_t r, int n, const QRow* xs, float* o) {
      q4_row<Kernels<false>>(w, r, n, xs, o);
    });
  }
}

}  // namespace int_dot
}  // namespace vllm_mamba
