// Float32 GEMMs through oneDNN: out = x @ w^T (+ bias) by `mkldnn::_linear_pointwise`, the op
// behind `vllm_mamba.ops.cpu_kernels.linear` for batches above the small-batch kernel.
//
// torch's `mm` runs float32 through MKL, which reached 140-205 GFLOP/s on the decode and
// prefill shapes of the AMD CPUs measured, where oneDNN's float32 kernels reached 430-500 at
// full float32 precision (`benchmarks/README.md`). The op is looked up once through the
// dispatcher; `VLLM_MAMBA_ONEDNN_LINEAR=0` or a torch without oneDNN leaves the caller's
// fallback.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace vllm_mamba {

// out (M, N) = x (M, K) float32 (a row stride allowed) @ w (N, K)^T float32 contiguous, plus
// `bias` (N,) when defined; false (out untouched) when oneDNN's op is not available.
inline bool onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          at::Tensor& out) {
  static const std::optional<c10::OperatorHandle> op = []() -> std::optional<c10::OperatorHandle> {
    const char* env = std::getenv("VLLM_MAMBA_ONEDNN_LINEAR");
    if (env != nullptr && std::string(env) == "0") return std::nullopt;
    return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  }();
  if (!op.has_value()) return false;
  std::vector<c10::IValue> stack{x, w, bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                 std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 std::string("")};
  op->callBoxed(&stack);
  out.copy_(stack[0].toTensor());
  return true;
}

}  // namespace vllm_mamba
