// The Q4_K-style quantiser (`quantization="w4a8_k"`): `torch.ops.vllm_mamba.q4k_quantize`.
//
//   q4k_quantize(weight (N, K) float32, K a multiple of 32) -> (codes (N, K / 2) uint8,
//                                                               scales (N, S * 16) uint8)
//
// The layout and the algorithm are `vllm_mamba/ops/q4k.py`'s (`quantize_q4k_ref`, the
// reference): per group of 32 weights of a row, the scale a >= 0 and min m >= 0 of
// `w ~ a c - m` (c in [0, 15]) with the least weighted squared error (importance |w| plus the
// RMS of the super-block of 256, zero-padded) over the min-max fit and 11 candidate scales
// (15 + offset) / span, offsets -1, -0.8, ..., 1, each refined by weighted least squares (a
// positive intercept clamped to 0); then per super-block of 8 groups float16 d = max a / 63
// and dmin = max m / 63 with 6-bit sc = round(a / d), m = round(m / dmin), and the codes
// recomputed from d sc and dmin m. The same float operations in a different order than the
// reference's vectorised sums, so a near-tie between candidates may fall the other way
// (`tests/ops/test_q4k.py` bounds how often and what it costs). No fused multiply-adds
// (fp-contract off), so every ISA level gives the same bytes. Rows run in parallel: the
// reference takes 43-55 ns a weight at 2 threads, which is minutes for a 35B model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#pragma GCC optimize("fp-contract=off")

namespace vllm_mamba {
namespace {

constexpr int kBlock = 32;       // weights sharing a scale and a min
constexpr int kSuper = 8;        // blocks per super-block
constexpr int kSuperBytes = 16;  // scale bytes per row and super-block
constexpr float kLevels = 15.0f;
constexpr float kScaleMax = 63.0f;
constexpr int kGrid = 11;  // candidate offsets -1 + 0.2 g

inline float clamp(float v, float lo, float hi) { return std::min(hi, std::max(lo, v)); }

// The nearest code of w under scale a and min m (0 when a is not positive).
inline float code(float w, float a, float m) {
  return a > 0.0f ? clamp(std::nearbyint((w + m) / a), 0.0f, kLevels) : 0.0f;
}

// The scale a and min m of one block w[32] with importance imp[32].
void fit_block(const float* w, const float* imp, float& a_out, float& m_out) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < kBlock; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  lo = std::min(lo, 0.0f);
  const float span = hi - lo;
  a_out = m_out = 0.0f;
  if (!(span > 0.0f)) return;
  float sw = 0.0f, sx = 0.0f, sxx = 0.0f;
  for (int i = 0; i < kBlock; ++i) {
    const float iw = imp[i] * w[i];
    sw += imp[i];
    sx += iw;
    sxx += iw * w[i];
  }
  float best_a = span / kLevels, best_m = -lo, best_err = 0.0f;  // the min-max fit
  for (int i = 0; i < kBlock; ++i) {
    const float d = best_a * code(w[i], best_a, best_m) - best_m - w[i];
    best_err += imp[i] * (d * d);
  }
  for (int g = 0; g < kGrid; ++g) {
    const float iscale = static_cast<float>(kLevels + (-1.0 + 0.2 * g)) / span;
    float sc = 0.0f, scc = 0.0f, scx = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const float c = clamp(std::nearbyint((w[i] - lo) * iscale), 0.0f, kLevels);
      const float ic = imp[i] * c;
      sc += ic;
      scc += ic * c;
      scx += (imp[i] * w[i]) * c;
    }
    const float det = sw * scc - sc * sc;
    if (!(det > 0.0f)) continue;
    float a = (sw * scx - sc * sx) / det, b = (scc * sx - sc * scx) / det;
    if (b > 0.0f) {  // the range starts at 0: a from the codes alone
      a = scx / (scc > 0.0f ? scc : 1.0f);
      b = 0.0f;
    }
    const float err = a * a * scc + b * b * sw + sxx + 2.0f * (a * b * sc - a * scx - b * sx);
    if (a > 0.0f && err < best_err) {
      best_a = a;
      best_m = -b;
      best_err = err;
    }
  }
  a_out = best_a;
  m_out = best_m;
}

// v[8] >= 0 as a float16 d (its bits) and 6-bit q[8] with v ~ d q.
uint16_t six_bits(const float* v, int* q) {
  float vmax = 0.0f;
  for (int i = 0; i < kSuper; ++i) vmax = std::max(vmax, v[i]);
  const c10::Half d(vmax / kScaleMax);
  const float df = static_cast<float>(d);
  for (int i = 0; i < kSuper; ++i) {
    q[i] = df > 0.0f ? static_cast<int>(clamp(std::nearbyint(v[i] / df), 0.0f, kScaleMax)) : 0;
  }
  return d.x;
}

// Row `w` (k values) into its codes (k / 2 bytes) and scale bytes (S * 16).
void quantize_row(const float* w, int64_t k, uint8_t* codes, uint8_t* scales) {
  const int64_t nb = k / kBlock, ns = (nb + kSuper - 1) / kSuper;
  float blk[kSuper * kBlock], imp[kSuper * kBlock], a[kSuper], m[kSuper];
  for (int64_t t = 0; t < ns; ++t) {
    const int64_t j0 = t * kSuper, nj = std::min<int64_t>(kSuper, nb - j0);
    std::fill(blk, blk + kSuper * kBlock, 0.0f);  // missing blocks of a partial one: zeros
    std::copy(w + j0 * kBlock, w + (j0 + nj) * kBlock, blk);
    float ss = 0.0f;
    for (int i = 0; i < kSuper * kBlock; ++i) ss += blk[i] * blk[i];
    const float rms = std::sqrt(ss / static_cast<float>(kSuper * kBlock));
    for (int i = 0; i < kSuper * kBlock; ++i) imp[i] = std::fabs(blk[i]) + rms;
    for (int j = 0; j < kSuper; ++j) fit_block(blk + j * kBlock, imp + j * kBlock, a[j], m[j]);
    int sc[kSuper], mq[kSuper];
    const uint16_t d = six_bits(a, sc), dmin = six_bits(m, mq);
    uint8_t* s = scales + t * kSuperBytes;
    s[0] = static_cast<uint8_t>(d & 0xFF);
    s[1] = static_cast<uint8_t>(d >> 8);
    s[2] = static_cast<uint8_t>(dmin & 0xFF);
    s[3] = static_cast<uint8_t>(dmin >> 8);
    for (int j = 0; j < kSuper; ++j) s[4 + j] = static_cast<uint8_t>((sc[j] & 15) | (mq[j] & 15) << 4);
    for (int i = 0; i < kSuper / 2; ++i) {
      const int h0 = (sc[2 * i] >> 4) | (mq[2 * i] >> 4) << 2;
      const int h1 = (sc[2 * i + 1] >> 4) | (mq[2 * i + 1] >> 4) << 2;
      s[12 + i] = static_cast<uint8_t>(h0 | h1 << 4);
    }
    const float df = static_cast<float>(c10::Half(d, c10::Half::from_bits()));
    const float dminf = static_cast<float>(c10::Half(dmin, c10::Half::from_bits()));
    for (int64_t j = 0; j < nj; ++j) {
      const float ds = df * static_cast<float>(sc[j]), dm = dminf * static_cast<float>(mq[j]);
      const float* wb = w + (j0 + j) * kBlock;
      uint8_t* cb = codes + (j0 + j) * (kBlock / 2);  // byte i: column i low, i + 16 high
      for (int i = 0; i < kBlock / 2; ++i) {
        const int lo = static_cast<int>(code(wb[i], ds, dm));
        const int hi = static_cast<int>(code(wb[i + kBlock / 2], ds, dm));
        cb[i] = static_cast<uint8_t>(lo | hi << 4);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> q4k_quantize(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) > 0 && weight.size(1) % kBlock == 0,
              "q4k_quantize: weight must be (N, K) with K a multiple of 32, got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.is_cpu(),
              "q4k_quantize: weight must be contiguous float32 on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t sbytes = (k / kBlock + kSuper - 1) / kSuper * kSuperBytes;
  at::Tensor codes = at::empty({n, k / 2}, weight.options().dtype(at::kByte));
  at::Tensor scales = at::empty({n, sbytes}, weight.options().dtype(at::kByte));
  const float* w = weight.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint8_t* s = scales.data_ptr<uint8_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(w + r * k, k, c + r * (k / 2), s + r * sbytes);
  });
  return {codes, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("q4k_quantize(Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("q4k_quantize", &q4k_quantize); }

}  // namespace vllm_mamba
