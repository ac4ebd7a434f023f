// A bfloat16 GEMM for few rows against a weight read in place: AVX512-BF16 `vdpbf16ps`.
//
//   out[i, j] (float32) = bf16(sum_k x_i[k] * w[j, k])   for i < m, j in [0, n)
//
// x's rows and w (n, K) row-major are bfloat16 (the checkpoint's own layout: no repacked copy),
// every product exact and summed in float32, each result rounded to bfloat16 (round to nearest
// even) as a bfloat16 `mm` rounds it, then widened back to float32.
//
// The GEMM's tile is the dot-product form: kMR rows of x times kNR rows of w, each of the
// kMR x kNR accumulators a vector of 16 partial sums over K that is summed across its lanes at
// the end (`hsum4`). The weight's rows stream once per block of kNR rows while every row of x
// reads them from L1 (the rows of x stay in L2), and the first tile of a block prefetches the
// next block's rows (or the caller's `next` weight after the last block). It serves an MoE's
// experts, whose 4-64 rows per expert leave a packed GEMM (oneDNN's bfloat16 `mm`, which
// reorders the weight on every call) at about a third of the CPU's bfloat16 peak: one expert
// of Qwen3.6-35B-A3B (16 rows, 2048 -> 1024) took `mm` 250 us on 2 threads of a Zen 5 and this
// kernel about 180 us, the weight streaming from memory (`benchmarks/moe_experts_bench.py`).
//
// Only the avx512 build has it, and only a CPU with AVX512-BF16 runs it (`available()`); the
// functions carry their own target attribute since x86-64-v4 does not include AVX512-BF16.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "vec.h"

#if defined(VLLM_MAMBA_VEC_AVX512) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VLLM_MAMBA_BF16_GEMM 1
#endif

namespace vllm_mamba {
namespace bf16_gemm {

constexpr int kMR = 4;  // rows of x per tile
constexpr int kNR = 4;  // rows of w per tile

#ifdef VLLM_MAMBA_BF16_GEMM

// Whether this CPU runs the kernel: AVX512-BF16, and `VLLM_MAMBA_BF16_GEMM` not "0" (which
// keeps `mm` for every expert, to compare; read at each call, so that a test may set it).
inline bool available() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  const char* env = std::getenv("VLLM_MAMBA_BF16_GEMM");
  return has && !(env != nullptr && std::string(env) == "0");
}

// The tile's functions inline into one another (their accumulators must stay in registers);
// `block`, called from code without AVX512-BF16, is a function of its own.
#define VLLM_MAMBA_BF16_TARGET __attribute__((target("avx512bf16"), always_inline))
#define VLLM_MAMBA_BF16_ENTRY __attribute__((target("avx512bf16"), noinline))

// A prefetch into L1 that the compiler keeps (see `int_dot::prefetch_l2`).
inline void prefetch_l1(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}

// The four lane sums of a, b, c, d: {sum a, sum b, sum c, sum d}.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[i][j] += x_i[kk .. kk + 32) . w_j[kk .. kk + 32) (the lanes of `mask`; the others read
// as zeros), prefetching the same columns of `pf`'s NR rows where it is not null.
template <int MR, int NR>
VLLM_MAMBA_BF16_TARGET inline void step(__m512 (&acc)[MR][NR], const uint16_t* const* x,
                                        const uint16_t* w, int64_t k, int64_t kk,
                                        __mmask32 mask, const uint16_t* pf) {
  __m512i wv[NR];
  for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * k + kk);
  if (pf != nullptr) {
    for (int j = 0; j < NR; ++j) prefetch_l1(pf + j * k + kk);
  }
  for (int i = 0; i < MR; ++i) {
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[i] + kk);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
  }
}

// The result rounded to bfloat16, stored as float32 (widened back) or as bfloat16 bits.
inline void store(float* o, float v) { *o = vec::bf16_to_f32(vec::f32_to_bf16(v)); }
inline void store(uint16_t* o, float v) { *o = vec::f32_to_bf16(v); }

// out[i * ldo + j] = bf16(x_i . w_j) for i < MR, j < NR; w_j = w + j * k; `pf` (or null): NR
// rows of stride k to prefetch as the tile goes.
template <int MR, int NR, typename Out>
VLLM_MAMBA_BF16_TARGET inline void tile(const uint16_t* const* x, const uint16_t* w, int64_t k,
                                        Out* out, int64_t ldo, const uint16_t* pf) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) step<MR, NR>(acc, x, w, k, kk, ~__mmask32{0}, pf);
  if (kk < k) step<MR, NR>(acc, x, w, k, kk, static_cast<__mmask32>((1u << (k - kk)) - 1u), pf);
  for (int i = 0; i < MR; ++i) {
    float sums[4];
    if constexpr (NR == 4) {
      _mm_storeu_ps(sums, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    } else {
      for (int j = 0; j < NR; ++j) sums[j] = _mm512_reduce_add_ps(acc[i][j]);
    }
    for (int j = 0; j < NR; ++j) store(out + i * ldo + j, sums[j]);
  }
}

template <int MR, typename Out>
VLLM_MAMBA_BF16_TARGET inline void tile_rows(int nr, const uint16_t* const* x, const uint16_t* w,
                                             int64_t k, Out* out, int64_t ldo,
                                             const uint16_t* pf) {
  switch (nr) {
    case 4: return tile<MR, 4, Out>(x, w, k, out, ldo, pf);
    case 3: return tile<MR, 3, Out>(x, w, k, out, ldo, pf);
    case 2: return tile<MR, 2, Out>(x, w, k, out, ldo, pf);
    default: return tile<MR, 1, Out>(x, w, k, out, ldo, pf);
  }
}

// out[i * ldo + j] = bf16(x[i] . w[j]) for i < m, j < n: x[i] a row of k bfloat16 values, w
// (n, k) row-major, `out` float32 (the values widened) or bfloat16 bits (`Out` uint16_t);
// `next` (or null): the weight rows the caller reads after these, prefetched as the last block
// goes.
template <typename Out = float>
VLLM_MAMBA_BF16_ENTRY inline void block(const uint16_t* const* x, int64_t m, const uint16_t* w,
                                         int64_t n, int64_t k, Out* out, int64_t ldo,
                                         const uint16_t* next) {
  for (int64_t j = 0; j < n; j += kNR) {
    const int nr = static_cast<int>(n - j < kNR ? n - j : kNR);
    const uint16_t* pf = j + kNR < n ? w + (j + kNR) * k : next;
    for (int64_t i = 0; i < m; i += kMR) {
      const uint16_t* const* xi = x + i;
      const uint16_t* p = i == 0 ? pf : nullptr;
      Out* o = out + i * ldo + j;
      const uint16_t* wj = w + j * k;
      switch (m - i < kMR ? m - i : kMR) {
        case 4: tile_rows<4, Out>(nr, xi, wj, k, o, ldo, p); break;
        case 3: tile_rows<3, Out>(nr, xi, wj, k, o, ldo, p); break;
        case 2: tile_rows<2, Out>(nr, xi, wj, k, o, ldo, p); break;
        default: tile_rows<1, Out>(nr, xi, wj, k, o, ldo, p); break;
      }
    }
  }
}

#undef VLLM_MAMBA_BF16_TARGET
#undef VLLM_MAMBA_BF16_ENTRY

#else

inline bool available() { return false; }

template <typename Out = float>
inline void block(const uint16_t* const*, int64_t, const uint16_t*, int64_t, int64_t, Out*,
                  int64_t, const uint16_t*) {}

#endif

constexpr int64_t kTaskRows = 64;  // output channels per task of `gemm`
// Rows of x up to which a dense bfloat16 product takes `gemm` in place of `mm` (`fused::
// project`, `cpu_kernels.linear` through `bf16_gemm_linear`): Qwen3.6-35B-A3B's head (248,320 x
// 2048) at 32 rows took `mm` and its float32 copy about 100 ms on 2 threads of a Zen 5, `gemm`
// 64-70 ms; from about 64 rows `mm`'s packed GEMM leads where the weight stays in the cache.
constexpr int64_t kMaxRows = 32;

// out (m, n), row stride ldo = bf16(x (m, k), row stride ldx, @ w (n, k)^T), the output
// channels split over ATen's threads in tasks of kTaskRows, each prefetching its successor's
// weight rows.
template <typename Out>
inline void gemm(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t n,
                 int64_t k, Out* out, int64_t ldo) {
  std::vector<const uint16_t*> rows(m);
  for (int64_t i = 0; i < m; ++i) rows[i] = x + i * ldx;
  const int64_t tasks = (n + kTaskRows - 1) / kTaskRows;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kTaskRows, r1 = std::min(n, r0 + kTaskRows);
      block<Out>(rows.data(), m, w + r0 * k, r1 - r0, k, out + r0, ldo,
                 t + 1 < t1 ? w + r1 * k : nullptr);
    }
  });
}

}  // namespace bf16_gemm
}  // namespace vllm_mamba
