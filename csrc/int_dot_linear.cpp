// Linear layers with integer dot products (`quantization="w8a8"` / `"w4a8"`, `int_dot.h`):
//
//   w8a8_linear: out (M, N) = Q8(x) (M, K) @ (qweight (N, K) int8 * scale (N,))^T + bias
//   w4a8_linear: out (M, N) = Q8(x) (M, K) @ W^T + bias, W the 4-bit groups of `int4_linear`
//                (qweight (N, K / 2) uint8, scales (N, K / 32) float16), or the Q4_K-style
//                super-blocks of `quantization="w4a8_k"` (scales (N, ceil(K / 256) * 16)
//                uint8: `int_dot::Q4KRows`), told apart by the scales' dtype
//
// Q8(x): each row of x quantised to int8 in blocks of 32 with a float32 scale per block
// (llama.cpp's Q8_0). K must be a multiple of 32. x is float32 or bfloat16; the result has x's
// dtype. x is quantised once (rows split over the threads). Up to 15 rows (decode) the threads
// split the output channels, each streaming its weight rows once per group of 4 rows of x
// (`int_dot::rows_i8` / `rows_q4`); from 16 rows (prefill, on AVX2 / AVX-512) they split the
// strips of the cache-blocked GEMM (`int_dot_gemm.h`), and the rows of x too where the strips
// are few. Both give the same bits for a row (a row's result never depends on the batch).
// `vllm_mamba/ops/int_dot_linear.py` holds the references.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv.h"
#include "int_dot.h"
#include "int_dot_gemm.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kRowUnit = gemv::kRowBlock;  // output channels per unit of parallel work
constexpr int64_t kMinTaskBytes = 1 << 15;     // weight bytes per parallel task, at least

// x (M, K) float32 contiguous quantised into `q` (rows split over the threads).
void quantize_x(const at::Tensor& x, int_dot::QActs& q) {
  const int64_t m = x.size(0), k = x.size(1);
  q.resize(m, k);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / std::max<int64_t>(k, 1)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t b = lo; b < hi; ++b) q.quantize(b, xp + b * k, k);
                   });
}

// The checks shared by both ops: x (M, K) float32 / bfloat16 with K a multiple of 32, bias (N,).
void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be (M, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % int_dot::kBlock == 0, op, ": K must be a multiple of 32, got ",
              x.size(1));
}

at::Tensor bias_of(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias must be (N,), got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// Adds bias b (N,) to rows [m0, m1), columns [lo, hi) of out (M, N).
void add_bias(float* o, const float* b, int64_t n, int64_t m0, int64_t m1, int64_t lo,
              int64_t hi) {
  for (int64_t r = m0; r < m1; ++r)
    for (int64_t c = lo; c < hi; ++c) o[r * n + c] += b[c];
}

// The GEMM's parallel split (`int_dot_gemm.h`): blocks of strips (`gemm::block_strips`) by
// chunks of x groups (of `gemm::C` rows), the chunks many enough for 4 tasks per thread where
// the blocks are few (at least 4 groups each).
struct GemmSplit {
  int64_t strips, per_block, blocks, chunks, chunk;
};

GemmSplit gemm_split(int64_t groups, int64_t n, int64_t k) {
  const int64_t strips = int_dot::gemm::strips(n);
  const int64_t per_block = int_dot::gemm::block_strips(k);
  const int64_t blocks = (strips + per_block - 1) / per_block;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks =
      std::clamp<int64_t>((want + blocks - 1) / blocks, 1, std::max<int64_t>(1, groups / 4));
  return {strips, per_block, blocks, chunks, (groups + chunks - 1) / chunks};
}

// out (M, N) in x's dtype. Below `gemm::kMinRows` rows (or without the GEMM) from
// `rows(q, lo, hi, out, ldo)`, which writes the products of weight rows [lo, hi) with every
// quantised row of x (`row_bytes` sizes the parallel tasks); else from `block(xp, s0, s1, g0,
// g1, out, ldo, scratch)`, which writes strips [s0, s1) for x groups [g0, g1) of the x panels
// (x quantised into them with `shift`, `gemm::XPanels`). The quantised rows, the x panels and
// the strips (`gemm::Strip`: a gathered copy of a weight's last rows) live in buffers of the
// calling and worker threads, kept between calls (fresh pages cost more than the copies).
template <typename Rows, typename BlockFn>
at::Tensor run(const at::Tensor& x_in, int64_t n, int64_t row_bytes, const at::Tensor& bias,
               int shift, Rows&& rows, BlockFn&& block) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out.to(x_in.scalar_type());
  float* o = out.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (int_dot::gemm::kAvailable && m >= int_dot::gemm::kMinRows) {
    static thread_local int_dot::gemm::XPanels xp_buf;
    int_dot::gemm::XPanels& xp = xp_buf;  // the calling thread's (in a worker, a worker's own)
    xp.resize(m, k / int_dot::kBlock);
    const float* xs = x.data_ptr<float>();
    at::parallel_for(0, xp.groups, 1,
                     [&](int64_t g0, int64_t g1) { xp.fill(xs, k, shift, g0, g1); });
    const GemmSplit sp = gemm_split(xp.groups, n, k);
    at::parallel_for(0, sp.blocks * sp.chunks, 1, [&](int64_t t0, int64_t t1) {
      // consecutive tasks of a block pack its strips once
      static thread_local std::vector<int_dot::gemm::Strip> scratch;
      for (auto& s : scratch) s.index = -1;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t s0 = t / sp.chunks * sp.per_block;
        const int64_t s1 = std::min(sp.strips, s0 + sp.per_block);
        const int64_t g0 = t % sp.chunks * sp.chunk, g1 = std::min(xp.groups, g0 + sp.chunk);
        if (g0 >= g1) continue;
        int_dot::gemm::Next next;  // the thread's next block (its first task's strips)
        if (t + 1 < t1 && (t + 1) / sp.chunks != t / sp.chunks) {
          next.s0 = s1;
          next.s1 = std::min(sp.strips, s1 + sp.per_block);
        }
        block(xp, s0, s1, g0, g1, o, n, scratch, next);
        if (b) {
          const int64_t lo = s0 * int_dot::gemm::kStripRows;
          add_bias(o, b, n, g0 * int_dot::gemm::C, std::min(m, g1 * int_dot::gemm::C), lo,
                   std::min(n, s1 * int_dot::gemm::kStripRows));
        }
      }
    });
    return out.to(x_in.scalar_type());
  }
  static thread_local int_dot::QActs q_buf;
  int_dot::QActs& q = q_buf;
  quantize_x(x, q);
  const int64_t units = (n + kRowUnit - 1) / kRowUnit;
  const int64_t grain =
      std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(kRowUnit * row_bytes, 1));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t lo = u0 * kRowUnit, hi = std::min(n, u1 * kRowUnit);
    rows(q, lo, hi, o + lo, n);
    if (b) add_bias(o, b, n, 0, m, lo, hi);
  });
  return out.to(x_in.scalar_type());
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  check_x(x, "w8a8_linear");
  const int64_t k = x.size(1);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == k,
              "w8a8_linear: qweight must be (N, K) with the K of x, got ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "w8a8_linear: qweight must be contiguous int8");
  const int64_t n = qweight.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "w8a8_linear: scale must be contiguous float32 (N,)");
  const int_dot::I8Rows w{qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), k, n};
  return run(x, n, k, bias_of(bias, n, "w8a8_linear"), int_dot::gemm::i8_shift(),
             [&](const int_dot::QActs& q, int64_t lo, int64_t hi, float* out, int64_t ldo) {
               int_dot::rows_i8(w, q, lo, hi, out, ldo);
             },
             [&](const int_dot::gemm::XPanels& xp, int64_t s0, int64_t s1, int64_t g0, int64_t g1,
                 float* out, int64_t ldo, std::vector<int_dot::gemm::Strip>& s,
                 const int_dot::gemm::Next& next) {
               int_dot::gemm::block_i8(w, n, xp, s0, s1, g0, g1, out, ldo, s, next);
             });
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  check_x(x, "w4a8_linear");
  const int64_t k = x.size(1);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * 2 == k,
              "w4a8_linear: qweight must be (N, K / 2) with the K of x, got ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "w4a8_linear: qweight must be contiguous uint8");
  const int64_t n = qweight.size(0);
  if (scales.scalar_type() == at::kByte) {  // Q4_K-style super-blocks
    const int64_t sbytes = int_dot::super_blocks(k) * int_dot::kSuperBytes;
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n &&
                    scales.size(1) == sbytes,
                "w4a8_linear: Q4_K-style scales must be contiguous uint8 (N, ceil(K / 256) * 16) ",
                "= (", n, ", ", sbytes, "), got ", scales.sizes());
    const int_dot::Q4KRows w{qweight.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), k, n};
    return run(x, n, k / 2, bias_of(bias, n, "w4a8_linear"), 0,
               [&](const int_dot::QActs& q, int64_t lo, int64_t hi, float* out, int64_t ldo) {
                 int_dot::rows_q4k(w, q, lo, hi, out, ldo);
               },
               [&](const int_dot::gemm::XPanels& xp, int64_t s0, int64_t s1, int64_t g0,
                   int64_t g1, float* out, int64_t ldo, std::vector<int_dot::gemm::Strip>& s,
                 const int_dot::gemm::Next& next) {
                 int_dot::gemm::block_q4k(w, n, xp, s0, s1, g0, g1, out, ldo, s, next);
               });
  }
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / int_dot::kBlock,
              "w4a8_linear: scales must be contiguous float16 (N, K / 32) or Q4_K-style uint8");
  const int_dot::Q4Rows w{qweight.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), k, n};
  return run(x, n, k / 2, bias_of(bias, n, "w4a8_linear"), int_dot::gemm::kQ4Shift,
             [&](const int_dot::QActs& q, int64_t lo, int64_t hi, float* out, int64_t ldo) {
               int_dot::rows_q4(w, q, lo, hi, out, ldo);
             },
             [&](const int_dot::gemm::XPanels& xp, int64_t s0, int64_t s1, int64_t g0, int64_t g1,
                 float* out, int64_t ldo, std::vector<int_dot::gemm::Strip>& s,
                 const int_dot::gemm::Next& next) {
               int_dot::gemm::block_q4(w, n, xp, s0, s1, g0, g1, out, ldo, s, next);
             });
}

// The multiply instruction of the kernels on this CPU ("vpdpbusd", "maddubs", "scalar").
std::string int_dot_instruction() { return int_dot::instruction(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("w8a8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int_dot_instruction() -> str", &int_dot_instruction);
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w4a8_linear", &w4a8_linear);
}

}  // namespace vllm_mamba
