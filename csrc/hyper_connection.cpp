// GLM-5-Next's mHC weights (`vllm_mamba.ops.hyper_connection`): per row of z, the pre and post
// sigmoids and the Sinkhorn-normalised softmax mix, in one call instead of about 130 small
// torch ops. Float32; each row alone (rows split over the threads, no row depends on another).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace vllm_mamba {
namespace {

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_weights(const at::Tensor& z_in,
                                                           const at::Tensor& base_in,
                                                           const at::Tensor& scale_in,
                                                           int64_t streams, int64_t iters,
                                                           double eps_d) {
  const int64_t n = streams;
  TORCH_CHECK(n >= 1 && iters >= 1, "streams and iters must be >= 1");
  TORCH_CHECK(z_in.dim() == 2 && z_in.size(1) == (2 + n) * n, "z must be (T, (2 + N) N)");
  TORCH_CHECK(base_in.numel() == (2 + n) * n && scale_in.numel() == 3,
              "base must be ((2 + N) N,) and scale (3,)");
  const at::Tensor z = z_in.to(at::kFloat).contiguous();
  const at::Tensor base = base_in.to(at::kFloat).contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  const int64_t rows = z.size(0), width = (2 + n) * n;
  at::Tensor pre = at::empty({rows, n}, z.options());
  at::Tensor post = at::empty({rows, n}, z.options());
  at::Tensor comb = at::empty({rows, n, n}, z.options());
  const float* zp = z.data_ptr<float>();
  const float* bp = base.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* prep = pre.data_ptr<float>();
  float* postp = post.data_ptr<float>();
  float* cp = comb.data_ptr<float>();
  const float eps = static_cast<float>(eps_d);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> sums(n);
    for (int64_t t = r0; t < r1; ++t) {
      const float* zt = zp + t * width;
      for (int64_t j = 0; j < n; ++j) {
        prep[t * n + j] = sigmoid(zt[j] * sp[0] + bp[j]) + eps;
        postp[t * n + j] = 2.0f * sigmoid(zt[n + j] * sp[1] + bp[n + j]);
      }
      float* c = cp + t * n * n;  // (N, N): rows a, columns c
      for (int64_t a = 0; a < n; ++a) {  // softmax over each row, plus eps
        float* ca = c + a * n;
        float mx = -INFINITY;
        for (int64_t k = 0; k < n; ++k) {
          ca[k] = zt[2 * n + a * n + k] * sp[2] + bp[2 * n + a * n + k];
          mx = std::max(mx, ca[k]);
        }
        float total = 0.0f;
        for (int64_t k = 0; k < n; ++k) {
          ca[k] = std::exp(ca[k] - mx);
          total += ca[k];
        }
        for (int64_t k = 0; k < n; ++k) ca[k] = ca[k] / total + eps;
      }
      auto columns = [&]() {
        for (int64_t k = 0; k < n; ++k) sums[k] = 0.0f;
        for (int64_t a = 0; a < n; ++a)
          for (int64_t k = 0; k < n; ++k) sums[k] += c[a * n + k];
        for (int64_t a = 0; a < n; ++a)
          for (int64_t k = 0; k < n; ++k) c[a * n + k] /= sums[k] + eps;
      };
      columns();
      for (int64_t it = 1; it < iters; ++it) {
        for (int64_t a = 0; a < n; ++a) {  // rows
          float s = 0.0f;
          for (int64_t k = 0; k < n; ++k) s += c[a * n + k];
          for (int64_t k = 0; k < n; ++k) c[a * n + k] /= s + eps;
        }
        columns();
      }
    }
  });
  return {pre, post, comb};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "mhc_weights(Tensor z, Tensor base, Tensor scale, int streams, int iters, float eps) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("mhc_weights", &mhc_weights); }

}  // namespace vllm_mamba
