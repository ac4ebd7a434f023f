// The many-row path of the weight-only linear ops (`widening_linear.cpp`, `int4_linear.cpp`):
// the narrow weight is widened a block of output channels at a time into a buffer that stays
// in the cache, and each block is multiplied by a dense GEMM: oneDNN's float32 linear
// (`onednn_linear.h`), or ATen's bfloat16 `mm` for bfloat16 activations on a CPU with
// bfloat16 instructions (`vec::native_bf16`).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "onednn_linear.h"
#include "vec.h"

namespace vllm_mamba {

constexpr int64_t kBlockGemmElems = 1 << 20;  // widened weight elements per GEMM block

// out (M, N) in x's dtype = x (M, K) @ W^T (+ bias (N,) float32), W (N, K) produced a block of
// rows at a time by `widen(buf, n0, rows, k)`, which writes rows [n0, n0 + rows) of W into
// `buf` (rows, K): a `float*` (float32 GEMM) or a `c10::BFloat16*` (bfloat16 x on a CPU with
// bfloat16 instructions).
template <typename Widen>
at::Tensor block_gemm(const at::Tensor& x_in, int64_t n, const at::Tensor& bias, Widen&& widen) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16 && vec::native_bf16();
  const at::Tensor x = bf16 ? x_in : x_in.to(at::kFloat);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t block =
      std::min<int64_t>(n, std::max<int64_t>(16, kBlockGemmElems / std::max<int64_t>(k, 1)));
  at::Tensor buf = at::empty({block, k}, x.options());
  at::Tensor out = at::empty({m, n}, x.options());
  for (int64_t n0 = 0; n0 < n; n0 += block) {
    const int64_t rows = std::min<int64_t>(block, n - n0);
    at::Tensor w = buf.narrow(0, 0, rows);
    if (x.scalar_type() == at::kFloat) {
      widen(w.data_ptr<float>(), n0, rows, k);
    } else {
      widen(w.data_ptr<c10::BFloat16>(), n0, rows, k);
    }
    if (rows == n) {
      if (x.scalar_type() == at::kFloat && onednn_linear(x, w, bias, out)) {
        return out.to(x_in.scalar_type());
      }
      const at::Tensor full =
          bias.defined() ? at::addmm(bias.to(x.scalar_type()), x, w.t()) : at::mm(x, w.t());
      return full.to(x_in.scalar_type());
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
  return out.to(x_in.scalar_type());
}

}  // namespace vllm_mamba
