// Float32 GEMMs through oneDNN: out = x @ w^T (+ bias) by `mkldnn::_linear_pointwise`, the op
// behind `vllm_mamba.ops.cpu_kernels.linear` for batches above the small-batch kernel.
//
// torch's `mm` runs float32 through MKL, which reached 140-205 GFLOP/s on the decode and
// prefill shapes of the AMD CPUs measured, where oneDNN's float32 kernels reached 430-500 at
// full float32 precision (`benchmarks/README.md`). The op is looked up once through the
// dispatcher; `VLLM_MAMBA_ONEDNN_LINEAR=0` or a torch without oneDNN leaves the caller's
// fallback.
//
// oneDNN builds (JIT-compiles) a primitive for every distinct row count and keeps it in two
// caches of 1,024 entries each (its own primitive cache and ideep's): about 0.6 MB per shape,
// whatever the weight's size. A server's row counts change with every step's batch, so those
// caches grew RSS for thousands of requests, towards ~1 GB (issue 33's soak; 17 then 14 KB
// per request on the tiny test model). Each call therefore runs at most `kGemmRows` rows and
// pads them to one of a few sizes (`gemm_rows`): 20 shapes per weight, all seen soon, for at
// most 7 extra rows up to 32 (where streaming the weight dominates) and under 25% above; a new
// shape also costs a JIT compile (about 1 ms). `vllm_mamba.ops.cpu_kernels.linear` pads by
// the same rule.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace vllm_mamba {

constexpr int64_t kGemmRows = 512;  // rows of one oneDNN call, at most

// The rows one oneDNN call runs for `m` rows (1 <= m <= kGemmRows): up to 32 a multiple of 8,
// above four sizes per doubling (m in (2^j, 2^(j+1)] rounds up to a multiple of 2^(j-2)).
inline int64_t gemm_rows(int64_t m) {
  if (m <= 32) return (m + 7) / 8 * 8;
  int64_t step = 1;
  while (step * 8 < m) step *= 2;  // the largest power of two below m, divided by 4
  return (m + step - 1) / step * step;
}

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
  const int64_t m = x.size(0);
  for (int64_t start = 0; start < m; start += kGemmRows) {
    const int64_t rows = std::min(kGemmRows, m - start);
    const int64_t padded = gemm_rows(rows);
    at::Tensor part = x.narrow(0, start, rows);
    if (padded != rows) {
      at::Tensor full = at::empty({padded, x.size(1)}, x.options());
      full.narrow(0, 0, rows).copy_(part);
      full.narrow(0, rows, padded - rows).zero_();
      part = full;
    }
    std::vector<c10::IValue> stack{part, w, bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                   std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                   std::string("")};
    op->callBoxed(&stack);
    out.narrow(0, start, rows).copy_(stack[0].toTensor().narrow(0, 0, rows));
  }
  return true;
}

}  // namespace vllm_mamba
