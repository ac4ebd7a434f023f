// Linear layers whose weights are narrower than float32, widened to float32 in registers:
//
//   int8_linear: out (M, N) = x (M, K) @ (qweight (N, K) * scale (N,))^T + bias, the weight
//     int8 with one float32 scale per output channel (`quantization="int8"`, symmetric, see
//     `vllm_mamba/ops/int8_linear.py`);
//   bf16_linear: out (M, N) = x (M, K) @ weight (N, K)^T + bias, a bfloat16 weight, for CPUs
//     without bfloat16 instructions (`vllm_mamba.ops.cpu_kernels.linear`), where a bfloat16
//     GEMM falls to a slow path.
//
// Activations are float32 or bfloat16 and products accumulate in float32, so an int8 layer's
// only error against the float model is the weight rounding. Three paths, by rows and CPU:
// - up to kMaxTiledRows (kMaxNativeBf16TiledRows when the block GEMM runs in bfloat16): a
//   tiled kernel that streams each weight row once, widens a vector of weights to float32 per
//   step and multiplies it with several rows of x, four weight rows at a time (independent
//   accumulators hide the FMA latency); an int8 row's scale is applied to the finished dot
//   product. Threads split the output channels.
// - on a CPU with AMX, int8 weights and float32 activations of `amx::use_for`'s rows up to
//   kMaxTiledRows: instead of the tiled kernel, the bfloat16 tile products of
//   `amx_int8_gemm.h`, with float32 accuracy (activations split into three exact parts). Above
//   kMaxTiledRows (a prefill chunk) the block GEMM below stays: RWKV-7 0.4B's 512-token int8
//   prefill ran at 335-351 tok/s with it against 302-333 on the tiles (interleaved runs).
// - more rows (prefill, many-stream decode): the weight is widened a block of output channels
//   at a time into a buffer that stays in the cache, and the block is multiplied by a dense
//   GEMM: oneDNN's float32 linear (`onednn_linear.h`), or ATen's bfloat16 `mm` for bfloat16
//   activations on a CPU with bfloat16 instructions (`vec::native_bf16`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "amx_int8_gemm.h"
#include "block_gemm.h"
#include "gemv.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kMaxNativeBf16TiledRows = 32;  // rows up to which the tiled kernel runs, when
                                                 // the block GEMM would run in bfloat16
constexpr int64_t kMaxTiledRows = 256;            // rows up to which it runs otherwise
// Rows of x sharing one pass over a weight row: 4 x 4 accumulators fit 32 vector registers,
// 2 x 4 fit 16 (AVX2, NEON).
constexpr int64_t kGemvRowGroup = vec::kLanes >= 16 ? 4 : 2;
constexpr int64_t kWeightRowsPerStep = 4;    // weight rows sharing one pass over x
constexpr int64_t kMinTaskBytes = 1 << 15;   // weight bytes per parallel task, at least
constexpr int64_t kRowBlock = 64;            // rows of x per pass of the tiled kernel

// dots[r][j] = x row r . weight row j, for NR weight rows starting at `w` and MR rows of x:
// each step widens one vector of weights (int8 or bfloat16) per row to float32 and multiplies it with
// every row of x (`vec.h`, so every ISA level runs this kernel).
template <int NR, int MR, typename W>
inline void dot_tile(const W* w, const float* const* xs, int64_t k, float dots[MR][NR]) {
  using vec::Vf;
  constexpr int L = vec::kLanes;
  Vf acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = vec::zero();
  int64_t i = 0;
  for (; i + L <= k; i += L) {
    Vf wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vec::load(w + j * k + i);
    for (int r = 0; r < MR; ++r) {
      const Vf xv = vec::load(xs[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = vec::fma(wv[j], xv, acc[r][j]);
    }
  }
  if (i < k) {
    const int n = static_cast<int>(k - i);
    Vf wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vec::load_n(w + j * k + i, n);
    for (int r = 0; r < MR; ++r) {
      const Vf xv = vec::load_n(xs[r] + i, n);
      for (int j = 0; j < NR; ++j) acc[r][j] = vec::fma(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) dots[r][j] = vec::sum(acc[r][j]);
}

template <typename T>
inline void store(T* out, float v) { *out = static_cast<T>(v); }

// Output channels [n0, n0 + NR) for the MR rows of x starting at row m0.
template <int NR, int MR, typename W, typename T>
inline void gemv_tile(const W* qw, const float* scale, const float* bias, const float* x,
                      T* out, int64_t m0, int64_t n0, int64_t n, int64_t k) {
  const float* xs[MR];
  for (int r = 0; r < MR; ++r) xs[r] = x + (m0 + r) * k;
  float dots[MR][NR];
  dot_tile<NR, MR>(qw + n0 * k, xs, k, dots);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) {
      const float b = bias ? bias[n0 + j] : 0.0f;
      store(out + (m0 + r) * n + n0 + j, (scale ? dots[r][j] * scale[n0 + j] : dots[r][j]) + b);
    }
  }
}

// All rows of x against output channels [n0, n0 + NR).
template <int NR, typename W, typename T>
inline void gemv_rows(const W* qw, const float* scale, const float* bias, const float* x,
                      T* out, int64_t m, int64_t n0, int64_t n, int64_t k) {
  int64_t m0 = 0;
  for (; m0 + kGemvRowGroup <= m; m0 += kGemvRowGroup)
    gemv_tile<NR, kGemvRowGroup>(qw, scale, bias, x, out, m0, n0, n, k);
  switch (m - m0) {
    case 3: gemv_tile<NR, 3>(qw, scale, bias, x, out, m0, n0, n, k); break;
    case 2: gemv_tile<NR, 2>(qw, scale, bias, x, out, m0, n0, n, k); break;
    case 1: gemv_tile<NR, 1>(qw, scale, bias, x, out, m0, n0, n, k); break;
    default: break;
  }
}

template <typename W, typename T>
void gemv(const W* qw, const float* scale, const float* bias, const float* x, T* out,
          int64_t m, int64_t n, int64_t k) {
  const int64_t steps = (n + kWeightRowsPerStep - 1) / kWeightRowsPerStep;
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(k * kWeightRowsPerStep * int64_t{sizeof(W)}, 1));
  at::parallel_for(0, steps, grain, [&](int64_t lo, int64_t hi) {
    // A block of x rows stays in the L2 cache while this task's weight rows pass over it.
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t rows = std::min<int64_t>(kRowBlock, m - m0);
      const float* xb = x + m0 * k;
      T* ob = out + m0 * n;
      for (int64_t s = lo; s < hi; ++s) {
        const int64_t n0 = s * kWeightRowsPerStep;
        if (m0 == 0 && s + 2 < hi) {  // the rows two steps ahead: short streams (`gemv.h`)
          const int64_t ahead = n0 + 2 * kWeightRowsPerStep;
          for (int64_t j = ahead; j < std::min(n, ahead + kWeightRowsPerStep); ++j) {
            gemv::prefetch_row(qw + j * k, k);
          }
        }
        if (n0 + kWeightRowsPerStep <= n) {
          gemv_rows<kWeightRowsPerStep>(qw, scale, bias, xb, ob, rows, n0, n, k);
        } else {
          for (int64_t j = n0; j < n; ++j) gemv_rows<1>(qw, scale, bias, xb, ob, rows, j, n, k);
        }
      }
    }
  });
}

// dst[:k] = src[:k] * s, widened to float32 or rounded to bfloat16.
template <typename W>
inline void widen_row(const W* src, float s, float* dst, int64_t k) {
  const vec::Vf sv = vec::set1(s);
  int64_t i = 0;
  for (; i + vec::kLanes <= k; i += vec::kLanes) vec::store(dst + i, vec::mul(vec::load(src + i), sv));
  if (i < k) {
    const int n = static_cast<int>(k - i);
    vec::store_n(dst + i, vec::mul(vec::load_n(src + i, n), sv), n);
  }
}

template <typename W>
inline void widen_row(const W* src, float s, c10::BFloat16* dst, int64_t k) {
  auto* out = reinterpret_cast<vec::bf16_t*>(dst);
  const vec::Vf sv = vec::set1(s);
  int64_t i = 0;
  for (; i + vec::kLanes <= k; i += vec::kLanes) vec::store(out + i, vec::mul(vec::load(src + i), sv));
  float tail[vec::kLanes];
  if (i < k) {
    const int n = static_cast<int>(k - i);
    vec::store_n(tail, vec::mul(vec::load_n(src + i, n), sv), n);
    for (int j = 0; j < n; ++j) out[i + j].bits = vec::f32_to_bf16(tail[j]);
  }
}

// buf (rows, K) = weight[n0 : n0 + rows] (* scale), in the buffer's dtype.
template <typename W, typename T>
void widen_block(const W* qw, const float* scale, T* buf, int64_t n0, int64_t rows, int64_t k) {
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(k * int64_t{sizeof(W)}, 1));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      widen_row(qw + (n0 + r) * k, scale ? scale[n0 + r] : 1.0f, buf + r * k, k);
    }
  });
}

// out (M, N) in x's dtype by blocks of widened weight rows and a dense GEMM (`block_gemm.h`).
template <typename W>
at::Tensor gemm(const at::Tensor& x_in, const W* qw, const float* sc, int64_t n,
                const at::Tensor& bias) {
  return block_gemm(x_in, n, bias, [&](auto* buf, int64_t n0, int64_t rows, int64_t k) {
    widen_block(qw, sc, buf, n0, rows, k);
  });
}

// x (M, K) @ widened weight^T (+ bias): the tiled kernel or the block GEMM, by M.
template <typename W>
at::Tensor widening_linear(const at::Tensor& x_in, const W* w, const float* scale, int64_t n,
                           const at::Tensor& bias) {
  const int64_t m = x_in.size(0), k = x_in.size(1);
  const bool bf16_gemm = x_in.scalar_type() == at::kBFloat16 && vec::native_bf16();
  if (m > (bf16_gemm ? kMaxNativeBf16TiledRows : kMaxTiledRows)) {
    return gemm(x_in.contiguous(), w, scale, n, bias);
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x_in.options());
  if (m == 0 || n == 0) return out;
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat) {
    gemv(w, scale, b, x.data_ptr<float>(), out.data_ptr<float>(), m, n, k);
  } else {
    gemv(w, scale, b, x.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), m, n, k);
  }
  return out;
}

// The (N,) float32 bias of an op, or an undefined tensor.
at::Tensor bias_f32(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias must be (N,)");
  return bias->to(at::kFloat).contiguous();
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be (M, K)");
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == x.size(1),
              "int8_linear: qweight must be (N, K) with the K of x");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "int8_linear: qweight must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == qweight.size(0),
              "int8_linear: scale must be contiguous float32 (N,)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear: x must be float32 or bfloat16");
  const int64_t n = qweight.size(0);
  if (x.scalar_type() == at::kFloat && x.size(0) <= kMaxTiledRows &&
      amx::use_for(x.size(0), x.size(1))) {
    const int8_t* qw = qweight.data_ptr<int8_t>();
    const int64_t k = x.size(1);
    auto widen = [&](int64_t row, vec::bf16_t* dst) {  // unscaled: exact in bfloat16
      widen_row(qw + row * k, 1.0f, reinterpret_cast<c10::BFloat16*>(dst), k);
    };
    return amx::int8_gemm(x, widen, scale.data_ptr<float>(), n, bias_f32(bias, n, "int8_linear"));
  }
  return widening_linear(x, qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), n,
                         bias_f32(bias, n, "int8_linear"));
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "bf16_linear: x must be (M, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1),
              "bf16_linear: weight must be (N, K) with the K of x");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear: weight must be contiguous bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be float32 or bfloat16");
  const int64_t n = weight.size(0);
  const auto* w = reinterpret_cast<const vec::bf16_t*>(weight.data_ptr<c10::BFloat16>());
  return widening_linear(x, w, nullptr, n, bias_f32(bias, n, "bf16_linear"));
}

bool has_native_bf16() { return vec::native_bf16(); }

bool has_amx_int8() { return amx::available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("native_bf16() -> bool", &has_native_bf16);
  m.def("amx_int8() -> bool", &has_amx_int8);
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("bf16_linear", &bf16_linear);
}

}  // namespace vllm_mamba
