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

constexpr int64_t kRowBlock = 8;  // weight rows per pass; ranges split on this unit
constexpr int64_t kQ4Group = 32;  // 4-bit weights sharing one scale

// out[r] = w[r, :k] . x[:k] for R consecutive rows of `w` (row stride k).
//
// For bfloat16 and int8 weights it prefetches (into L2) the rows two blocks of R ahead while
// it reads these, spread evenly over its steps: a block of 8 narrow rows is 8 short
// interleaved streams (768 bytes each for an int8 row of 768), which the hardware prefetchers
// follow poorly. Measured on 24 `mamba-130m` layers at 2, 4 and 8 rows of x (AVX-512),
// prefetching on and off interleaved in one process: +8-30% for int8, +1-15% for bfloat16,
// and -7 to -17% for float32, which therefore streams without it. (One row of x goes through
// `dot_row`.)
template <int R, typename W>
inline void dot_rows(const W* w, int64_t k, const float* x, float* out) {
  using vec::Vf;
  constexpr int L = vec::kLanes;
  Vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec::zero();
  const char* ahead = reinterpret_cast<const char*>(w + 2 * R * k);
  const int64_t ahead_lines = (R * k * static_cast<int64_t>(sizeof(W)) + 63) / 64;
  const int64_t steps = std::max<int64_t>(k / L, 1);
  const int64_t lines_per_step = (ahead_lines + steps - 1) / steps;
  int64_t line = 0;
  int64_t i = 0;
  constexpr bool kPrefetch = sizeof(W) < sizeof(float);
  for (; i + L <= k; i += L) {
    for (int64_t l = 0; kPrefetch && l < lines_per_step && line < ahead_lines; ++l, ++line) {
      vec::prefetch_l2(ahead + line * 64);
    }
    const Vf xv = vec::load(x + i);
    for (int r = 0; r < R; ++r) acc[r] = vec::fma(vec::load(w + r * k + i), xv, acc[r]);
  }
  if (i < k) {
    const int n = static_cast<int>(k - i);
    const Vf xv = vec::load_n(x + i, n);
    for (int r = 0; r < R; ++r) acc[r] = vec::fma(vec::load_n(w + r * k + i, n), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = vec::sum(acc[r]);
}

// w[:k] . x[:k] for one weight row, four independent accumulators. With one row of x the
// products read the weight strictly in order, which the hardware prefetchers follow better
// than blocks of 8 interleaved rows: 24 `mamba-130m` layers at batch 1 (AVX-512), interleaved
// in one process, streamed 50 against 40-41 GB/s (float32) and 40-41 against 34-35
// (bfloat16); int8 was equal. At 4 rows of x the blocks stay faster (26 against 23 GB/s).
template <typename W>
inline float dot_row(const W* w, int64_t k, const float* x) {
  using vec::Vf;
  constexpr int L = vec::kLanes;
  Vf a0 = vec::zero(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 4 * L <= k; i += 4 * L) {
    a0 = vec::fma(vec::load(w + i), vec::load(x + i), a0);
    a1 = vec::fma(vec::load(w + i + L), vec::load(x + i + L), a1);
    a2 = vec::fma(vec::load(w + i + 2 * L), vec::load(x + i + 2 * L), a2);
    a3 = vec::fma(vec::load(w + i + 3 * L), vec::load(x + i + 3 * L), a3);
  }
  for (; i + L <= k; i += L) a0 = vec::fma(vec::load(w + i), vec::load(x + i), a0);
  if (i < k) {
    const int n = static_cast<int>(k - i);
    a1 = vec::fma(vec::load_n(w + i, n), vec::load_n(x + i, n), a1);
  }
  return vec::sum(vec::add(vec::add(a0, a1), vec::add(a2, a3)));
}

// Rows ahead whose narrow (bfloat16, int8) weights a single-row product prefetches: rows of
// 768-1,536 bytes are streams too short for the hardware prefetchers to ramp up.
constexpr int64_t kPrefetchRows = 4;

// Narrow rows of at least this many bytes are long enough for the hardware prefetchers, and
// stream faster without software prefetches: RWKV-7 0.4B's 2 KiB bfloat16 rows (1,024 columns)
// decoded one stream at 34-36 against 30-32 tok/s (three interleaved runs each, AVX-512, Zen 5);
// its 1 KiB int8 rows still want them (39 against 47-54 tok/s without).
constexpr int64_t kPrefetchMaxRowBytes = 2048;

// Prefetches (into L2) the cache lines of one weight row of k narrow elements; nothing for
// float32 rows, which stream faster without (see `dot_rows`), nor for rows of
// `kPrefetchMaxRowBytes` or more.
template <typename W>
inline void prefetch_row(const W* row, int64_t k) {
  if constexpr (sizeof(W) < sizeof(float)) {
    if (k * static_cast<int64_t>(sizeof(W)) >= kPrefetchMaxRowBytes) return;
    const char* p = reinterpret_cast<const char*>(row);
    const int64_t bytes = k * static_cast<int64_t>(sizeof(W));
    for (int64_t off = 0; off < bytes; off += 64) vec::prefetch_l2(p + off);
  }
}

// out[b, r - lo] (row stride ldo) = w[r] . x[b] (row stride ldx) for rows r in [lo, hi) and
// batch rows b < batch; each block of kRowBlock weight rows is read from memory once.
template <typename W>
inline void gemv_rows(const W* w, int64_t k, const float* x, int64_t ldx, int64_t batch,
                      int64_t lo, int64_t hi, float* out, int64_t ldo) {
  if (batch == 1) {  // one row of x: stream the weight row by row (see `dot_row`)
    for (int64_t r = lo; r < hi; ++r) {
      if (r + kPrefetchRows < hi) prefetch_row(w + (r + kPrefetchRows) * k, k);
      out[r - lo] = dot_row(w + r * k, k, x);
    }
    return;
  }
  int64_t r = lo;
  for (; r + kRowBlock <= hi; r += kRowBlock) {
    for (int64_t b = 0; b < batch; ++b) {
      dot_rows<kRowBlock>(w + r * k, k, x + b * ldx, out + b * ldo + (r - lo));
    }
  }
  for (; r < hi; ++r) {
    for (int64_t b = 0; b < batch; ++b) {
      dot_rows<1>(w + r * k, k, x + b * ldx, out + b * ldo + (r - lo));
    }
  }
}

// `gemv_rows`, but each row of x summed exactly as one row alone is (`dot_row`): a row's bits
// do not depend on the batch (the rows of a speculative chain equal the tokens decoded one by
// one). Each weight row is read from memory once, the other rows of x reading it from L1.
template <typename W>
inline void gemv_rows_each(const W* w, int64_t k, const float* x, int64_t ldx, int64_t batch,
                           int64_t lo, int64_t hi, float* out, int64_t ldo) {
  for (int64_t r = lo; r < hi; ++r) {
    if (r + kPrefetchRows < hi) prefetch_row(w + (r + kPrefetchRows) * k, k);
    for (int64_t b = 0; b < batch; ++b) out[b * ldo + (r - lo)] = dot_row(w + r * k, k, x + b * ldx);
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
