// The paged KV cache write on the CPU: each token's key and value go to its slot
// `block_id * block_size + offset` of `(num_blocks, block_size, num_kv_heads, head_dim)`
// caches, cast to the cache dtype; `PAD_SLOT_ID` (< 0) slots are skipped. As
// `reshape_and_cache_ref` in `vllm_mamba/ops/paged_attention.py`; tokens in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "kernel_math.h"
#include "paged_kv.h"

namespace vllm_mamba {
namespace {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be (T, Hkv, D)");
  check_cache(k_cache, v_cache, key.size(2));
  TORCH_CHECK(key.size(1) == k_cache.size(2), "key heads != cache kv heads");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(slot_mapping.numel() == tokens, "slot_mapping must be (T,)");
  const at::Tensor k = key.to(k_cache.scalar_type()).contiguous();
  const at::Tensor v = value.to(k_cache.scalar_type()).contiguous();
  const at::Tensor slots = as_index(slot_mapping);
  const int64_t bs = k_cache.size(1), capacity = k_cache.size(0) * bs;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] < capacity, "slot ", sp[t], " beyond the cache of ", capacity, " slots");
  }
  dispatch_kv(k_cache, "k_cache", [&](auto* tp) {
    using C = std::remove_pointer_t<decltype(tp)>;
    const C* kp = k.data_ptr<C>();
    const C* vp = v.data_ptr<C>();
    C* kc = k_cache.data_ptr<C>();
    C* vc = v_cache.data_ptr<C>();
    at::parallel_for(0, tokens, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t slot = sp[t];
        if (slot < 0) continue;  // PAD_SLOT_ID
        const int64_t block = slot / bs, off = slot % bs;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t src = (t * heads + h) * dim;
          std::copy_n(kp + src, dim, kc + block * k_cache.stride(0) + off * k_cache.stride(1) +
                                         h * k_cache.stride(2));
          std::copy_n(vp + src, dim, vc + block * v_cache.stride(0) + off * v_cache.stride(1) +
                                         h * v_cache.stride(2));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache); }

}  // namespace vllm_mamba
