// Matrix-vector products that stream a weight once for a few rows of x: the decode-time
// projections of the fused decode layers (`fused_decode.h`) and of the weight-only quantised
// linear ops. Written once on `vec.h`, so every ISA level gets the same kernels.
//
// Weights are float32, bfloat16 (`vec::bf16_t`), int8 (one float32 scale per row, applied by
// the caller) or 4-bit (`Q4Rows`: groups of 32 weights with a float16 scale each);
// activations and accumulation are float32. No torch header: the Arm kernel tests build it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace vllm_mamba {
namespace gemv {

constexpr int64_t kRowBlock = 16;  // weight rows per unit of a range split over threads: a strip
                                   // of the integer-dot layout (`int_dot.h`)
constexpr int64_t kQ4Group = 32;  // 4-bit weights sharing one scale

// A tile is kTileRows weight rows by up to kTileX rows of x, its R * B accumulators, R weight
// vectors and one x vector held in registers: 4 x 5 of AVX-512's and NEON's 32, 4 x 2 of AVX2's
// 16 (and of the generic level's, whose 8-lane vectors take two SSE registers each).
constexpr int kTileRows = 4;
#if defined(VLLM_MAMBA_VEC_AVX512) || defined(VLLM_MAMBA_VEC_NEON)
constexpr int kTileX = 5;
#else
constexpr int kTileX = 2;
#endif

// out[b * ldo + r] = w[r, :k] . x[b, :k] for R consecutive weight rows (row stride k) and B rows
// of x (row stride ldx).
//
// Every product (r, b) is summed the same way whatever R and B are: one vector accumulator
// over the vectors of the row in order (the tail of k masked into the same accumulator), then
// `vec::sum`. So a row of x gets the same bits alone, in a batch, or as one position of a
// speculative chain, and the kernel may tile freely. The tile loads each weight vector (widened
// once) for B rows of x and each x vector for R weight rows: a 5-row chain costs 1.1-1.2x one
// row on float32 / bfloat16 weights where one row at a time cost 2-3x (mb4 below).
//
// `ahead`: the weight bytes to prefetch (into L2) while this tile is read, spread evenly over
// its steps (nullptr: none, for a tile whose weight rows another pass already fetched). The
// callers prefetch two tiles ahead, for every weight dtype: R interleaved rows are R short
// streams which the hardware prefetchers follow poorly. Measured on a 235 MB float32, 117 MB
// bfloat16 and 59 MB int8 weight (k = 1,024, 2 threads, AVX-512, Zen 4), against the previous
// kernels (one row in order with four accumulators at batch 1, one row of x at a time in
// chains): batch 1 float32 8.0 against 9.6 ms, bfloat16 3.4 against 3.3, int8 1.5 against
// 1.8; 5 rows float32 9.1 against 13.3 (each-row exact: 15+), bfloat16 4.0 against 6.8, int8
// 3.4 against 5.5 (int8 at 5 rows is bound by the float multiply-adds: 1 per cycle).
template <int R, int B, typename W>
inline void dot_tile(const W* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo,
                     const char* ahead) {
  using vec::Vf;
  constexpr int L = vec::kLanes;
  Vf acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = vec::zero();
  const int64_t ahead_lines =
      ahead ? (R * k * static_cast<int64_t>(sizeof(W)) + 63) / 64 : 0;
  const int64_t steps = std::max<int64_t>(k / L, 1);
  const int64_t lines_per_step = (ahead_lines + steps - 1) / steps;
  int64_t line = 0;
  int64_t i = 0;
  for (; i + L <= k; i += L) {
    for (int64_t l = 0; l < lines_per_step && line < ahead_lines; ++l, ++line) {
      vec::prefetch_l2(ahead + line * 64);
    }
    Vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vec::load(w + r * k + i);
    for (int b = 0; b < B; ++b) {
      const Vf xv = vec::load(x + b * ldx + i);
      for (int r = 0; r < R; ++r) acc[r][b] = vec::fma(wv[r], xv, acc[r][b]);
    }
  }
  if (i < k) {
    const int n = static_cast<int>(k - i);
    Vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vec::load_n(w + r * k + i, n);
    for (int b = 0; b < B; ++b) {
      const Vf xv = vec::load_n(x + b * ldx + i, n);
      for (int r = 0; r < R; ++r) acc[r][b] = vec::fma(wv[r], xv, acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) out[b * ldo + r] = vec::sum(acc[r][b]);
}

// `dot_tile<R, nb>` for a run-time nb in [1, B].
template <int R, int B = kTileX, typename W>
inline void dot_tile_n(int nb, const W* w, int64_t k, const float* x, int64_t ldx, float* out,
                       int64_t ldo, const char* ahead) {
  if constexpr (B > 1) {
    if (nb < B) return dot_tile_n<R, B - 1>(nb, w, k, x, ldx, out, ldo, ahead);
  }
  dot_tile<R, B>(w, k, x, ldx, out, ldo, ahead);
}

// w[:k] . x[:k] for one weight row: `dot_tile`'s sum (the reference of its tests).
template <typename W>
inline float dot_row(const W* w, int64_t k, const float* x) {
  float out;
  dot_tile<1, 1>(w, k, x, 0, &out, 0, nullptr);
  return out;
}

// Narrow rows of at least this many bytes are long enough streams for the hardware prefetchers
// when read one row at a time: RWKV-7 0.4B's 2 KiB bfloat16 rows (1,024 columns) decoded one
// stream at 34-36 against 30-32 tok/s without software prefetches (AVX-512, Zen 5).
constexpr int64_t kPrefetchMaxRowBytes = 2048;

// Prefetches (into L2) the cache lines of one weight row of k narrow elements; nothing for
// float32 rows, nor for rows of `kPrefetchMaxRowBytes` or more. For the row-by-row kernels
// (`grouped_linear.cpp`, `widening_linear.cpp`, the 4-bit tiles below).
template <typename W>
inline void prefetch_row(const W* row, int64_t k) {
  if constexpr (sizeof(W) < sizeof(float)) {
    const int64_t bytes = k * static_cast<int64_t>(sizeof(W));
    if (bytes >= kPrefetchMaxRowBytes) return;
    const char* p = reinterpret_cast<const char*>(row);
    for (int64_t off = 0; off < bytes; off += 64) vec::prefetch_l2(p + off);
  }
}

// out[b, r - lo] (row stride ldo) = w[r] . x[b] (row stride ldx) for rows r in [lo, hi) and
// batch rows b < batch, each summed exactly as alone (`dot_tile`): tiles of kTileRows weight
// rows, each read from memory once for every row of x (kTileX rows of x per pass over the
// tile, the later passes reading it from L1), the rows two tiles ahead prefetched.
template <typename W>
inline void gemv_rows(const W* w, int64_t k, const float* x, int64_t ldx, int64_t batch,
                      int64_t lo, int64_t hi, float* out, int64_t ldo) {
  int64_t r = lo;
  for (; r + kTileRows <= hi; r += kTileRows) {
    const char* ahead = reinterpret_cast<const char*>(w + (r + 2 * kTileRows) * k);
    for (int64_t b = 0; b < batch; b += kTileX) {
      const int nb = static_cast<int>(std::min<int64_t>(kTileX, batch - b));
      dot_tile_n<kTileRows>(nb, w + r * k, k, x + b * ldx, ldx, out + b * ldo + (r - lo), ldo,
                            b == 0 ? ahead : nullptr);
    }
  }
  for (; r < hi; ++r) {
    for (int64_t b = 0; b < batch; b += kTileX) {
      const int nb = static_cast<int>(std::min<int64_t>(kTileX, batch - b));
      dot_tile_n<1>(nb, w + r * k, k, x + b * ldx, ldx, out + b * ldo + (r - lo), ldo, nullptr);
    }
  }
}

// A 4-bit weight (rows, k), k a multiple of 32: row r is k / 2 bytes at q + r * k / 2 (per
// group of 32, byte j holds weight j in its low nibble and weight j + 16 in its high one,
// each as q + 8 for q in [-8, 7]) and k / 32 float16 scales at scales + r * k / 32. Weight
// (r, i) stands for q * scale of its group: the layout of `vllm_mamba/ops/int4_linear.py`.
struct Q4Rows {
  const uint8_t* q;
  const uint16_t* scales;
  int64_t k;
};

// out[b][r] = w[r0 + r] . x[b] for R weight rows and B rows of x (row stride ldx): each group
// of 32 weights is unpacked to float32 once and multiplied with every row of x.
template <int R, int B>
inline void q4_tile(const Q4Rows& w, int64_t r0, const float* x, int64_t ldx, float out[B][R]) {
  using vec::Vf;
  constexpr int L = vec::kLanes;
  constexpr int kPer = kQ4Group / L;  // vectors per group
  const int64_t groups = w.k / kQ4Group;
  const int64_t row_bytes = w.k / 2;
  Vf acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = vec::zero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      Vf wq[kPer];
      vec::load_q4_group(w.q + row * row_bytes + g * (kQ4Group / 2), wq);
      const Vf s = vec::set1(vec::half(w.scales[row * groups + g]));
      for (int b = 0; b < B; ++b) {  // the group's products of q, then one scaled add
        const float* xg = x + b * ldx + g * kQ4Group;
        Vf t = vec::mul(wq[0], vec::load(xg));
        for (int j = 1; j < kPer; ++j) t = vec::fma(wq[j], vec::load(xg + j * L), t);
        acc[b][r] = vec::fma(t, s, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) out[b][r] = vec::sum(acc[b][r]);
}

// out[b, r - lo] (row stride ldo) = w[r] . x[b] for rows r in [lo, hi) of a 4-bit weight and
// batch rows b < batch. One row of x takes weight rows four at a time; more take them in
// tiles of 4 rows of x by 4 weight rows (2 below 16 lanes, whose 16 vector registers would
// spill 16 accumulators).
template <int R>
inline void gemv_q4_tiles(const Q4Rows& w, const float* x, int64_t ldx, int64_t batch,
                          int64_t r0, int64_t lo, float* out, int64_t ldo) {
  int64_t b = 0;
  for (; b + 4 <= batch; b += 4) {
    float o[4][R];
    q4_tile<R, 4>(w, r0, x + b * ldx, ldx, o);
    for (int bb = 0; bb < 4; ++bb)
      for (int j = 0; j < R; ++j) out[(b + bb) * ldo + (r0 - lo) + j] = o[bb][j];
  }
  for (; b < batch; ++b) {
    float o[1][R];
    q4_tile<R, 1>(w, r0, x + b * ldx, ldx, o);
    for (int j = 0; j < R; ++j) out[b * ldo + (r0 - lo) + j] = o[0][j];
  }
}

inline void gemv_rows_q4(const Q4Rows& w, const float* x, int64_t ldx, int64_t batch,
                         int64_t lo, int64_t hi, float* out, int64_t ldo) {
  constexpr int kWide = vec::kLanes >= 16 ? 4 : 2;
  int64_t r = lo;
  if (batch == 1) {
    const int64_t groups = w.k / kQ4Group;
    for (; r + 4 <= hi; r += 4) {
      // The rows two tiles ahead (`prefetch_row`): 4-bit rows are 384-768 bytes.
      for (int64_t p = r + 8; p < std::min(hi, r + 12); ++p) {
        prefetch_row(w.q + p * (w.k / 2), w.k / 2);
        vec::prefetch_l2(w.scales + p * groups);
      }
      gemv_q4_tiles<4>(w, x, ldx, batch, r, lo, out, ldo);
    }
  } else {
    for (; r + kWide <= hi; r += kWide) gemv_q4_tiles<kWide>(w, x, ldx, batch, r, lo, out, ldo);
  }
  for (; r < hi; ++r) gemv_q4_tiles<1>(w, x, ldx, batch, r, lo, out, ldo);
}

// A float32 view of `n` state values for an update in place: the values themselves for a
// float32 state; for a bfloat16 state, `buf` filled with them widened (then written back by
// `store_state`). Both directions are vectorised.
inline float* load_state(float* st, float*, int64_t) { return st; }
inline float* load_state(vec::bf16_t* st, float* buf, int64_t n) {
  int64_t i = 0;
  for (; i + vec::kLanes <= n; i += vec::kLanes) vec::store(buf + i, vec::load(st + i));
  for (; i < n; ++i) buf[i] = vec::bf16_to_f32(st[i].bits);
  return buf;
}

inline void store_state(const float*, float*, int64_t) {}
inline void store_state(const float* buf, vec::bf16_t* st, int64_t n) {
  int64_t i = 0;  // round to nearest even, as c10::BFloat16
  for (; i + vec::kLanes <= n; i += vec::kLanes) vec::store(st + i, vec::load(buf + i));
  for (; i < n; ++i) st[i].bits = vec::f32_to_bf16(buf[i]);
}

}  // namespace gemv
}  // namespace vllm_mamba
