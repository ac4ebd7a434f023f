// Weight-only int8 linear layers: out (M, N) = x (M, K) @ (qweight (N, K) * scale (N,))^T + bias.
//
// The weight is int8 with one float32 scale per output channel (symmetric, see
// `vllm_mamba/ops/int8_linear.py`); activations are float32 or bfloat16 and the product is
// accumulated in float32, so the only error against a float model is the weight rounding.
//
// Two paths, chosen by the number of rows:
// - up to kMaxF32TiledRows float32 / kMaxBf16TiledRows bfloat16 rows (decode): a tiled kernel
//   that streams each weight row once, widens 16 int8 values to float32 per step and multiplies
//   them with several input rows, four weight rows at a time (independent accumulators hide the
//   FMA latency). The scale is applied to the finished dot product. Threads split the output
//   channels.
// - more rows (prefill, many-stream decode): the weight is dequantised a block of output
//   channels at a time into a float32 (or bfloat16) buffer that stays in the cache, and the
//   block is multiplied by a dense GEMM: oneDNN's float32 linear (`onednn_linear.h`) or ATen's
//   bfloat16 `mm` (oneDNN as well).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "onednn_linear.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VLLM_MAMBA_INT8_AVX512 1
#endif

namespace vllm_mamba {
namespace {

constexpr int64_t kMaxBf16TiledRows = 32;   // bfloat16 rows of x up to which the tiled kernel runs
constexpr int64_t kMaxF32TiledRows = 256;   // float32 rows of x up to which the tiled kernel runs
constexpr int64_t kGemvRowGroup = 4;         // rows of x sharing one pass over a weight row
constexpr int64_t kWeightRowsPerStep = 4;    // weight rows sharing one pass over x
constexpr int64_t kMinTaskBytes = 1 << 15;   // int8 weight bytes per parallel task, at least
constexpr int64_t kBlockElems = 1 << 20;     // dequantised weight elements per GEMM block
constexpr int64_t kRowBlock = 64;            // rows of x per pass of the tiled kernel

#ifdef VLLM_MAMBA_INT8_AVX512

// Sixteen int8 weights from `w` (the first `mask` lanes) widened to float32.
inline __m512 load_w16(const int8_t* w, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
}

inline __m512 load_w16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// dots[r][j] = x row r . weight row j, for NR weight rows starting at `w` and MR rows of x.
template <int NR, int MR>
inline void dot_tile(const int8_t* w, const float* const* xs, int64_t k, float dots[MR][NR]) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w16(w + j * k + i);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(xs[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  if (i < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1u);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w16(w + j * k + i, mask);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xs[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) dots[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

#else

template <int NR, int MR>
inline void dot_tile(const int8_t* w, const float* const* xs, int64_t k, float dots[MR][NR]) {
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) {
      const int8_t* wr = w + j * k;
      const float* x = xs[r];
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < k; ++i) total += static_cast<float>(wr[i]) * x[i];
      dots[r][j] = total;
    }
  }
}

#endif

template <typename T>
inline void store(T* out, float v) { *out = static_cast<T>(v); }

// Output channels [n0, n0 + NR) for the MR rows of x starting at row m0.
template <int NR, int MR, typename T>
inline void gemv_tile(const int8_t* qw, const float* scale, const float* bias, const float* x,
                      T* out, int64_t m0, int64_t n0, int64_t n, int64_t k) {
  const float* xs[MR];
  for (int r = 0; r < MR; ++r) xs[r] = x + (m0 + r) * k;
  float dots[MR][NR];
  dot_tile<NR, MR>(qw + n0 * k, xs, k, dots);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) {
      const float b = bias ? bias[n0 + j] : 0.0f;
      store(out + (m0 + r) * n + n0 + j, dots[r][j] * scale[n0 + j] + b);
    }
  }
}

// All rows of x against output channels [n0, n0 + NR).
template <int NR, typename T>
inline void gemv_rows(const int8_t* qw, const float* scale, const float* bias, const float* x,
                      T* out, int64_t m, int64_t n0, int64_t n, int64_t k) {
  int64_t m0 = 0;
  for (; m0 + kGemvRowGroup <= m; m0 += kGemvRowGroup)
    gemv_tile<NR, 4>(qw, scale, bias, x, out, m0, n0, n, k);
  switch (m - m0) {
    case 3: gemv_tile<NR, 3>(qw, scale, bias, x, out, m0, n0, n, k); break;
    case 2: gemv_tile<NR, 2>(qw, scale, bias, x, out, m0, n0, n, k); break;
    case 1: gemv_tile<NR, 1>(qw, scale, bias, x, out, m0, n0, n, k); break;
    default: break;
  }
}

template <typename T>
void gemv(const int8_t* qw, const float* scale, const float* bias, const float* x, T* out,
          int64_t m, int64_t n, int64_t k) {
  const int64_t steps = (n + kWeightRowsPerStep - 1) / kWeightRowsPerStep;
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(k * kWeightRowsPerStep, 1));
  at::parallel_for(0, steps, grain, [&](int64_t lo, int64_t hi) {
    // A block of x rows stays in the L2 cache while this task's weight rows pass over it.
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t rows = std::min<int64_t>(kRowBlock, m - m0);
      const float* xb = x + m0 * k;
      T* ob = out + m0 * n;
      for (int64_t s = lo; s < hi; ++s) {
        const int64_t n0 = s * kWeightRowsPerStep;
        if (n0 + kWeightRowsPerStep <= n) {
          gemv_rows<kWeightRowsPerStep>(qw, scale, bias, xb, ob, rows, n0, n, k);
        } else {
          for (int64_t j = n0; j < n; ++j) gemv_rows<1>(qw, scale, bias, xb, ob, rows, j, n, k);
        }
      }
    }
  });
}

inline void dequantize_row(const int8_t* src, float s, float* dst, int64_t k) {
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<float>(src[i]) * s;
}

inline void dequantize_row(const int8_t* src, float s, c10::BFloat16* dst, int64_t k) {
  int64_t i = 0;
#if defined(VLLM_MAMBA_INT8_AVX512) && defined(__AVX512BF16__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; i + 16 <= k; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(load_w16(src + i), sv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(v));
  }
#endif
  for (; i < k; ++i) dst[i] = static_cast<c10::BFloat16>(static_cast<float>(src[i]) * s);
}

// buf (rows, K) = qweight[n0 : n0 + rows] * scale, in the buffer's dtype.
template <typename T>
void dequantize_block(const int8_t* qw, const float* scale, T* buf, int64_t n0, int64_t rows,
                      int64_t k) {
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) dequantize_row(qw + (n0 + r) * k, scale[n0 + r], buf + r * k, k);
  });
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                const at::Tensor& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  const int64_t block = std::min<int64_t>(n, std::max<int64_t>(16, kBlockElems / std::max<int64_t>(k, 1)));
  at::Tensor buf = at::empty({block, k}, x.options());
  at::Tensor out = at::empty({m, n}, x.options());
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n; n0 += block) {
    const int64_t rows = std::min<int64_t>(block, n - n0);
    at::Tensor w = buf.narrow(0, 0, rows);
    if (x.scalar_type() == at::kFloat) {
      dequantize_block(qw, sc, w.data_ptr<float>(), n0, rows, k);
    } else {
      dequantize_block(qw, sc, w.data_ptr<c10::BFloat16>(), n0, rows, k);
    }
    if (rows == n) {
      if (x.scalar_type() == at::kFloat && onednn_linear(x, w, bias, out)) return out;
      return bias.defined() ? at::addmm(bias.to(x.scalar_type()), x, w.t()) : at::mm(x, w.t());
    }
    at::Tensor part = out.narrow(1, n0, rows);
    const at::Tensor part_bias = bias.defined() ? bias.narrow(0, n0, rows) : at::Tensor();
    if (x.scalar_type() == at::kFloat && onednn_linear(x, w, part_bias, part)) continue;
    if (bias.defined()) {
      at::addmm_out(part, bias.narrow(0, n0, rows).to(x.scalar_type()), x, w.t());
    } else {
      at::mm_out(part, x, w.t());
    }
  }
  return out;
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "int8_linear: x must be (M, K)");
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == x_in.size(1),
              "int8_linear: qweight must be (N, K) with the K of x");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "int8_linear: qweight must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == qweight.size(0),
              "int8_linear: scale must be contiguous float32 (N,)");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "int8_linear: x must be float32 or bfloat16");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = qweight.size(0);
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->numel() == n, "int8_linear: bias must be (N,)");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  if (m > (x_in.scalar_type() == at::kBFloat16 ? kMaxBf16TiledRows : kMaxF32TiledRows)) {
    return gemm(x_in.contiguous(), qweight, scale, bias);
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x_in.options());
  if (m == 0 || n == 0) return out;
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat) {
    gemv(qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), b, x.data_ptr<float>(),
         out.data_ptr<float>(), m, n, k);
  } else {
    gemv(qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), b, x.data_ptr<float>(),
         out.data_ptr<c10::BFloat16>(), m, n, k);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("int8_linear", &int8_linear); }

}  // namespace vllm_mamba
