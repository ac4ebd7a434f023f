// Matrix-vector products for small batches (decode): out (B, N) = x (B, K) @ weight (N, K)^T.
//
// At batch 1 a linear layer only streams its weight from memory once; the generic GEMM path
// reaches well under the memory bandwidth there. This kernel splits the output rows over the
// threads and, per weight row, keeps four independent vector accumulators per input row so
// the loop runs at load speed. Weights may be float32 or bfloat16 (converted on the fly);
// accumulation is float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace vllm_mamba {
namespace {

constexpr int64_t kLanes = 64;       // floats summed in parallel: four AVX-512 registers
constexpr int64_t kMaxBatch = 8;     // rows of x handled in one pass over a weight row
constexpr int64_t kMinTaskFloats = 1 << 16;  // weight elements per parallel task, at least

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename W>
inline float dot(const W* w, const float* x, int64_t k) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += to_f32(w[i + j]) * x[i + j];
  }
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < kLanes; ++j) total += acc[j];
  for (; i < k; ++i) total += to_f32(w[i]) * x[i];
  return total;
}

template <typename W, typename T>
void run(const W* w, const float* x, const float* bias, T* out, int64_t batch, int64_t n,
         int64_t k) {
  // Small weights run on one thread: waking the others costs more than it saves.
  const int64_t grain = std::max<int64_t>(16, kMinTaskFloats / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const W* wr = w + row * k;
      const float b = bias ? bias[row] : 0.0f;
      for (int64_t r = 0; r < batch; ++r) {
        out[r * n + row] = static_cast<T>(dot(wr, x + r * k, k) + b);
      }
    }
  });
}

at::Tensor linear_small_batch(const at::Tensor& x_in, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (B, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x_in.size(1), "weight must be (N, K)");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK(x_in.size(0) <= kMaxBatch, "linear_small_batch takes at most 8 rows");
  const int64_t batch = x_in.size(0), k = x_in.size(1), n = weight.size(0);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({batch, n}, x_in.options());
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  auto with_out = [&](auto* wp) {
    if (out.scalar_type() == at::kFloat) {
      run(wp, x.data_ptr<float>(), b, out.data_ptr<float>(), batch, n, k);
    } else {
      TORCH_CHECK(out.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
      run(wp, x.data_ptr<float>(), b, out.data_ptr<c10::BFloat16>(), batch, n, k);
    }
  };
  if (weight.scalar_type() == at::kFloat) {
    with_out(weight.data_ptr<float>());
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be float32 or bfloat16");
    with_out(weight.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("linear_small_batch", &linear_small_batch); }

}  // namespace vllm_mamba
