// int4_linear: out (M, N) = x (M, K) @ W^T + bias, W (N, K) stored as 4-bit weights in groups
// of 32 with one float16 scale each (`quantization="int4"`; the layout of `gemv.h`'s `Q4Rows`
// and `vllm_mamba/ops/int4_linear.py`). Activations are float32 or bfloat16 and products
// accumulate in float32, so the layer's only error against the float model is the weight
// rounding. Two paths, by the number of rows of x:
// - up to kMaxGemvRows (kMaxNativeBf16GemvRows when the block GEMM runs in bfloat16):
//   `gemv::gemv_rows_q4`, which unpacks each group of 32 weights in registers once and
//   multiplies it with up to 4 rows of x; threads split the output channels in blocks of 8.
// - more rows (prefill, many-stream decode): the weight is dequantised a block of output
//   channels at a time and multiplied by a dense GEMM (`block_gemm.h`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "block_gemm.h"
#include "gemv.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kMaxGemvRows = 64;            // rows up to which the 4-bit GEMV runs
constexpr int64_t kMaxNativeBf16GemvRows = 32;  // the same when the GEMM would run in bfloat16
constexpr int64_t kRowUnit = gemv::kRowBlock;   // output channels per unit of parallel work
constexpr int64_t kMinTaskBytes = 1 << 15;      // packed weight bytes per parallel task, at least
constexpr int kPer = gemv::kQ4Group / vec::kLanes;  // vectors per group of 32

// out (M, N) float32 = x (M, K) float32 @ W^T + bias, each task a range of output channels.
void gemv_q4(const gemv::Q4Rows& w, const float* x, int64_t m, int64_t n, const float* bias,
             float* out) {
  const int64_t units = (n + kRowUnit - 1) / kRowUnit;
  const int64_t unit_bytes = kRowUnit * w.k / 2;
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(unit_bytes, 1));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t lo = u0 * kRowUnit, hi = std::min(n, u1 * kRowUnit);
    gemv::gemv_rows_q4(w, x, w.k, m, lo, hi, out + lo, n);
    if (bias) {
      for (int64_t b = 0; b < m; ++b)
        for (int64_t r = lo; r < hi; ++r) out[b * n + r] += bias[r];
    }
  });
}

// One dequantised group of 32 weights, stored as float32 or rounded to bfloat16.
inline void store_group(float* dst, const vec::Vf* v) {
  for (int j = 0; j < kPer; ++j) vec::store(dst + j * vec::kLanes, v[j]);
}
inline void store_group(c10::BFloat16* dst, const vec::Vf* v) {
  auto* out = reinterpret_cast<vec::bf16_t*>(dst);
  for (int j = 0; j < kPer; ++j) vec::store(out + j * vec::kLanes, v[j]);
}

template <typename T>
void dequantize_block(const gemv::Q4Rows& w, T* buf, int64_t n0, int64_t rows) {
  const int64_t groups = w.k / gemv::kQ4Group, row_bytes = w.k / 2;
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const uint8_t* q = w.q + (n0 + r) * row_bytes;
      const uint16_t* sc = w.scales + (n0 + r) * groups;
      for (int64_t g = 0; g < groups; ++g) {
        vec::Vf v[kPer];
        vec::load_q4_group(q + g * (gemv::kQ4Group / 2), v);
        const vec::Vf s = vec::set1(vec::half(sc[g]));
        for (int j = 0; j < kPer; ++j) v[j] = vec::mul(v[j], s);
        store_group(buf + r * w.k + g * gemv::kQ4Group, v);
      }
    }
  });
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight,
                       const at::Tensor& scales, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "int4_linear: x must be (M, K)");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "int4_linear: x must be float32 or bfloat16");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  TORCH_CHECK(k % gemv::kQ4Group == 0, "int4_linear: K must be a multiple of 32, got ", k);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * 2 == k,
              "int4_linear: qweight must be (N, K / 2) with the K of x");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "int4_linear: qweight must be contiguous uint8");
  const int64_t n = qweight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / gemv::kQ4Group,
              "int4_linear: scales must be contiguous float16 (N, K / 32)");
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->numel() == n, "int4_linear: bias must be (N,)");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  const gemv::Q4Rows w{qweight.data_ptr<uint8_t>(),
                       reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), k};
  const bool bf16_gemm = x_in.scalar_type() == at::kBFloat16 && vec::native_bf16();
  if (m > (bf16_gemm ? kMaxNativeBf16GemvRows : kMaxGemvRows)) {
    return block_gemm(x_in.contiguous(), n, bias, [&](auto* buf, int64_t n0, int64_t rows, int64_t) {
      dequantize_block(w, buf, n0, rows);
    });
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    gemv_q4(w, x.data_ptr<float>(), m, n, bias.defined() ? bias.data_ptr<float>() : nullptr,
            out.data_ptr<float>());
  }
  return out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("int4_linear", &int4_linear); }

}  // namespace vllm_mamba
