// Matrix-vector products for small batches (decode): out (B, N) = x (B, K) @ weight (N, K)^T.
//
// At batch 1 a linear layer only streams its weight from memory once; the generic GEMM path
// reaches well under the memory bandwidth there. This kernel splits the output rows over the
// threads and runs `gemv::gemv_rows` on each part: tiles of 4 weight rows read once for all
// rows of x, each row of x summed exactly as alone (a speculative chain's logits equal its
// tokens decoded one by one). Weights may be float32 or bfloat16 (widened on the fly);
// accumulation is float32.
//
// A weight `(G, N, K)` is block-diagonal (RecurrentGemma's gates): group g multiplies x's
// columns [g K, (g + 1) K) by its `(N, K)` matrix into out's columns [g N, (g + 1) N), so
// x is `(B, G K)` and out `(B, G N)`; the bias is `(G, N)` or `(G N)`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "gemv.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kMaxBatch = 8;             // rows of x this op takes
constexpr int64_t kMinTaskFloats = 1 << 16;  // weight elements per parallel task, at least

// out (B, G N) float32 = per group g, x[:, g K : (g + 1) K] (B, K) @ w[g]^T, plus bias.
template <typename W>
void run(const W* w, const float* x, const float* bias, float* out, int64_t batch,
         int64_t groups, int64_t n, int64_t k) {
  // Small weights run on one thread: waking the others costs more than it saves. Tasks are
  // whole tiles of rows of one group (the split never cuts a tile).
  const int64_t grain = std::max<int64_t>(16, kMinTaskFloats / std::max<int64_t>(k, 1));
  const int64_t tiles = (n + gemv::kTileRows - 1) / gemv::kTileRows;  // per group
  const int64_t ldx = groups * k, ldo = groups * n;
  at::parallel_for(0, groups * tiles, (grain + gemv::kTileRows - 1) / gemv::kTileRows,
                   [&](int64_t t0, int64_t t1) {
                     for (int64_t t = t0; t < t1;) {
                       const int64_t g = t / tiles, end = std::min(t1, (g + 1) * tiles);
                       const int64_t lo = (t - g * tiles) * gemv::kTileRows;
                       const int64_t hi = std::min(n, (end - g * tiles) * gemv::kTileRows);
                       float* o = out + g * n;
                       gemv::gemv_rows(w + g * n * k, k, x + g * k, ldx, batch, lo, hi, o + lo,
                                       ldo);
                       if (bias) {
                         const float* bg = bias + g * n;
                         for (int64_t b = 0; b < batch; ++b)
                           for (int64_t r = lo; r < hi; ++r) o[b * ldo + r] += bg[r];
                       }
                       t = end;
                     }
                   });
}

at::Tensor linear_small_batch(const at::Tensor& x_in, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (B, K) or (B, G K)");
  TORCH_CHECK(weight.dim() == 2 || weight.dim() == 3, "weight must be (N, K) or (G, N, K)");
  const int64_t groups = weight.dim() == 3 ? weight.size(0) : 1;
  const int64_t n = weight.size(-2), k = weight.size(-1);
  TORCH_CHECK(x_in.size(1) == groups * k, "x must have G K columns for a weight (G, N, K)");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK(x_in.size(0) <= kMaxBatch, "linear_small_batch takes at most 8 rows");
  const int64_t batch = x_in.size(0);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == groups * n, "bias must have G N values");
  }
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  at::Tensor out = at::empty({batch, groups * n}, x_in.options().dtype(at::kFloat));
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (weight.scalar_type() == at::kFloat) {
    run(weight.data_ptr<float>(), x.data_ptr<float>(), b, out.data_ptr<float>(), batch, groups,
        n, k);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be float32 or bfloat16");
    const auto* wp = reinterpret_cast<const vec::bf16_t*>(weight.data_ptr<c10::BFloat16>());
    run(wp, x.data_ptr<float>(), b, out.data_ptr<float>(), batch, groups, n, k);
  }
  return out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("linear_small_batch", &linear_small_batch); }

}  // namespace vllm_mamba
