// Multi-head Latent Attention (MLA) on the CPU over a paged latent cache
// `(num_blocks, block_size, latent_dim)`: the cache write and the absorbed decode and
// varlen prefill attention, as the references in `vllm_mamba/ops/mla_attention.py`.
//
// Every head reads the same latent rows (MQA with one key/value head of dim L whose value is
// the first v_dim columns), so a task holds several heads (and, in prefill, a tile of tokens)
// as rows that share each loaded block: a block of latents is widened to float32 once per task
// and read by all its rows. Each row keeps an online softmax (running max, sum and unnormalised
// output), so memory is O(block) whatever the context. Dot products over L and the value
// updates over v_dim are vectorised with `vec.h`; math is float32 for float32, bfloat16 and
// float16 caches and queries. Tasks are rows x head chunks (decode) or token tiles x head chunks
// (prefill), the chunks sized so that every thread has work, dealt round-robin.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_math.h"
#include "paged_kv.h"
#include "vec.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kTileTokens = 8;  // prefill tokens per task (times its heads)
constexpr int64_t kMinParallelWork = 1 << 19;  // multiply-adds per thread, at least
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One layer's latent cache: row (block, offset) at base + block * block_stride +
// offset * token_stride, `dim` contiguous values.
template <typename C>
struct LatentView {
  const C* base;
  int64_t block_stride, token_stride, block_size, dim;
  const C* row(int64_t block, int64_t off) const {
    return base + block * block_stride + off * token_stride;
  }
};

template <typename C>
LatentView<C> latent_view(const at::Tensor& cache) {
  return {cache.data_ptr<C>(), cache.stride(0), cache.stride(1), cache.size(1), cache.size(2)};
}

// `a . b` over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  vec::Vf s0 = vec::zero(), s1 = vec::zero();
  int64_t i = 0;
  for (; i + 2 * vec::kLanes <= n; i += 2 * vec::kLanes) {
    s0 = vec::fma(vec::load(a + i), vec::load(b + i), s0);
    s1 = vec::fma(vec::load(a + i + vec::kLanes), vec::load(b + i + vec::kLanes), s1);
  }
  for (; i + vec::kLanes <= n; i += vec::kLanes) {
    s0 = vec::fma(vec::load(a + i), vec::load(b + i), s0);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    s1 = vec::fma(vec::load_n(a + i, rest), vec::load_n(b + i, rest), s1);
  }
  return vec::sum(vec::add(s0, s1));
}

// y = alpha * y + p * x over n floats (alpha = 1: a plain axpy).
inline void scale_axpy(float alpha, float p, const float* x, float* y, int64_t n) {
  const vec::Vf va = vec::set1(alpha), vp = vec::set1(p);
  int64_t i = 0;
  for (; i + vec::kLanes <= n; i += vec::kLanes) {
    vec::store(y + i, vec::fma(vp, vec::load(x + i), vec::mul(va, vec::load(y + i))));
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    const vec::Vf yv = vec::mul(va, vec::load_n(y + i, rest));
    vec::store_n(y + i, vec::fma(vp, vec::load_n(x + i, rest), yv), rest);
  }
}

// Widens n values of a cache row to float32.
template <typename C>
inline void widen(const C* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<C, at::BFloat16>) {
    const auto* p = reinterpret_cast<const vec::bf16_t*>(src);
    for (; i + vec::kLanes <= n; i += vec::kLanes) vec::store(dst + i, vec::load(p + i));
  } else if constexpr (std::is_same_v<C, at::Half>) {
    const auto* p = reinterpret_cast<const uint16_t*>(src);
    for (; i + vec::kLanes <= n; i += vec::kLanes) vec::store(dst + i, vec::load_f16(p + i));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Per-thread scratch: `rows` query rows of dim L, their softmax states, a block of widened
// latents and its scores.
struct Scratch {
  std::vector<float> q, m, l, acc, kbuf, scores;
  std::vector<int64_t> limits;
  std::vector<const float*> ptrs;
  Scratch(int64_t rows, int64_t dim, int64_t v_dim, int64_t bs)
      : q(rows * dim), m(rows), l(rows), acc(rows * v_dim), kbuf(bs * dim), scores(bs),
        limits(rows), ptrs(bs) {}
  void reset(int64_t rows, int64_t v_dim) {
    std::fill_n(m.data(), rows, kNegInf);
    std::fill_n(l.data(), rows, 0.0f);
    std::fill_n(acc.data(), rows * v_dim, 0.0f);
  }
};

// Attends `rows` pre-scaled queries `sc.q (rows, L)` over positions [begin, end) of one
// sequence, row r up to position `sc.limits[r]` (inclusive), updating its softmax state.
template <typename C>
void attend(const LatentView<C>& lv, const int64_t* table, int64_t rows, int64_t v_dim,
            int64_t begin, int64_t end, Scratch& sc) {
  const int64_t bs = lv.block_size, dim = lv.dim;
  float* s = sc.scores.data();
  for (int64_t start = begin; start < end;) {
    const int64_t block = table[start / bs], off0 = start % bs;
    const int64_t n = std::min(bs - off0, end - start);
    for (int64_t t = 0; t < n; ++t) {
      const C* src = lv.row(block, off0 + t);
      if constexpr (std::is_same_v<C, float>) {
        sc.ptrs[t] = src;
      } else {
        widen(src, sc.kbuf.data() + t * dim, dim);
        sc.ptrs[t] = sc.kbuf.data() + t * dim;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t valid = std::min(n, sc.limits[r] - start + 1);  // causal cut of this row
      if (valid <= 0) continue;
      const float* q = sc.q.data() + r * dim;
      float block_max = kNegInf;
      for (int64_t t = 0; t < valid; ++t) {
        s[t] = dot(q, sc.ptrs[t], dim);
        block_max = std::max(block_max, s[t]);
      }
      const float m_new = std::max(sc.m[r], block_max);
      const float alpha = std::exp(sc.m[r] - m_new);  // 0 on the first block (m = -inf)
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < valid; ++t) {
        s[t] = exp_f32(s[t] - m_new);
        sum += s[t];
      }
      float* acc = sc.acc.data() + r * v_dim;
      scale_axpy(alpha, s[0], sc.ptrs[0], acc, v_dim);
      for (int64_t t = 1; t < valid; ++t) scale_axpy(1.0f, s[t], sc.ptrs[t], acc, v_dim);
      sc.l[r] = sc.l[r] * alpha + sum;
      sc.m[r] = m_new;
    }
    start += n;
  }
}

// Loads `heads` query heads of one token (head stride `dim`) as float32 times `scale`.
template <typename Q>
void load_query(const Q* q, int64_t heads, int64_t dim, float scale, float* dst) {
  for (int64_t i = 0; i < heads * dim; ++i) dst[i] = static_cast<float>(q[i]) * scale;
}

// Writes `heads` finished rows `acc / l` (zeros where l == 0) to `out` (head stride v_dim).
template <typename Q>
void store_rows(const float* acc, const float* l, int64_t heads, int64_t v_dim, Q* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    for (int64_t d = 0; d < v_dim; ++d) {
      out[h * v_dim + d] = static_cast<Q>(acc[h * v_dim + d] * inv);
    }
  }
}

// Runs `task(i, scratch)` for i in [0, n), task i on worker i mod workers, each worker with its
// own scratch; `work` (multiply-adds) below kMinParallelWork per worker runs on fewer threads.
template <typename Fn>
void round_robin(int64_t n, int64_t work, int64_t rows, int64_t dim, int64_t v_dim, int64_t bs,
                 Fn&& task) {
  const int64_t by_work = std::max<int64_t>(1, work / kMinParallelWork);
  const int64_t workers = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), n, by_work}));
  at::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
    Scratch sc(rows, dim, v_dim, bs);
    for (int64_t w = lo; w < hi; ++w) {
      for (int64_t i = w; i < n; i += workers) task(i, sc);
    }
  });
}

// Heads per task so that `units` (rows or token tiles) x chunks give every thread work.
int64_t heads_per_task(int64_t units, int64_t heads) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::clamp<int64_t>((threads + std::max<int64_t>(units, 1) - 1) /
                                                 std::max<int64_t>(units, 1),
                                             1, heads);
  return (heads + chunks - 1) / chunks;
}

void check_inputs(const at::Tensor& query, const at::Tensor& cache, int64_t v_dim) {
  TORCH_CHECK(query.dim() == 3, "query must be (tokens, Hq, L)");
  TORCH_CHECK(cache.dim() == 3, "cache must be (num_blocks, block_size, latent_dim)");
  TORCH_CHECK(cache.size(2) == query.size(2), "cache latent_dim ", cache.size(2), " != query ",
              query.size(2));
  TORCH_CHECK(cache.stride(2) == 1, "cache latent_dim not contiguous");
  TORCH_CHECK(v_dim > 0 && v_dim <= cache.size(2), "v_dim must be in (0, latent_dim]");
}

at::Tensor contiguous_heads(const at::Tensor& q) {
  return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
}

void mla_cache_write(const at::Tensor& latent, at::Tensor& cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(latent.dim() == 2, "latent must be (T, L)");
  TORCH_CHECK(cache.dim() == 3 && cache.size(2) == latent.size(1) && cache.stride(2) == 1,
              "cache must be (num_blocks, block_size, L) with L contiguous");
  const int64_t tokens = latent.size(0), dim = latent.size(1);
  TORCH_CHECK(slot_mapping.numel() == tokens, "slot_mapping must be (T,)");
  const at::Tensor src = latent.to(cache.scalar_type()).contiguous();
  const at::Tensor slots = as_index(slot_mapping);
  const int64_t bs = cache.size(1), capacity = cache.size(0) * bs;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] < capacity, "slot ", sp[t], " beyond the cache of ", capacity, " slots");
  }
  dispatch_kv(cache, "cache", [&](auto* tp) {
    using C = std::remove_pointer_t<decltype(tp)>;
    const C* lp = src.data_ptr<C>();
    C* cp = cache.data_ptr<C>();
    at::parallel_for(0, tokens, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t slot = sp[t];
        if (slot < 0) continue;  // PAD_SLOT_ID
        std::copy_n(lp + t * dim, dim,
                    cp + (slot / bs) * cache.stride(0) + (slot % bs) * cache.stride(1));
      }
    });
  });
}

template <typename Q, typename C>
void decode_impl(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables,
                 const int64_t* lens, float scale, int64_t v_dim, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t hc = heads_per_task(batch, heads), chunks = (heads + hc - 1) / hc;
  const LatentView<C> lv = latent_view<C>(cache);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const Q* qp = query.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += lens[b];
  work *= heads * (dim + v_dim);
  round_robin(batch * chunks, work, hc, dim, v_dim, lv.block_size, [&](int64_t i, Scratch& sc) {
    const int64_t b = i / chunks, h0 = (i % chunks) * hc, nh = std::min(hc, heads - h0);
    const int64_t len = lens[b];
    Q* o = op + (b * heads + h0) * v_dim;
    if (len <= 0) {  // padding row
      std::fill_n(o, nh * v_dim, static_cast<Q>(0.0f));
      return;
    }
    load_query(qp + b * query.stride(0) + h0 * dim, nh, dim, scale, sc.q.data());
    std::fill_n(sc.limits.data(), nh, len - 1);
    sc.reset(nh, v_dim);
    attend(lv, tp + b * tables.stride(0), nh, v_dim, 0, len, sc);
    store_rows(sc.acc.data(), sc.l.data(), nh, v_dim, o);
  });
}

at::Tensor mla_decode_attention(const at::Tensor& query_in, const at::Tensor& cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                double scale, int64_t v_dim) {
  check_inputs(query_in, cache, v_dim);
  const int64_t batch = query_in.size(0);
  TORCH_CHECK(seq_lens.numel() == batch && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch,
              "block_tables must be (B, max_blocks) and seq_lens (B,)");
  const at::Tensor query = contiguous_heads(query_in);
  const at::Tensor tables = as_index(block_tables);
  const at::Tensor lens = as_index(seq_lens);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    check_row(tables.data_ptr<int64_t>() + b * tables.size(1), tables.size(1), lp[b],
              cache.size(1), cache.size(0));
  }
  at::Tensor out = at::empty({batch, query.size(1), v_dim}, query.options());
  dispatch_kv(query, "query", [&](auto* qt) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    dispatch_kv(cache, "cache", [&](auto* ct) {
      using C = std::remove_pointer_t<decltype(ct)>;
      decode_impl<Q, C>(query, cache, tables, lp, static_cast<float>(scale), v_dim, out);
    });
  });
  return out;
}

template <typename Q, typename C>
void prefill_impl(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables,
                  const int64_t* qsl, const int64_t* lens, float scale, int64_t v_dim,
                  at::Tensor& out) {
  const int64_t seqs = tables.size(0), heads = query.size(1), dim = query.size(2);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first query of the tile)
  int64_t work = 0;  // query-latent pairs, about
  for (int64_t p = 0; p < seqs; ++p) {
    const int64_t q_len = qsl[p + 1] - qsl[p];
    for (int64_t j = 0; j < q_len; j += kTileTokens) tiles.emplace_back(p, j);
    work += q_len * (lens[p] - q_len / 2);
  }
  work *= heads * (dim + v_dim);
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t hc = heads_per_task(n_tiles, heads), chunks = (heads + hc - 1) / hc;
  const LatentView<C> lv = latent_view<C>(cache);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const Q* qp = query.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  round_robin(n_tiles * chunks, work, kTileTokens * hc, dim, v_dim, lv.block_size,
              [&](int64_t i, Scratch& sc) {
                const auto [p, j0] = tiles[i / chunks];
                const int64_t h0 = (i % chunks) * hc, nh = std::min(hc, heads - h0);
                const int64_t q_len = qsl[p + 1] - qsl[p], len = lens[p];
                const int64_t n_tok = std::min(kTileTokens, q_len - j0), rows = n_tok * nh;
                const int64_t first = qsl[p] + j0;  // flat index of the tile's first query
                for (int64_t t = 0; t < n_tok; ++t) {  // rows ordered (token, head)
                  load_query(qp + (first + t) * query.stride(0) + h0 * dim, nh, dim, scale,
                             sc.q.data() + t * nh * dim);
                  std::fill_n(sc.limits.data() + t * nh, nh, len - q_len + j0 + t);
                }
                sc.reset(rows, v_dim);
                attend(lv, tp + p * tables.stride(0), rows, v_dim, 0, len - q_len + j0 + n_tok,
                       sc);
                for (int64_t t = 0; t < n_tok; ++t) {
                  store_rows(sc.acc.data() + t * nh * v_dim, sc.l.data() + t * nh, nh, v_dim,
                             op + ((first + t) * heads + h0) * v_dim);
                }
              });
}

at::Tensor mla_prefill_attention(const at::Tensor& query_in, const at::Tensor& cache,
                                 const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, int64_t v_dim) {
  check_inputs(query_in, cache, v_dim);
  const int64_t seqs = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == seqs + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) == seqs,
              "query_start_loc must be (P + 1,), seq_lens (P,), block_tables (P, max_blocks)");
  const at::Tensor query = contiguous_heads(query_in);
  const at::Tensor tables = as_index(block_tables);
  const at::Tensor qsl_t = as_index(query_start_loc);
  const at::Tensor lens_t = as_index(seq_lens);
  const int64_t* qsl = qsl_t.data_ptr<int64_t>();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] >= 0 && qsl[seqs] <= query.size(0), "query_start_loc beyond the queries");
  for (int64_t p = 0; p < seqs; ++p) {
    const int64_t q_len = qsl[p + 1] - qsl[p];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[p], "sequence ", p, ": ", q_len,
                " queries but seq_len ", lens[p]);
    check_row(tables.data_ptr<int64_t>() + p * tables.size(1), tables.size(1), lens[p],
              cache.size(1), cache.size(0));
  }
  at::Tensor out = at::zeros({query.size(0), query.size(1), v_dim}, query.options());
  dispatch_kv(query, "query", [&](auto* qt) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    dispatch_kv(cache, "cache", [&](auto* ct) {
      using C = std::remove_pointer_t<decltype(ct)>;
      prefill_impl<Q, C>(query, cache, tables, qsl, lens, static_cast<float>(scale), v_dim, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("mla_cache_write", &mla_cache_write);
  m.impl("mla_decode_attention", &mla_decode_attention);
  m.impl("mla_prefill_attention", &mla_prefill_attention);
}

}  // namespace vllm_mamba
