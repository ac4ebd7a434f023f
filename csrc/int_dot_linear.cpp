// Linear layers with integer dot products (`quantization="w8a8"` / `"w4a8"`, `int_dot.h`):
//
//   w8a8_linear: out (M, N) = Q8(x) (M, K) @ (qweight (N, K) int8 * scale (N,))^T + bias
//   w4a8_linear: out (M, N) = Q8(x) (M, K) @ W^T + bias, W the 4-bit groups of `int4_linear`
//                (qweight (N, K / 2) uint8, scales (N, K / 32) float16)
//
// Q8(x): each row of x quantised to int8 in blocks of 32 with a float32 scale per block
// (llama.cpp's Q8_0). K must be a multiple of 32. x is float32 or bfloat16; the result has x's
// dtype. One path for every number of rows (decode and prefill alike, so a row's result never
// depends on the batch): x is quantised once (rows split over the threads), then the threads
// split the output channels, each streaming its weight rows once per group of 4 rows of x
// (`int_dot::rows_i8` / `rows_q4`). `vllm_mamba/ops/int_dot_linear.py` holds the references.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "gemv.h"
#include "int_dot.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kRowUnit = gemv::kRowBlock;  // output channels per unit of parallel work
constexpr int64_t kMinTaskBytes = 1 << 15;     // weight bytes per parallel task, at least

// x (M, K) float32 contiguous quantised into `q` (rows split over the threads).
void quantize_x(const at::Tensor& x, int_dot::QActs& q) {
  const int64_t m = x.size(0), k = x.size(1);
  q.resize(m, k);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / std::max<int64_t>(k, 1)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t b = lo; b < hi; ++b) q.quantize(b, xp + b * k, k);
                   });
}

// The checks shared by both ops: x (M, K) float32 / bfloat16 with K a multiple of 32, bias (N,).
void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be (M, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % int_dot::kBlock == 0, op, ": K must be a multiple of 32, got ",
              x.size(1));
}

at::Tensor bias_of(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias must be (N,), got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// out (M, N) in x's dtype from `rows(q, lo, hi, out, ldo)`, which writes the products of
// weight rows [lo, hi) with every quantised row of x; `row_bytes` sizes the parallel tasks.
template <typename Rows>
at::Tensor run(const at::Tensor& x_in, int64_t n, int64_t row_bytes, const at::Tensor& bias,
               Rows&& rows) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out.to(x_in.scalar_type());
  int_dot::QActs q;
  quantize_x(x, q);
  float* o = out.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t units = (n + kRowUnit - 1) / kRowUnit;
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(kRowUnit * row_bytes, 1));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t lo = u0 * kRowUnit, hi = std::min(n, u1 * kRowUnit);
    rows(q, lo, hi, o + lo, n);
    if (b) {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = lo; c < hi; ++c) o[r * n + c] += b[c];
    }
  });
  return out.to(x_in.scalar_type());
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  check_x(x, "w8a8_linear");
  const int64_t k = x.size(1);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == k,
              "w8a8_linear: qweight must be (N, K) with the K of x, got ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "w8a8_linear: qweight must be contiguous int8");
  const int64_t n = qweight.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "w8a8_linear: scale must be contiguous float32 (N,)");
  const int_dot::I8Rows w{qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), k};
  return run(x, n, k, bias_of(bias, n, "w8a8_linear"),
             [&](const int_dot::QActs& q, int64_t lo, int64_t hi, float* out, int64_t ldo) {
               int_dot::rows_i8(w, q, lo, hi, out, ldo);
             });
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  check_x(x, "w4a8_linear");
  const int64_t k = x.size(1);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * 2 == k,
              "w4a8_linear: qweight must be (N, K / 2) with the K of x, got ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "w4a8_linear: qweight must be contiguous uint8");
  const int64_t n = qweight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / int_dot::kBlock,
              "w4a8_linear: scales must be contiguous float16 (N, K / 32)");
  const gemv::Q4Rows w{qweight.data_ptr<uint8_t>(),
                       reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), k};
  return run(x, n, k / 2, bias_of(bias, n, "w4a8_linear"),
             [&](const int_dot::QActs& q, int64_t lo, int64_t hi, float* out, int64_t ldo) {
               int_dot::rows_q4(w, q, lo, hi, out, ldo);
             });
}

// The multiply instruction of the kernels on this CPU ("vpdpbusd", "maddubs", "scalar").
std::string int_dot_instruction() { return int_dot::instruction(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("w8a8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int_dot_instruction() -> str", &int_dot_instruction);
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w4a8_linear", &w4a8_linear);
}

}  // namespace vllm_mamba
