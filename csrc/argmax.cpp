// The greedy sampler's argmax over each row of float32 logits (`vllm_mamba.ops.sampling`):
// torch.argmax's rule (the first index of the largest value; the first NaN where a row has
// one), in one vectorised pass over a row (`span_argmax`), with the rows, or the parts of one
// row, split over the threads. On a Zen 5 at 2 threads over Qwen3.5's 248k vocabulary: 11 us a
// row (5 rows 55 us) against torch's 150 us (536 us): a greedy step's sampling, and the 5 rows
// of a speculative chain.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace vllm_mamba {
namespace {

// The argmax of one span of a row: its largest value and first index of it, or its first NaN.
struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;  // -1: an empty span
  bool nan = false;
};

// The first index of the largest of x[0, n) (no NaN in it), the scalar way.
Best scalar_argmax(const float* x, int64_t n) {
  Best b;
  for (int64_t i = 0; i < n; ++i) {
    if (b.index < 0 || x[i] > b.value) {
      b.value = x[i];
      b.index = i;
    }
  }
  return b;
}

// The first NaN of x[0, n) (there is one).
Best first_nan(const float* x, int64_t n) {
  Best b;
  b.nan = true;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) {
      b.index = i;
      b.value = x[i];
      break;
    }
  }
  return b;
}

// The best of `lanes` lane results (value, first index): the largest value, the smallest index
// among the lanes that hold it (lanes that saw no value hold -inf and index 0).
Best lane_best(const float* value, const int32_t* index, int64_t lanes) {
  Best b;
  for (int64_t l = 0; l < lanes; ++l) {
    if (b.index < 0 || value[l] > b.value || (value[l] == b.value && index[l] < b.index)) {
      b.value = value[l];
      b.index = index[l];
    }
  }
  return b;
}

// One pass over the span: per vector lane the largest value so far and its first index (a
// strictly greater value replaces it, so each lane keeps its first), two lane sets to hide the
// compare-and-blend latency; then `lane_best` over both sets. A NaN anywhere sends the span to
// `first_nan`.
Best span_argmax(const float* x, int64_t n) {
  if (n <= 0) return Best{};
#if defined(__AVX512F__)
  constexpr int64_t W = 16;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best[2] = {ninf, ninf};
  __m512i at[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(W);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    for (int u = 0; u < 2; ++u) {
      const __m512 v = _mm512_loadu_ps(x + i + u * W);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best[u], _CMP_GT_OQ);
      best[u] = _mm512_mask_mov_ps(best[u], gt, v);
      at[u] = _mm512_mask_mov_epi32(at[u], gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
  }
  for (; i < n; i += W) {  // the rest, masked (-inf past the end never replaces)
    const __mmask16 m = static_cast<__mmask16>(n - i >= W ? 0xFFFF : (1u << (n - i)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(ninf, m, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best[0], _CMP_GT_OQ);
    best[0] = _mm512_mask_mov_ps(best[0], gt, v);
    at[0] = _mm512_mask_mov_epi32(at[0], gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) return first_nan(x, n);
  alignas(64) float bv[2 * W];
  alignas(64) int32_t bi[2 * W];
  for (int u = 0; u < 2; ++u) {
    _mm512_store_ps(bv + u * W, best[u]);
    _mm512_store_si512(bi + u * W, at[u]);
  }
  return lane_best(bv, bi, 2 * W);
#elif defined(__AVX2__)
  constexpr int64_t W = 8;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 best[2] = {ninf, ninf};
  __m256i at[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(W);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  auto visit = [&](__m256 v, int u) {
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, best[u], _CMP_GT_OQ);
    best[u] = _mm256_blendv_ps(best[u], v, gt);
    at[u] = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at[u]), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, step);
  };
  for (; i + 2 * W <= n; i += 2 * W) {
    visit(_mm256_loadu_ps(x + i), 0);
    visit(_mm256_loadu_ps(x + i + W), 1);
  }
  for (; i < n; i += W) {  // the rest, padded with -inf (never replaces)
    alignas(32) float pad[W];
    for (int64_t c = 0; c < W; ++c) pad[c] = i + c < n ? x[i + c] : -std::numeric_limits<float>::infinity();
    visit(_mm256_load_ps(pad), 0);
  }
  if (_mm256_movemask_ps(nan)) return first_nan(x, n);
  alignas(32) float bv[2 * W];
  alignas(32) int32_t bi[2 * W];
  for (int u = 0; u < 2; ++u) {
    _mm256_store_ps(bv + u * W, best[u]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi + u * W), at[u]);
  }
  return lane_best(bv, bi, 2 * W);
#else
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return first_nan(x, n);
  return scalar_argmax(x, n);
#endif
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
  TORCH_CHECK(x_in.size(1) < (int64_t{1} << 31), "x must have fewer than 2^31 columns");
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
