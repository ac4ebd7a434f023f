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
// (fp-contract off), and the groups of a row are fitted 16 at a time, one per vector lane
// (`fit_blocks`), so every ISA level gives the same bytes. Rows run in parallel: 2.7 ns a
// weight at 2 threads (Zen 4), where the reference takes 43-66 (half an hour for a 35B model).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

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

// The scales a[v] and mins m[v] of kLanes blocks at once, each block's 32 weights and
// importances transposed (w[i * kLanes + v] is weight i of block v): the loops run over the
// blocks innermost, so that the compiler keeps one block per vector lane, and every lane does
// exactly the operations of one block in the same order whatever the vector width.
constexpr int kLanes = 16;

void fit_blocks(const float* w, const float* imp, float* a_out, float* m_out) {
  float lo[kLanes], hi[kLanes], span[kLanes], sw[kLanes], sx[kLanes], sxx[kLanes];
  float best_a[kLanes], best_m[kLanes], best_err[kLanes];
  for (int v = 0; v < kLanes; ++v) {
    lo[v] = hi[v] = w[v];
    sw[v] = sx[v] = sxx[v] = best_err[v] = 0.0f;
  }
  for (int i = 1; i < kBlock; ++i) {
    for (int v = 0; v < kLanes; ++v) {
      lo[v] = std::min(lo[v], w[i * kLanes + v]);
      hi[v] = std::max(hi[v], w[i * kLanes + v]);
    }
  }
  for (int v = 0; v < kLanes; ++v) {
    lo[v] = std::min(lo[v], 0.0f);
    span[v] = hi[v] - lo[v];
    best_a[v] = span[v] / kLevels;  // the min-max fit
    best_m[v] = -lo[v];
  }
  for (int i = 0; i < kBlock; ++i) {
    for (int v = 0; v < kLanes; ++v) {
      const float x = w[i * kLanes + v], p = imp[i * kLanes + v];
      const float iw = p * x;
      sw[v] += p;
      sx[v] += iw;
      sxx[v] += iw * x;
      const float d = best_a[v] * code(x, best_a[v], best_m[v]) - best_m[v] - x;
      best_err[v] += p * (d * d);
    }
  }
  for (int g = 0; g < kGrid; ++g) {
    const float top = static_cast<float>(kLevels + (-1.0 + 0.2 * g));
    float iscale[kLanes], sc[kLanes], scc[kLanes], scx[kLanes];
    for (int v = 0; v < kLanes; ++v) {
      iscale[v] = top / (span[v] > 0.0f ? span[v] : 1.0f);
      sc[v] = scc[v] = scx[v] = 0.0f;
    }
    for (int i = 0; i < kBlock; ++i) {
      for (int v = 0; v < kLanes; ++v) {
        const float x = w[i * kLanes + v], p = imp[i * kLanes + v];
        const float c = clamp(std::nearbyint((x - lo[v]) * iscale[v]), 0.0f, kLevels);
        const float ic = p * c;
        sc[v] += ic;
        scc[v] += ic * c;
        scx[v] += (p * x) * c;
      }
    }
    for (int v = 0; v < kLanes; ++v) {
      const float det = sw[v] * scc[v] - sc[v] * sc[v];
      const float safe = det > 0.0f ? det : 1.0f;
      float a = (sw[v] * scx[v] - sc[v] * sx[v]) / safe;
      float b = (scc[v] * sx[v] - sc[v] * scx[v]) / safe;
      const bool clamped = b > 0.0f;  // the range starts at 0: a from the codes alone
      a = clamped ? scx[v] / (scc[v] > 0.0f ? scc[v] : 1.0f) : a;
      b = clamped ? 0.0f : b;
      const float err = a * a * scc[v] + b * b * sw[v] + sxx[v] +
                        2.0f * (a * b * sc[v] - a * scx[v] - b * sx[v]);
      const bool better = det > 0.0f && a > 0.0f && err < best_err[v];
      best_a[v] = better ? a : best_a[v];
      best_m[v] = better ? -b : best_m[v];
      best_err[v] = better ? err : best_err[v];
    }
  }
  for (int v = 0; v < kLanes; ++v) {
    const bool flat = !(span[v] > 0.0f);
    a_out[v] = flat ? 0.0f : best_a[v];
    m_out[v] = flat ? 0.0f : best_m[v];
  }
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

// Row `w` (k values) into its codes (k / 2 bytes) and scale bytes (S * 16); `a`, `m` hold
// S * 8 floats of scratch.
void quantize_row(const float* w, int64_t k, uint8_t* codes, uint8_t* scales, float* a,
                  float* m) {
  const int64_t nb = k / kBlock, ns = (nb + kSuper - 1) / kSuper, nbp = ns * kSuper;
  // importance |w| + the RMS of the weight's super-block (zero-padded to 256)
  float rms[1024];
  float* rp = ns <= 1024 ? rms : new float[ns];
  for (int64_t t = 0; t < ns; ++t) {
    const int64_t e0 = t * kSuper * kBlock, e1 = std::min<int64_t>(k, e0 + kSuper * kBlock);
    float ss = 0.0f;
    for (int64_t e = e0; e < e1; ++e) ss += w[e] * w[e];
    rp[t] = std::sqrt(ss / static_cast<float>(kSuper * kBlock));
  }
  // the fits, kLanes blocks at a time (blocks past the row: zeros, so a = m = 0)
  alignas(64) float tw[kBlock * kLanes], ti[kBlock * kLanes];
  for (int64_t j0 = 0; j0 < nbp; j0 += kLanes) {
    for (int v = 0; v < kLanes; ++v) {
      const int64_t j = j0 + v;
      const float r = j < nbp ? rp[j / kSuper] : 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        const float x = j < nb ? w[j * kBlock + i] : 0.0f;
        tw[i * kLanes + v] = x;
        ti[i * kLanes + v] = std::fabs(x) + r;
      }
    }
    float fa[kLanes], fm[kLanes];
    fit_blocks(tw, ti, fa, fm);
    for (int v = 0; v < kLanes && j0 + v < nbp; ++v) {
      a[j0 + v] = fa[v];
      m[j0 + v] = fm[v];
    }
  }
  if (rp != rms) delete[] rp;
  for (int64_t t = 0; t < ns; ++t) {
    const int64_t j0 = t * kSuper, nj = std::min<int64_t>(kSuper, nb - j0);
    int sc[kSuper], mq[kSuper];
    const uint16_t d = six_bits(a + j0, sc), dmin = six_bits(m + j0, mq);
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
  const int64_t nbp = sbytes / kSuperBytes * kSuper;
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    std::vector<float> a(nbp), m(nbp);  // the row's block scales and mins
    for (int64_t r = r0; r < r1; ++r) {
      quantize_row(w + r * k, k, c + r * (k / 2), s + r * sbytes, a.data(), m.data());
    }
  });
  return {codes, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("q4k_quantize(Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("q4k_quantize", &q4k_quantize); }

}  // namespace vllm_mamba
