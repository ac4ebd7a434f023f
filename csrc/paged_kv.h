// The paged KV cache of one attention layer as the CPU kernels see it: the element types they
// accept, a view of one kv head, and the checks of caches and block tables shared by the cache
// write (`reshape_and_cache.cpp`) and the attention kernels (`paged_attention.cpp`).
// Layout `(num_blocks, block_size, num_kv_heads, head_dim)`, head_dim contiguous.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace vllm_mamba {

// Calls `fn` with a null pointer of the element type of `t`: float, bfloat16 or float16.
template <typename Fn>
void dispatch_kv(const at::Tensor& t, const char* what, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    default:
      TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// One kv head of one layer's cache: element (block, offset, d) at
// base + block * block_stride + offset * token_stride + d.
template <typename C>
struct HeadView {
  const C* base;
  int64_t block_stride, token_stride, block_size;
};

template <typename C>
HeadView<C> head_view(const at::Tensor& cache, int64_t head) {
  return {cache.data_ptr<C>() + head * cache.stride(2), cache.stride(0), cache.stride(1),
          cache.size(1)};
}

// Checks that the blocks holding tokens [first, len) of one table row exist in a pool of
// `num_blocks` (entries outside them are never read, whatever they hold: past the end, or
// before a sliding window's first token, whose blocks may have been freed).
inline void check_row(const int64_t* row, int64_t width, int64_t len, int64_t block_size,
                      int64_t num_blocks, int64_t first = 0) {
  const int64_t used = (len + block_size - 1) / block_size;
  TORCH_CHECK(used <= width, "seq_len ", len, " needs more blocks than block_tables has");
  for (int64_t i = first / block_size; i < used; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "block id ", row[i], " outside the pool");
  }
}

// The first position a query at `pos` reads: `pos - window + 1` with a sliding window of
// `window` tokens (transformers' `kv_idx > q_idx - sliding_window`), else 0 (`window` 0).
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0;
}

inline void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t dim) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be (num_blocks, block_size, num_kv_heads, head_dim)");
  TORCH_CHECK(k_cache.size(3) == dim, "cache head_dim ", k_cache.size(3), " != ", dim);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache head_dim not contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
}

}  // namespace vllm_mamba
