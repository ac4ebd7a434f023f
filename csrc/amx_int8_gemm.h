// The batched path of `int8_linear` (32 to 256 rows: many-stream decode) for float32
// activations on CPUs with AMX (Intel Sapphire Rapids and later): out (M, N) = x (M, K) @
// (qweight (N, K) * scale (N,))^T + bias, at the accuracy of the float32 kernels, on the
// bfloat16 tile units.
//
// A bfloat16 product is exact in float32, and so is the split of a float32 value into three
// bfloat16 parts: hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid) add up to x (8 + 8
// + 8 significand bits). An int8 weight is exact in bfloat16 too. So
//   x . w = hi . w + mid . w + lo . w
// computed by AMX `tdpbf16ps` (exact products, float32 accumulation) has the error of a float32
// dot product, and the row's scale multiplies the finished sum as in the tiled kernel. The three
// tile products and the widening ran one call of 64-128 rows 1.6-2x faster than the FMA kernel.
//
// Layout (the weight is the tile product's A operand, so it is only widened, never transposed):
//   C (kWRows, 3 * kXRows) float32 = W block (kWRows, K) bfloat16 @ P (K, 3 * kXRows)
// where P holds kXRows rows of x, split, as columns 3c + part, in the VNNI layout the tile
// unit reads (pairs of consecutive k interleaved: P[k / 2][col][k % 2]). Every call uses the
// same block shape (padded with zero rows and columns), so ATen's brgemm (a oneDNN ukernel,
// JIT-compiled and cached per shape and thread) compiles one kernel per K.
//
// Glossary: M rows of x, K input features, N output channels; a "part" is hi, mid or lo.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "vec.h"

namespace vllm_mamba {
namespace amx {

constexpr int64_t kParts = 3;     // bfloat16 parts of a float32 activation
constexpr int64_t kXRows = 32;    // rows of x per packed block (3 * 32 tile columns)
constexpr int64_t kWRows = 64;    // weight rows (output channels) per tile product
constexpr int64_t kCols = kParts * kXRows;
constexpr int64_t kRowPad = 32;   // bfloat16 after each widened weight row: rows K apart
                                  // (K a power of two) would share L1 sets
// Rows of x from which the tile path beats the tiled FMA kernel: at least 32, and K / 64 (the
// widening of the weight, N x K per call, pays off over fewer rows when K is short). Measured
// on two Sapphire Rapids-class cores, one int8 call, AVX-512 FMAs against tiles (ms): K = 1024,
// N = 1024: 0.25 / 0.32 at 24 rows, 0.33 / 0.28 at 32, 0.65 / 0.42 at 64; K = 4096, N = 1024:
// 1.3 / 1.5 at 32, 2.6 / 2.6 at 64, 4.8 / 3.3 at 128.
constexpr int64_t kMinRows = 32;

// Whether this build and CPU run the bfloat16 tile products: the AVX-512 build on a CPU whose
// oneDNN ISA has AMX (ATen's `could_pack`), unless VLLM_MAMBA_AMX=0.
inline bool available() {
#if defined(VLLM_MAMBA_VEC_AVX512)
  static const bool ok = [] {
    const char* env = std::getenv("VLLM_MAMBA_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    return at::native::cpublas::could_pack(at::kBFloat16);
  }();
  return ok;
#else
  return false;
#endif
}

// Whether the tile path beats the tiled FMA kernel for these sizes (float32 x); `int8_linear`
// asks only up to the rows where that kernel gives way to its block GEMM.
inline bool use_for(int64_t m, int64_t k) {
  return m >= std::max(kMinRows, k / 64) && k % 2 == 0 && available();
}

// Packs rows [m0, m0 + kXRows) of x (M, K) float32 into `dst` (K / 2, kCols) uint32 pairs:
// column 3c + part holds that part of row m0 + c; rows past M are zeros. A vector of k at a
// time for every row, so each stretch of `dst` is written whole while it is in the L1 cache.
inline void pack_block(const float* x, int64_t m, int64_t k, int64_t m0, uint32_t* dst) {
  constexpr int L = vec::kLanes;
  const vec::Vf minus_one = vec::set1(-1.0f);
  const int64_t rows = std::min(kXRows, m - m0);
  alignas(64) vec::bf16_t parts[kParts][L];  // read back as uint32 pairs
  for (int64_t i = 0; i < k; i += L) {
    const int n = static_cast<int>(std::min<int64_t>(L, k - i));
    uint32_t* out = dst + (i / 2) * kCols;
    for (int64_t c = 0; c < rows; ++c) {
      vec::Vf rest = vec::load_n(x + (m0 + c) * k + i, n);  // zeros past the row's end
      for (int64_t p = 0; p < kParts; ++p) {
        vec::store(parts[p], rest);                             // rounds to nearest even
        rest = vec::fma(vec::load(parts[p]), minus_one, rest);  // the exact remainder
      }
      for (int64_t p = 0; p < kParts; ++p) {  // two bfloat16 of consecutive k: one pair
        const auto* pairs = reinterpret_cast<const uint32_t*>(parts[p]);
        for (int j = 0; j < n / 2; ++j) out[j * kCols + kParts * c + p] = pairs[j];
      }
    }
    for (int j = 0; j + 1 < n; j += 2) {
      std::fill(out + (j / 2) * kCols + kParts * rows, out + (j / 2 + 1) * kCols, 0u);
    }
  }
}

// buf (kWRows, K), row stride lda = qweight rows [n0, n0 + kWRows) as exact bfloat16 integers
// (`widen_row(r, dst)` writes row r); rows past N are zeros.
template <typename WidenRow>
inline void widen_block(WidenRow& widen_row, int64_t n, int64_t k, int64_t lda, int64_t n0,
                        vec::bf16_t* buf) {
  for (int64_t r = 0; r < kWRows; ++r) {
    vec::bf16_t* dst = buf + r * lda;
    if (n0 + r < n) {
      widen_row(n0 + r, dst);
    } else {
      std::memset(dst, 0, sizeof(vec::bf16_t) * k);
    }
  }
}

// out[m0 + c][n0 + i] = (sum of the parts of C[i][3c..3c+2]) * scale + bias, for the rows and
// channels that exist.
inline void store_block(const float* c_buf, const float* scale, const float* bias, float* out,
                        int64_t m, int64_t n, int64_t m0, int64_t n0) {
  const int64_t rows = std::min(kXRows, m - m0), chans = std::min(kWRows, n - n0);
  for (int64_t c = 0; c < rows; ++c) {
    float* o = out + (m0 + c) * n + n0;
    for (int64_t i = 0; i < chans; ++i) {
      const float* ci = c_buf + i * kCols + kParts * c;
      o[i] = ((ci[0] + ci[1]) + ci[2]) * scale[n0 + i] + (bias ? bias[n0 + i] : 0.0f);
    }
  }
}

// out (M, N) float32 = x (M, K) float32 @ (qweight * scale)^T + bias on the tile units, where
// `widen_row(r, dst)` writes qweight row r (K values) as bfloat16 into `dst`. Requires
// `use_for(M, K)`.
//
// The work is one task per (block of kWRows weight rows, group of x blocks): a single group
// unless there are fewer weight blocks than threads (a LoRA's 32-128 channels). The threads
// take tasks in order from a shared counter, so a thread that runs slower (a busy core of a
// shared host) takes fewer of them; a task widens its weight block unless the thread's
// previous task had the same one.
template <typename WidenRow>
at::Tensor int8_gemm(const at::Tensor& x_in, WidenRow&& widen_row, const float* scale, int64_t n,
                     const at::Tensor& bias) {
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t x_blocks = (m + kXRows - 1) / kXRows;
  const int64_t w_blocks = (n + kWRows - 1) / kWRows;
  const int64_t block_pairs = (k / 2) * kCols;
  const int64_t lda = k + kRowPad;
  // Written whole by pack_block, so not zeroed first (nor are the buffers below).
  const std::unique_ptr<uint32_t[]> packed(new uint32_t[x_blocks * block_pairs]);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, x_blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      pack_block(xp, m, k, b * kXRows, packed.get() + b * block_pairs);
    }
  });
  at::Tensor out = at::empty({m, n}, x.options());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t groups = std::min(x_blocks, std::max<int64_t>(1, threads / w_blocks));
  const int64_t tasks = w_blocks * groups;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
    const std::unique_ptr<vec::bf16_t[]> w_buf(new vec::bf16_t[kWRows * lda]);
    const std::unique_ptr<float[]> c_buf(new float[kWRows * kCols]);
    const auto* a = reinterpret_cast<const at::BFloat16*>(w_buf.get());
    int64_t widened = -1;
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t wb = t / groups, g = t % groups;
      if (wb != widened) {
        widen_block(widen_row, n, k, lda, wb * kWRows, w_buf.get());
        widened = wb;
      }
      for (int64_t xb = g * x_blocks / groups; xb < (g + 1) * x_blocks / groups; ++xb) {
        const auto* b = reinterpret_cast<const at::BFloat16*>(packed.get() + xb * block_pairs);
        at::native::cpublas::brgemm(kWRows, kCols, k, lda, kCols, kCols, false, a, b,
                                    c_buf.get(), true);
        store_block(c_buf.get(), scale, bp, op, m, n, xb * kXRows, wb * kWRows);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}

}  // namespace amx
}  // namespace vllm_mamba
