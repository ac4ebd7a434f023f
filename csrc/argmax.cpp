// The greedy sampler's argmax over each row of float32 logits (`vllm_mamba.ops.sampling`):
// torch.argmax's rule (the first index of the largest value; the first NaN where a row has
// one), in two vectorised passes over a row (its max, then the first index that holds it)
// with the rows, or the parts of one row, split over the threads. torch's own reduction ran
// at 1-4 GB/s on a vocabulary of 248k (0.25 ms a row, and 2.5 ms for 5 rows at 2 threads on
// a Zen 5): a greedy step's sampling, and a speculative chain's rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace vllm_mamba {
namespace {

// The argmax of one span of a row: its largest value and first index of it, or its first NaN.
struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;  // -1: an empty span
  bool nan = false;
};

constexpr int64_t kChunk = 64;  // values tested per step of the index pass

Best span_argmax(const float* x, int64_t n) {
  Best b;
  if (n <= 0) return b;
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, x[i]);  // a NaN's lane is ignored here: `nan` decides
    nan |= x[i] != x[i];
  }
  b.nan = nan != 0;
  b.value = m;
  // The first index that holds m (or a NaN), a chunk at a time.
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c; i < e; ++i) hit |= b.nan ? x[i] != x[i] : x[i] == m;
    if (!hit) continue;
    for (int64_t i = c; i < e; ++i) {
      if (b.nan ? x[i] != x[i] : x[i] == m) {
        b.index = i;
        return b;
      }
    }
  }
  b.index = 0;  // every value is -inf (m is -inf and equal to them: not reached) or none
  return b;
}

// The parts of a row combined in order: the first NaN, else the largest value, ties to the
// earlier part (its index is smaller).
Best combine(const Best& a, const Best& b) {
  if (b.index < 0) return a;
  if (a.index < 0) return b;
  if (a.nan || b.nan) return a.nan ? a : b;
  return b.value > a.value ? b : a;
}

at::Tensor argmax_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (R, V)");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(x_in.size(1) > 0, "x must have at least one column");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), v = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Parts per row: enough to give every thread one where the rows are fewer than the threads
  // (a row of fewer than 16k values stays whole).
  const int64_t threads = at::get_num_threads();
  const int64_t parts =
      rows >= threads ? 1 : std::min<int64_t>((threads + rows - 1) / rows, std::max<int64_t>(1, v / 16384));
  const int64_t width = (v + parts - 1) / parts;
  std::vector<Best> found(static_cast<size_t>(rows * parts));
  const int64_t grain = rows * v < 32768 ? rows * parts : 1;
  at::parallel_for(0, rows * parts, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t r = t / parts, c0 = (t % parts) * width, c1 = std::min(v, c0 + width);
      Best b = span_argmax(xp + r * ld + c0, c1 - c0);
      if (b.index >= 0) b.index += c0;
      found[static_cast<size_t>(t)] = b;
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    Best b;
    for (int64_t p = 0; p < parts; ++p) b = combine(b, found[static_cast<size_t>(r * parts + p)]);
    op[r] = b.index;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

}  // namespace vllm_mamba
