// Register-blocked tiles of small float32 matmuls, shared by the kernels that run them inside
// a task (the chunked Gated DeltaNet prefill, the paged attention's scores and value update):
//
//   C[0:MR, 0:nw] = s_r C + A[0:MR, 0:K] @ B[0:K, 0:nw]   (row-major, leading dims lda, ldb, ldc)
//
// Each element of C is one chain: the scaled C (or zero), then one fused multiply-add per k in k
// order. So an element's bits depend on neither MR, NB nor the tile it falls in (a row's
// result is the same whichever rows are computed beside it). No torch header.
#pragma once

#include <cstdint>

namespace vllm_mamba {
namespace small_gemm {

// The scale s_r of row r: `rows[r]` where given, else `all`; `all == 0` without `rows`
// ignores C's prior content (C may be uninitialised).
struct Scale {
  float all = 0.0f;
  const float* rows = nullptr;
};

// The tile for nw <= NB columns (NB a compile-time width: MR * NB / lanes accumulator vectors).
template <int MR, int64_t NB>
inline void tile(int64_t K, int64_t nw, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, Scale scale) {
  float c[MR][NB] = {};
  if (scale.rows != nullptr || scale.all != 0.0f) {
    for (int r = 0; r < MR; ++r) {
      const float s = scale.rows != nullptr ? scale.rows[r] : scale.all;
      for (int64_t j = 0; j < nw; ++j) c[r][j] = s * C[r * ldc + j];
    }
  }
  if (nw == NB) {
    for (int64_t k = 0; k < K; ++k) {
      const float* b = B + k * ldb;
#pragma GCC unroll 12
      for (int r = 0; r < MR; ++r) {
        const float a = A[r * lda + k];
#pragma omp simd
        for (int64_t j = 0; j < NB; ++j) c[r][j] += a * b[j];
      }
    }
  } else {
    float b[NB] = {};  // B's row, zero past nw
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t j = 0; j < nw; ++j) b[j] = B[k * ldb + j];
#pragma GCC unroll 12
      for (int r = 0; r < MR; ++r) {
        const float a = A[r * lda + k];
#pragma omp simd
        for (int64_t j = 0; j < NB; ++j) c[r][j] += a * b[j];
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < nw; ++j) C[r * ldc + j] = c[r][j];
  }
}

// Calls fn(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= kMaxRows (<= 12).
template <int kMaxRows, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  static_assert(kMaxRows >= 1 && kMaxRows <= 12, "1 to 12 rows");
  switch (rows) {
#define VLLM_MAMBA_SMALL_GEMM_ROWS(R)                         \
  case R:                                                     \
    if constexpr (R <= kMaxRows) fn(std::integral_constant<int, R>{}); \
    break;
    VLLM_MAMBA_SMALL_GEMM_ROWS(1)
    VLLM_MAMBA_SMALL_GEMM_ROWS(2)
    VLLM_MAMBA_SMALL_GEMM_ROWS(3)
    VLLM_MAMBA_SMALL_GEMM_ROWS(4)
    VLLM_MAMBA_SMALL_GEMM_ROWS(5)
    VLLM_MAMBA_SMALL_GEMM_ROWS(6)
    VLLM_MAMBA_SMALL_GEMM_ROWS(7)
    VLLM_MAMBA_SMALL_GEMM_ROWS(8)
    VLLM_MAMBA_SMALL_GEMM_ROWS(9)
    VLLM_MAMBA_SMALL_GEMM_ROWS(10)
    VLLM_MAMBA_SMALL_GEMM_ROWS(11)
    VLLM_MAMBA_SMALL_GEMM_ROWS(12)
#undef VLLM_MAMBA_SMALL_GEMM_ROWS
    default:
      break;
  }
}

// The tile over rows [0, rows) of A and C in blocks of kMaxRows.
template <int kMaxRows, int64_t NB>
inline void rows_tile(int64_t rows, int64_t K, int64_t nw, const float* A, int64_t lda,
                      const float* B, int64_t ldb, float* C, int64_t ldc, Scale scale) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const Scale s{scale.all, scale.rows != nullptr ? scale.rows + r0 : nullptr};
    with_rows<kMaxRows>(rows - r0 < kMaxRows ? rows - r0 : kMaxRows, [&](auto R) {
      tile<decltype(R)::value, NB>(K, nw, A + r0 * lda, lda, B, ldb, C + r0 * ldc, ldc, s);
    });
  }
}

}  // namespace small_gemm
}  // namespace vllm_mamba
