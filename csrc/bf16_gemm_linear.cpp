// `bf16_gemm_linear(x, weight)`: x (M, K) @ weight (N, K)^T for bfloat16 weights and a few rows
// (`cpu_kernels.linear` from `SMALL_BATCH` + 1 to `bf16_gemm::kMaxRows` rows on a CPU with
// bfloat16 instructions), by `bf16_gemm` (`bf16_gemm.h`): x rounded to bfloat16, products
// summed in float32, the result rounded to bfloat16 as a bfloat16 `mm`'s; or with `float_out`
// the same values in float32 (a head's logits, without a separate widening pass). Where the
// kernel is not available (no AVX512-BF16, or `VLLM_MAMBA_BF16_GEMM=0`) it is `mm`.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "bf16_gemm.h"

namespace vllm_mamba {
namespace {

at::Tensor bf16_gemm_linear(const at::Tensor& x_in, const at::Tensor& weight, bool float_out) {
  TORCH_CHECK(x_in.dim() == 2, "bf16_gemm_linear: x must be (M, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous() && weight.size(1) == x_in.size(1),
              "bf16_gemm_linear: weight must be contiguous bfloat16 (N, K) with x's K");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "bf16_gemm_linear: x must be float32 or bfloat16");
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const auto dtype = float_out ? at::kFloat : at::kBFloat16;
  if (!bf16_gemm::available()) return at::mm(x, weight.t()).to(dtype);
  at::Tensor out = at::empty({m, n}, x.options().dtype(dtype));
  if (m == 0 || n == 0) return out;
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(weight.data_ptr());
  if (float_out) {
    bf16_gemm::gemm(xp, k, m, wp, n, k, out.data_ptr<float>(), n);
  } else {
    bf16_gemm::gemm(xp, k, m, wp, n, k, static_cast<uint16_t*>(out.data_ptr()), n);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("bf16_gemm_linear(Tensor x, Tensor weight, bool float_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("bf16_gemm_linear", &bf16_gemm_linear); }

}  // namespace vllm_mamba
