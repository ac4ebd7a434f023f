// LFM2's gated short conv on the CPU: `C * conv(B * x)` straight from the in_proj output
// `bcx (T, 3D) = [B | C | x]`, the op family `short_conv` (`vllm_mamba/ops/short_conv.py` has
// the references and the semantics). `conv` is a depthwise causal conv of width K (no
// activation) whose per-slot history `conv_states (S, D, K - 1)` holds the last K - 1 values of
// `u = B * x`. Math in float32; the history is stored in the state's dtype; a slot index of -1
// marks a padding row whose slot is never read nor written (its outputs use a zero history).
//
// Neither op materialises `u` or the conv output: each task keeps a sliding window of K vectors
// of `u` (`vec.h`, one vector of channels at a time) and writes `C * y` directly.
//   update: parallel over (row, channel chunk); the history is gathered per channel, then
//           shifted in place.
//   varlen: parallel over (tile of up to kTileTokens tokens of one sequence, channel chunk); a
//           tile recomputes the K - 1 values of `u` before it (from bcx, or the saved history
//           before the sequence start), so tiles are independent. A second pass writes each
//           sequence's last K - 1 values of `u` to its slot, after every read of the old ones.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernel_math.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

using vec::Vf;
constexpr int L = vec::kLanes;
constexpr int64_t kMaxWidth = 8;       // K up to which the window lives in a fixed array
constexpr int64_t kChunk = 4 * kBlock;  // channels per task
constexpr int64_t kTileTokens = 64;    // tokens per varlen task

// The `vec.h` element type of a kernel element type (at::BFloat16 has bfloat16's raw layout).
template <typename T>
struct VecElem {
  using type = float;
};
template <>
struct VecElem<at::BFloat16> {
  using type = vec::bf16_t;
};

// `n <= L` values from `p`, widened to float32 (lanes past n are zero).
template <typename T>
inline Vf load_t(const T* p, int n) {
  const auto* q = reinterpret_cast<const typename VecElem<T>::type*>(p);
  return n == L ? vec::load(q) : vec::load_n(q, n);
}

// Stores the first `n <= L` lanes of `v` to `p`, rounded to T (nearest even for bfloat16).
template <typename T>
inline void store_t(T* p, Vf v, int n) {
  if (n == L) {
    vec::store(reinterpret_cast<typename VecElem<T>::type*>(p), v);
    return;
  }
  float buf[L];
  vec::store(buf, v);
  for (int j = 0; j < n; ++j) p[j] = static_cast<T>(buf[j]);
}

// Column `col` of the saved history of channels [d, d + n) of `slot`, as a vector.
template <typename S>
inline Vf gather_history(const S* states, int64_t slot, int64_t dim, int64_t hist, int64_t d,
                         int n, int64_t col) {
  float buf[L] = {};
  const S* st = states + (slot * dim + d) * hist + col;
  for (int j = 0; j < n; ++j) buf[j] = to_f32(st[j * hist]);
  return vec::load(buf);
}

struct Problem {
  int64_t dim, width, row_stride;  // D, K, elements between rows of bcx
  const float* weight_t;           // (K, D): filters transposed so channels are contiguous
  const float* bias;               // (D,) or nullptr
};

// Filters (and bias) of channels [d, d + n) as vectors.
inline void load_filters(const Problem& p, int64_t d, int n, Vf* w, Vf& bias) {
  for (int64_t k = 0; k < p.width; ++k) w[k] = load_t(p.weight_t + k * p.dim + d, n);
  bias = p.bias ? load_t(p.bias + d, n) : vec::zero();
}

// ---------------------------------------------------------------------------------------------
// Decode: one token per row.

template <typename T, typename S>
void update_rows(const Problem& p, const T* bcx, S* states, const int64_t* slots, T* out,
                 int64_t batch) {
  const int64_t dim = p.dim, hist = p.width - 1;
  const int64_t chunks = (dim + kChunk - 1) / kChunk;
  at::parallel_for(0, batch * chunks, 4, [&](int64_t lo, int64_t hi) {
    Vf w[kMaxWidth];
    Vf bias;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / chunks;
      const int64_t slot = slots[b];
      const int64_t d1 = std::min(dim, (i % chunks + 1) * kChunk);
      const T* row = bcx + b * p.row_stride;
      for (int64_t d = (i % chunks) * kChunk; d < d1; d += L) {
        const int n = static_cast<int>(std::min<int64_t>(L, d1 - d));
        load_filters(p, d, n, w, bias);
        const Vf u = vec::mul(load_t(row + d, n), load_t(row + 2 * dim + d, n));  // B * x
        Vf acc = vec::fma(w[hist], u, bias);
        if (slot >= 0) {
          for (int64_t k = 0; k < hist; ++k)
            acc = vec::fma(w[k], gather_history(states, slot, dim, hist, d, n, k), acc);
        }
        store_t(out + b * dim + d, vec::mul(load_t(row + dim + d, n), acc), n);  // C * y
        if (slot < 0) continue;
        float ubuf[L];
        vec::store(ubuf, u);
        for (int j = 0; j < n; ++j) {
          S* st = states + (slot * dim + d + j) * hist;
          for (int64_t k = 0; k + 1 < hist; ++k) st[k] = st[k + 1];
          st[hist - 1] = static_cast<S>(ubuf[j]);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Prefill: packed sequences.

struct Tile {
  int64_t seq, t0, t1;  // tokens [t0, t1) of sequence seq
};

struct Varlen {
  const int64_t* qsl;    // (B + 1,)
  const int64_t* slots;  // (B,)
  const bool* has_init;  // (B,)
};

// Outputs of tile `tile` for channels [d0, d1).
template <typename T, typename S>
void varlen_tile(const Problem& p, const Varlen& v, const T* bcx, const S* states, T* out,
                 const Tile& tile, int64_t d0, int64_t d1) {
  const int64_t dim = p.dim, hist = p.width - 1;
  const int64_t start = v.qsl[tile.seq];
  const int64_t slot = v.slots[tile.seq];
  const bool from_state = slot >= 0 && v.has_init[tile.seq];
  Vf w[kMaxWidth], win[kMaxWidth];
  Vf bias;
  for (int64_t d = d0; d < d1; d += L) {
    const int n = static_cast<int>(std::min<int64_t>(L, d1 - d));
    load_filters(p, d, n, w, bias);
    // win[k] = u at position t0 - hist + k (before the sequence start: the saved history).
    for (int64_t k = 0; k < hist; ++k) {
      const int64_t src = tile.t0 - hist + k;
      if (src >= start) {
        const T* row = bcx + src * p.row_stride;
        win[k] = vec::mul(load_t(row + d, n), load_t(row + 2 * dim + d, n));
      } else if (from_state) {
        win[k] = gather_history(states, slot, dim, hist, d, n, hist + (src - start));
      } else {
        win[k] = vec::zero();
      }
    }
    for (int64_t t = tile.t0; t < tile.t1; ++t) {
      const T* row = bcx + t * p.row_stride;
      win[hist] = vec::mul(load_t(row + d, n), load_t(row + 2 * dim + d, n));  // B * x
      Vf acc = bias;
      for (int64_t k = 0; k <= hist; ++k) acc = vec::fma(w[k], win[k], acc);
      store_t(out + t * dim + d, vec::mul(load_t(row + dim + d, n), acc), n);  // C * y
      for (int64_t k = 0; k < hist; ++k) win[k] = win[k + 1];
    }
  }
}

// Overwrites sequence b's slot, channels [d0, d1), with its last K - 1 values of u (older
// ones from the slot itself when the sequence is shorter than K - 1).
template <typename T, typename S>
void varlen_write_state(const Problem& p, const Varlen& v, const T* bcx, S* states, int64_t b,
                        int64_t d0, int64_t d1) {
  const int64_t dim = p.dim, hist = p.width - 1;
  const int64_t slot = v.slots[b];
  if (slot < 0) return;
  const int64_t start = v.qsl[b], end = v.qsl[b + 1];
  const bool keep = v.has_init[b];
  for (int64_t d = d0; d < d1; ++d) {
    S* st = states + (slot * dim + d) * hist;
    // In place is safe: column j reads column (len + j) >= j, not yet overwritten.
    for (int64_t j = 0; j < hist; ++j) {
      const int64_t src = end - hist + j;
      float u = 0.0f;
      if (src >= start) {
        const T* row = bcx + src * p.row_stride;
        u = to_f32(row[d]) * to_f32(row[2 * dim + d]);
      } else if (keep) {
        u = to_f32(st[hist + (src - start)]);
      }
      st[j] = static_cast<S>(u);
    }
  }
}

template <typename T, typename S>
void varlen_run(const Problem& p, const Varlen& v, const T* bcx, S* states, T* out,
                int64_t batch) {
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t0 = v.qsl[b]; t0 < v.qsl[b + 1]; t0 += kTileTokens)
      tiles.push_back({b, t0, std::min(v.qsl[b + 1], t0 + kTileTokens)});
  }
  const int64_t chunks = (p.dim + kChunk - 1) / kChunk;
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, num_tiles * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t d0 = (i % chunks) * kChunk;
      varlen_tile<T, S>(p, v, bcx, states, out, tiles[i / chunks], d0,
                        std::min(p.dim, d0 + kChunk));
    }
  });
  at::parallel_for(0, batch * chunks, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t d0 = (i % chunks) * kChunk;
      varlen_write_state<T, S>(p, v, bcx, states, i / chunks, d0, std::min(p.dim, d0 + kChunk));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Entry points.

// Checks the shared arguments; returns bcx with unit channel stride and D.
at::Tensor check_common(const at::Tensor& bcx_in, const at::Tensor& conv_states,
                        const at::Tensor& weight, int64_t& dim) {
  TORCH_CHECK(bcx_in.dim() == 2 && bcx_in.size(1) % 3 == 0, "bcx must be (T, 3D)");
  dim = bcx_in.size(1) / 3;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim, "weight must be (D, K)");
  const int64_t width = weight.size(1);
  TORCH_CHECK(width >= 2 && width <= kMaxWidth, "short_conv: K must be in [2, ", kMaxWidth,
              "], got ", width);
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == dim &&
                  conv_states.size(2) == width - 1,
              "conv_states must be (S, D, K - 1)");
  TORCH_CHECK(conv_states.is_contiguous(), "conv_states must be contiguous");
  return bcx_in.stride(1) == 1 ? bcx_in : bcx_in.contiguous();
}

template <typename Fn>
void dispatch_types(const at::Tensor& bcx, const at::Tensor& conv_states, Fn&& fn) {
  dispatch_float_bf16(bcx, "bcx", [&](auto* bt) {
    dispatch_float_bf16(conv_states, "conv_states", [&](auto* st) { fn(bt, st); });
  });
}

at::Tensor short_conv_update(const at::Tensor& bcx_in, at::Tensor conv_states,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const at::Tensor& state_indices) {
  int64_t dim = 0;
  const at::Tensor bcx = check_common(bcx_in, conv_states, weight, dim);
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(bcx.size(0) == batch, "bcx must be (B, 3D)");
  const at::Tensor weight_t = weight.to(at::kFloat).t().contiguous();  // (K, D)
  const at::Tensor bias_f = optional_f32(bias);
  const at::Tensor slots = as_index(state_indices);
  at::Tensor out = at::empty({batch, dim}, bcx.options());  // (B, D)
  const Problem p{dim, weight.size(1), bcx.stride(0), weight_t.data_ptr<float>(),
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr};
  dispatch_types(bcx, conv_states, [&](auto* bt, auto* st) {
    using T = std::remove_pointer_t<decltype(bt)>;
    using S = std::remove_pointer_t<decltype(st)>;
    update_rows<T, S>(p, bcx.data_ptr<T>(), conv_states.data_ptr<S>(),
                      slots.data_ptr<int64_t>(), out.data_ptr<T>(), batch);
  });
  return out;
}

at::Tensor short_conv_varlen(const at::Tensor& bcx_in, at::Tensor conv_states,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                             const at::Tensor& has_initial_state) {
  int64_t dim = 0;
  const at::Tensor bcx = check_common(bcx_in, conv_states, weight, dim);
  const int64_t batch = state_indices.size(0);
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && has_initial_state.numel() == batch,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  const at::Tensor qsl = as_index(query_start_loc);
  const int64_t tokens = bcx.size(0);
  TORCH_CHECK(qsl[batch].item<int64_t>() == tokens, "query_start_loc[-1] must equal T");
  const at::Tensor weight_t = weight.to(at::kFloat).t().contiguous();  // (K, D)
  const at::Tensor bias_f = optional_f32(bias);
  const at::Tensor slots = as_index(state_indices);
  const at::Tensor has_init = has_initial_state.to(at::kBool).contiguous();
  at::Tensor out = at::empty({tokens, dim}, bcx.options());  // (T, D)
  const Problem p{dim, weight.size(1), bcx.stride(0), weight_t.data_ptr<float>(),
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr};
  const Varlen v{qsl.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), has_init.data_ptr<bool>()};
  dispatch_types(bcx, conv_states, [&](auto* bt, auto* st) {
    using T = std::remove_pointer_t<decltype(bt)>;
    using S = std::remove_pointer_t<decltype(st)>;
    varlen_run<T, S>(p, v, bcx.data_ptr<T>(), conv_states.data_ptr<S>(), out.data_ptr<T>(),
                     batch);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("short_conv_update", &short_conv_update);
  m.impl("short_conv_varlen", &short_conv_varlen);
}

}  // namespace vllm_mamba
