// Mamba2's gated RMSNorm on the CPU: out = weight * rmsnorm_per_group(x * silu(z)), statistics
// in float32 over groups of `group_size` channels, as `vllm_mamba/ops/gated_rms_norm.py`.
// One pass per row instead of the reference's chain of elementwise ops; rows in parallel.
// Rounding follows the reference: the normalised value is cast to x's dtype before the weight.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernel_math.h"

namespace vllm_mamba {
namespace {

template <typename T, typename W>
void norm_row(const T* x, const T* z, const W* weight, T* out, int64_t dim, int64_t group_size,
              float eps, float* gated) {
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) gated[i] = to_f32(x[i]) * silu_f32(to_f32(z[i]));
  for (int64_t g0 = 0; g0 < dim; g0 += group_size) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = g0; i < g0 + group_size; ++i) sq += gated[i] * gated[i];
    const float scale = 1.0f / std::sqrt(sq / static_cast<float>(group_size) + eps);
    for (int64_t i = g0; i < g0 + group_size; ++i) {
      const float normed = to_f32(static_cast<T>(gated[i] * scale));
      out[i] = static_cast<T>(to_f32(weight[i]) * normed);
    }
  }
}

at::Tensor gated_rms_norm(const at::Tensor& x_in, const at::Tensor& z_in, const at::Tensor& weight,
                          int64_t group_size, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && z_in.sizes() == x_in.sizes(), "x and z must be (T, I)");
  const int64_t rows = x_in.size(0), dim = x_in.size(1);
  TORCH_CHECK(group_size > 0 && dim % group_size == 0, "I must be a multiple of group_size");
  TORCH_CHECK(weight.numel() == dim, "weight must be (I,)");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor z = (z_in.stride(1) == 1 ? z_in : z_in.contiguous()).to(x.scalar_type());
  const at::Tensor w = weight.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty({rows, dim}, x.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  dispatch_float_bf16(x, "x", [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* xp = x.data_ptr<T>();
    const T* zp = z.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> gated(dim);
      for (int64_t r = lo; r < hi; ++r) {
        norm_row(xp + r * x.stride(0), zp + r * z.stride(0), wp, op + r * dim, dim, group_size,
                 static_cast<float>(eps), gated.data());
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("gated_rms_norm", &gated_rms_norm); }

}  // namespace vllm_mamba
