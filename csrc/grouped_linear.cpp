// grouped_linear: out (M, N) = x (M, K) @ W^T + bias for the integer weights that pre-quantised
// checkpoints ship (`vllm_mamba/ops/grouped_linear.py`: GGUF blocks, GPTQ / AWQ,
// compressed-tensors), W (N, K) stored as integer codes in groups of G columns, each group with
// a float32 scale and an optional float32 offset:
//
//   W[n, k] = scales[n, k / G] * code[n, k] + offsets[n, k / G]
//
// - bits 8: codes (N, K) int8, G a multiple of 16;
// - bits 4: codes (N, K / 2) uint8, the engine's int4 packing (`gemv.h`'s `Q4Rows`: per 32
//   columns, byte j = code j | code j + 16 << 4), codes unsigned in [0, 15], G a multiple of 32.
//
// Activations are float32 or bfloat16 (the output in x's dtype) and products accumulate in
// float32. Two paths, by the number of rows of x, as in `int4_linear.cpp`:
// - up to kMaxGemvRows (kMaxNativeBf16GemvRows when the block GEMM runs in bfloat16): a GEMV
//   that streams the codes once, widening them in registers. Per group it takes the float32
//   dot product of x's group with the codes and adds `scale * dot + offset * sum(x's group)`;
//   the sums of x per group are computed once per call for every row of x. 4-bit codes are
//   unpacked as `code - 8` (`vec::load_q4_group`), the 8 folded into the offset term
//   (`offset + 8 * scale`). Threads split the output channels in blocks of 8.
// - more rows (prefill): the weight is dequantised a block of output channels at a time and
//   multiplied by the dense block GEMM (`block_gemm.h`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "block_gemm.h"
#include "gemv.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kMaxGemvRows = 64;            // rows up to which the GEMV runs
constexpr int64_t kMaxNativeBf16GemvRows = 32;  // the same when the GEMM would run in bfloat16
constexpr int64_t kRowUnit = gemv::kRowBlock;   // output channels per unit of parallel work
constexpr int64_t kMinTaskBytes = 1 << 15;      // weight bytes per parallel task, at least
// Rows of x per GEMV tile above one row: 4 x 2 accumulator pairs fit 32 vector registers,
// 2 x 2 fit 16 (AVX2, NEON).
constexpr int kTileX = vec::kLanes >= 16 ? 4 : 2;

// The weight, its codes typed by bits.
struct Grouped {
  const void* codes;     // bits 8: int8 (N, K); bits 4: uint8 (N, K / 2)
  const float* scales;   // (N, K / G)
  const float* offsets;  // (N, K / G) or nullptr
  int64_t k, group;
};

// Per bits: the columns one load widens (`kUnit`), the bytes of a row, the widening.
template <int Bits>
struct Codes;

template <>
struct Codes<8> {
  static constexpr int kUnit = 16;
  static constexpr float kShift = 0.0f;  // the codes are widened as they are
  static constexpr int kVecs = kUnit / vec::kLanes;
  static int64_t row_bytes(int64_t k) { return k; }
  // v = codes (row, col .. col + 16) as float32.
  static void widen(const Grouped& w, int64_t row, int64_t col, vec::Vf* v) {
    const int8_t* p = static_cast<const int8_t*>(w.codes) + row * w.k + col;
    for (int j = 0; j < kVecs; ++j) v[j] = vec::load(p + j * vec::kLanes);
  }
};

template <>
struct Codes<4> {
  static constexpr int kUnit = gemv::kQ4Group;
  static constexpr float kShift = 8.0f;  // `load_q4_group` gives code - 8
  static constexpr int kVecs = kUnit / vec::kLanes;
  static int64_t row_bytes(int64_t k) { return k / 2; }
  // v = codes (row, col .. col + 32) - 8 as float32.
  static void widen(const Grouped& w, int64_t row, int64_t col, vec::Vf* v) {
    const uint8_t* p = static_cast<const uint8_t*>(w.codes) + row * (w.k / 2) + col / 2;
    vec::load_q4_group(p, v);
  }
};

// out[b][r] = W[r0 + r] . x[b] for R weight rows and B rows of x (row stride ldx), with
// xsum[b * groups + g] the sum of x[b]'s group g. Per group each unit of codes is widened once
// and multiplied with every row of x into per-group partial sums, which are then scaled.
template <int Bits, int R, int B>
inline void grouped_tile(const Grouped& w, int64_t r0, const float* x, int64_t ldx,
                         const float* xsum, float out[B][R]) {
  using C = Codes<Bits>;
  using vec::Vf;
  constexpr int L = vec::kLanes;
  const int64_t groups = w.k / w.group, units = w.group / C::kUnit;
  const bool shifted = w.offsets != nullptr || C::kShift != 0.0f;
  Vf acc[B][R];
  float off[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = vec::zero(), off[b][r] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    Vf t[B][R];  // the group's dot products of x and the widened codes
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < R; ++r) t[b][r] = vec::zero();
    for (int64_t u = 0; u < units; ++u) {
      const int64_t col = g * w.group + u * C::kUnit;
      for (int r = 0; r < R; ++r) {
        Vf wq[C::kVecs];
        C::widen(w, r0 + r, col, wq);
        for (int b = 0; b < B; ++b) {
          const float* xp = x + b * ldx + col;
          for (int j = 0; j < C::kVecs; ++j) {
            t[b][r] = vec::fma(wq[j], vec::load(xp + j * L), t[b][r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * groups + g;
      const float s = w.scales[at];
      const Vf sv = vec::set1(s);
      for (int b = 0; b < B; ++b) acc[b][r] = vec::fma(t[b][r], sv, acc[b][r]);
      if (shifted) {
        const float o = (w.offsets ? w.offsets[at] : 0.0f) + C::kShift * s;
        for (int b = 0; b < B; ++b) off[b][r] += o * xsum[b * groups + g];
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) out[b][r] = vec::sum(acc[b][r]) + off[b][r];
}

// Rows [r0, r0 + R) for every row of x, in tiles of kTileX rows of x (then single rows).
template <int Bits, int R>
inline void grouped_rows(const Grouped& w, int64_t r0, const float* x, const float* xsum,
                         int64_t batch, float* out, int64_t n) {
  const int64_t groups = w.k / w.group;
  int64_t b = 0;
  for (; b + kTileX <= batch; b += kTileX) {
    float o[kTileX][R];
    grouped_tile<Bits, R, kTileX>(w, r0, x + b * w.k, w.k, xsum + b * groups, o);
    for (int bb = 0; bb < kTileX; ++bb)
      for (int j = 0; j < R; ++j) out[(b + bb) * n + r0 + j] = o[bb][j];
  }
  for (; b < batch; ++b) {
    float o[1][R];
    grouped_tile<Bits, R, 1>(w, r0, x + b * w.k, w.k, xsum + b * groups, o);
    for (int j = 0; j < R; ++j) out[b * n + r0 + j] = o[0][j];
  }
}

// Prefetches (into L2) row `row`'s codes, scales and offsets where they are short streams
// (`gemv::prefetch_row`: under `kPrefetchMaxRowBytes`).
template <int Bits>
inline void prefetch_grouped_row(const Grouped& w, int64_t row) {
  const int64_t code_bytes = Codes<Bits>::row_bytes(w.k);
  const int64_t groups = w.k / w.group;
  gemv::prefetch_row(static_cast<const int8_t*>(w.codes) + row * code_bytes, code_bytes);
  const int64_t scale_bytes = groups * static_cast<int64_t>(sizeof(float));
  if (scale_bytes >= gemv::kPrefetchMaxRowBytes) return;
  for (int64_t off = 0; off < scale_bytes; off += 64) {
    vec::prefetch_l2(reinterpret_cast<const char*>(w.scales + row * groups) + off);
    if (w.offsets) vec::prefetch_l2(reinterpret_cast<const char*>(w.offsets + row * groups) + off);
  }
}

// out (M, N) float32 = x (M, K) float32 @ W^T + bias, each task a range of output channels.
// Weight rows go four at a time for one row of x, two at a time for more (`grouped_tile`).
template <int Bits>
void gemv_grouped(const Grouped& w, const float* x, const float* xsum, int64_t m, int64_t n,
                  const float* bias, float* out) {
  constexpr int kWide = 4, kNarrow = 2;
  const int64_t units = (n + kRowUnit - 1) / kRowUnit;
  const int64_t groups = w.k / w.group;
  const int64_t unit_bytes =
      kRowUnit * (Codes<Bits>::row_bytes(w.k) + groups * (w.offsets ? 8 : 4));
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(unit_bytes, 1));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t lo = u0 * kRowUnit, hi = std::min(n, u1 * kRowUnit);
    int64_t r = lo;
    if (m == 1) {
      for (; r + kWide <= hi; r += kWide) {
        for (int64_t p = r + 2 * kWide; p < std::min(hi, r + 3 * kWide); ++p) {
          prefetch_grouped_row<Bits>(w, p);  // the rows two tiles ahead
        }
        grouped_rows<Bits, kWide>(w, r, x, xsum, m, out, n);
      }
    } else {
      for (; r + kNarrow <= hi; r += kNarrow) grouped_rows<Bits, kNarrow>(w, r, x, xsum, m, out, n);
    }
    for (; r < hi; ++r) grouped_rows<Bits, 1>(w, r, x, xsum, m, out, n);
    if (bias) {
      for (int64_t b = 0; b < m; ++b)
        for (int64_t j = lo; j < hi; ++j) out[b * n + j] += bias[j];
    }
  });
}

// xsum (M, K / G): the sum of each group of each row of x (M, K) float32.
at::Tensor group_sums(const at::Tensor& x, int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / group;
  at::Tensor sums = at::empty({m, groups}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = sums.data_ptr<float>();
  for (int64_t b = 0; b < m; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* p = xp + b * k + g * group;
      vec::Vf acc = vec::zero();
      for (int64_t i = 0; i < group; i += vec::kLanes) acc = vec::add(acc, vec::load(p + i));
      sp[b * groups + g] = vec::sum(acc);
    }
  }
  return sums;
}

// One dequantised vector of weights, stored as float32 or rounded to bfloat16.
inline void store_vec(float* dst, vec::Vf v) { vec::store(dst, v); }
inline void store_vec(c10::BFloat16* dst, vec::Vf v) {
  vec::store(reinterpret_cast<vec::bf16_t*>(dst), v);
}

// buf (rows, K) = W[n0 : n0 + rows], each weight `scale * code + offset` (one rounding).
template <int Bits, typename T>
void dequantize_block(const Grouped& w, T* buf, int64_t n0, int64_t rows) {
  using C = Codes<Bits>;
  const int64_t groups = w.k / w.group, units = w.group / C::kUnit;
  const int64_t row_bytes = C::row_bytes(w.k);
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(row_bytes, 1));
  const vec::Vf shift = vec::set1(C::kShift);
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t row = n0 + r;
      for (int64_t g = 0; g < groups; ++g) {
        const vec::Vf s = vec::set1(w.scales[row * groups + g]);
        const vec::Vf o = vec::set1(w.offsets ? w.offsets[row * groups + g] : 0.0f);
        for (int64_t u = 0; u < units; ++u) {
          const int64_t col = g * w.group + u * C::kUnit;
          vec::Vf v[C::kVecs];
          C::widen(w, row, col, v);
          for (int j = 0; j < C::kVecs; ++j) {
            const vec::Vf code = C::kShift != 0.0f ? vec::add(v[j], shift) : v[j];
            store_vec(buf + r * w.k + col + j * vec::kLanes, vec::fma(code, s, o));
          }
        }
      }
    }
  });
}

template <int Bits>
at::Tensor run(const at::Tensor& x_in, const Grouped& w, int64_t n, const at::Tensor& bias) {
  const int64_t m = x_in.size(0);
  const bool bf16_gemm = x_in.scalar_type() == at::kBFloat16 && vec::native_bf16();
  if (m > (bf16_gemm ? kMaxNativeBf16GemvRows : kMaxGemvRows)) {
    return block_gemm(x_in.contiguous(), n, bias, [&](auto* buf, int64_t n0, int64_t rows, int64_t) {
      dequantize_block<Bits>(w, buf, n0, rows);
    });
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    const bool shifted = w.offsets != nullptr || Codes<Bits>::kShift != 0.0f;
    const at::Tensor xsum = shifted ? group_sums(x, w.group) : at::empty({0}, x.options());
    gemv_grouped<Bits>(w, x.data_ptr<float>(), xsum.data_ptr<float>(), m, n,
                       bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>());
  }
  return out.to(x_in.scalar_type());
}

// A (N, K / G) float32 group tensor of the op, checked and contiguous.
at::Tensor group_tensor(const at::Tensor& t, const char* name, int64_t n, int64_t groups) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "grouped_linear: ", name,
                    " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, "grouped_linear: ",
                    name, " must be (N, K / group) = (", n, ", ", groups, "), got ", t.sizes());
  return t.contiguous();
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& codes_in,
                          const at::Tensor& scales_in, const std::optional<at::Tensor>& offsets_in,
                          const std::optional<at::Tensor>& bias_in, int64_t bits, int64_t group) {
  TORCH_CHECK_VALUE(x.dim() == 2, "grouped_linear: x must be (M, K), got ", x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                    "grouped_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "grouped_linear: bits must be 4 or 8, got ", bits);
  const int64_t k = x.size(1);
  const int64_t unit = bits == 4 ? Codes<4>::kUnit : Codes<8>::kUnit;
  TORCH_CHECK_VALUE(group > 0 && group % unit == 0 && k % group == 0, "grouped_linear: group ",
                    group, " must be a multiple of ", unit, " dividing K = ", k);
  TORCH_CHECK_VALUE(codes_in.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
                    "grouped_linear: codes must be ", bits == 4 ? "uint8" : "int8",
                    " for bits ", bits, ", got ", codes_in.scalar_type());
  TORCH_CHECK_VALUE(codes_in.dim() == 2 && codes_in.size(1) == (bits == 4 ? k / 2 : k),
                    "grouped_linear: codes must be (N, ", bits == 4 ? "K / 2" : "K",
                    ") with the K of x, got ", codes_in.sizes());
  const int64_t n = codes_in.size(0), groups = k / group;
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor scales = group_tensor(scales_in, "scales", n, groups);
  at::Tensor offsets;
  if (offsets_in.has_value()) offsets = group_tensor(*offsets_in, "offsets", n, groups);
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK_VALUE(bias_in->numel() == n, "grouped_linear: bias must be (N,) = (", n,
                      ",), got ", bias_in->sizes());
    bias = bias_in->to(at::kFloat).contiguous();
  }
  const Grouped w{codes.data_ptr(), scales.data_ptr<float>(),
                  offsets.defined() ? offsets.data_ptr<float>() : nullptr, k, group};
  return bits == 4 ? run<4>(x, w, n, bias) : run<8>(x, w, n, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("grouped_linear", &grouped_linear); }

}  // namespace vllm_mamba
