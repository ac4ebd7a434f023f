// Paged attention on the CPU: decode attention and varlen prefill attention over a block cache
// `(num_blocks, block_size, num_kv_heads, head_dim)`, as the references in
// `vllm_mamba/ops/paged_attention.py` (the cache write is `reshape_and_cache.cpp`).
//
// Both attention kernels run one core loop (`attend_range`): a tile of query rows that share
// one kv head (the GQA group, times a few prefill tokens) walks the sequence's blocks through
// its block table with an online softmax (running max, sum and unnormalised output per row),
// so memory is O(block) whatever the context length. Per block the scores of all the tile's
// rows and the value update are small register-blocked matmuls (`run_scores`, `run_values`),
// with each row's arithmetic independent of the rows beside it (decode and prefill give the
// same bits); math is float32 for float32, bfloat16 and float16 inputs.
// Decode splits long contexts into ranges (flash-decoding) when sequences x kv heads are too
// few to keep every thread busy, and merges the partial softmax states afterwards. Tasks are
// dealt to the threads round-robin, which balances the growing cost of causal prefill tiles.
// Optional score terms (Inkling's relative-position attention): `rel (T, Hq, E)` adds
// `rel[t, h, p - j]` to a query's score for the key at j while `p - j < E`, and `sinks (T, Hq)`
// adds one zero-valued logit per query and head to the softmax's denominator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernel_math.h"
#include "paged_kv.h"
#include "small_gemm.h"

namespace vllm_mamba {
namespace {

constexpr int64_t kPrefillTile = 16;       // prefill tokens per task (times the GQA group)
constexpr int64_t kMinSplitTokens = 256;   // context tokens per decode split, at least
constexpr int64_t kMinParallelWork = 1 << 19;  // multiply-adds per thread (~40 us), at least
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Running softmax state of `rows` query rows: max, sum, unnormalised output `(rows, D)`.
struct SoftmaxState {
  float* m;
  float* l;
  float* acc;
};

// The float32 key (or value) rows of `n` tokens from offset `off0` of `block` as a matrix
// (first row, leading dim): the cache itself for float32, else converted into `buf (n, D)`.
struct Rows {
  const float* p;
  int64_t ld;
};

template <typename C>
Rows load_rows(const HeadView<C>& hv, int64_t block, int64_t off0, int64_t n, int64_t dim,
               float* buf) {
  const C* src = hv.base + block * hv.block_stride + off0 * hv.token_stride;
  if constexpr (std::is_same_v<C, float>) {
    return {src, hv.token_stride};
  } else {
    for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) buf[t * dim + d] = to_f32(src[t * hv.token_stride + d]);
    }
    return {buf, dim};
  }
}

// Score bias by backward distance of one query row: `rel (E,)` (nullptr: none) and the
// distance `dist0` from the row's query to the first key of the current run.
struct RowBias {
  const float* rel;
  int64_t extent;
  int64_t dist0;
};

// The block-run kernels: `rows` query rows (sharing one kv head) against the n keys of a run
// of one cache block, as small register-blocked matmuls. Each row's arithmetic is the same
// whichever rows are computed beside it, so decode (one token's GQA group) and prefill (a tile
// of tokens) give the same bits for a query at the same position:
// - score s_rt = sum_d q_rd k_td, d in order (one FMA chain a score), 16 keys a vector from the
//   keys transposed (`kt (D, kKeys)`);
// - per row over its keys [skip, valid): the bias, the block max, m' = max(m, block max),
//   alpha = exp(m - m'), p_t = exp(s_t - m') (0 outside the row's keys), the sum of p in key
//   order, l' = l alpha + sum;
// - acc' = (acc alpha) + p_t v_t, keys in order (one FMA each; keys outside the row's range
//   add p = 0).
constexpr int64_t kKeys = 16;  // keys per score tile (vector lanes)
#if defined(__AVX512F__)
constexpr int kTileRows = 12;  // rows per tile: 12 accumulator vectors of 16 lanes
constexpr int64_t kValueLanes = 32;
#else
constexpr int kTileRows = 6;  // 12 AVX2 vectors of 8 lanes
constexpr int64_t kValueLanes = 16;
#endif

// kt (D, kKeys) = keys [0, nk) (nk <= kKeys) transposed, zero past nk. On AVX-512 16 x 16
// blocks and on AVX2 8 x 8 blocks are transposed in registers (element by element the
// transposition was a third of a decode step's attention over 4096 positions).
#if defined(__AVX512F__)
// The element of the 16 (the row of kt) each register holds after the shuffle stages below.
constexpr int kTransposedOrder[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
#endif

inline void transpose_keys(Rows keys, int64_t nk, int64_t dim, float* kt) {
  int64_t d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + 16 <= dim; d0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) {
      r[j] = j < nk ? _mm512_loadu_ps(keys.p + j * keys.ld + d0) : _mm512_setzero_ps();
    }
    __m512 t[16];
    for (int j = 0; j < 16; j += 2) {  // 2 x 2 blocks of single floats
      t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {  // 4 x 4 blocks (pairs of floats)
      for (int i = 0; i < 2; ++i) {
        const __m512d a = _mm512_castps_pd(t[j + i]), b = _mm512_castps_pd(t[j + i + 2]);
        r[j + i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[j + i + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      }
    }
    for (int j = 0; j < 16; j += 8) {  // 128-bit lanes: rows j..j+3 with j+4..j+7
      for (int i = 0; i < 4; ++i) {
        t[j + i] = _mm512_shuffle_f32x4(r[j + i], r[j + i + 4], 0x88);
        t[j + i + 4] = _mm512_shuffle_f32x4(r[j + i], r[j + i + 4], 0xDD);
      }
    }
    for (int i = 0; i < 8; ++i) {  // then rows 0..7 with 8..15
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    // r[i] now holds element d0 + c(i) of the 16 keys, c = the order the stages leave.
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d0 + kTransposedOrder[i]) * kKeys, r[i]);
  }
#elif defined(__AVX2__)
  for (; d0 + 8 <= dim; d0 += 8) {
    for (int h = 0; h < 2; ++h) {  // keys 8 h .. 8 h + 7
      __m256 r[8], t[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t key = 8 * h + j;
        r[j] = key < nk ? _mm256_loadu_ps(keys.p + key * keys.ld + d0) : _mm256_setzero_ps();
      }
      for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int j = 0; j < 8; j += 4) {
        r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
        r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
        r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {  // r[i] holds elements i and i + 4 of keys 0-3 and 4-7
        _mm256_storeu_ps(kt + (d0 + i) * kKeys + 8 * h,
                         _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d0 + i + 4) * kKeys + 8 * h,
                         _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
  }
#endif
  for (; d0 < dim; ++d0) {
    for (int64_t j = 0; j < nk; ++j) kt[d0 * kKeys + j] = keys.p[j * keys.ld + d0];
    for (int64_t j = nk; j < kKeys; ++j) kt[d0 * kKeys + j] = 0.0f;
  }
}

// Scores of all rows against keys [0, n) of a run: s (rows, lds), lds a multiple of kKeys;
// `kt (D, kKeys)` scratch.
void run_scores(const float* q, int64_t rows, int64_t dim, Rows keys, int64_t n, float* kt,
                float* s, int64_t lds) {
  for (int64_t k0 = 0; k0 < n; k0 += kKeys) {
    transpose_keys({keys.p + k0 * keys.ld, keys.ld}, std::min(kKeys, n - k0), dim, kt);
    small_gemm::rows_tile<kTileRows, kKeys>(rows, dim, kKeys, q, dim, kt, kKeys, s + k0, lds,
                                            {});
  }
}

// The values' part of a run for all rows: acc (rows, D) = alpha acc + p (rows, ldp) @ values.
void run_values(const float* p, int64_t ldp, const float* alpha, Rows values, int64_t n,
                int64_t rows, int64_t dim, float* acc) {
  const small_gemm::Scale scale{0.0f, alpha};
  int64_t d0 = 0;
  for (; d0 + kValueLanes <= dim; d0 += kValueLanes) {
    small_gemm::rows_tile<kTileRows, kValueLanes>(rows, n, kValueLanes, p, ldp, values.p + d0,
                                                  values.ld, acc + d0, dim, scale);
  }
  for (; d0 < dim; d0 += 16) {
    small_gemm::rows_tile<kTileRows, 16>(rows, n, std::min<int64_t>(16, dim - d0), p, ldp,
                                         values.p + d0, values.ld, acc + d0, dim, scale);
  }
}

// One row's softmax step over its keys [skip, valid) of the run's scores `s (n,)`: turns s
// into the weights p (0 outside the range), updates m and l, and returns alpha. Key skip + t
// gains `bias.rel[bias.dist0 - t]` while that distance is below the extent.
inline float softmax_row(float* s, int64_t n, int64_t skip, int64_t valid, RowBias bias,
                         float& m, float& l) {
  if (valid <= skip) {  // no key of this row in the run: its state stays as it is
    std::fill(s, s + n, 0.0f);
    return 1.0f;
  }
  float* sr = s + skip;
  const int64_t cnt = valid - skip;
  if (bias.rel != nullptr) {
    const int64_t first = std::max<int64_t>(bias.dist0 - bias.extent + 1, 0);
    for (int64_t t = first; t < cnt; ++t) sr[t] += bias.rel[bias.dist0 - t];
  }
  float block_max = kNegInf;
  for (int64_t t = 0; t < cnt; ++t) block_max = std::max(block_max, sr[t]);
  const float m_new = std::max(m, block_max);
  const float alpha = std::exp(m - m_new);  // 0 on the first block (m = -inf)
#pragma omp simd
  for (int64_t t = 0; t < cnt; ++t) sr[t] = exp_f32(sr[t] - m_new);
  float sum = 0.0f;
  for (int64_t t = 0; t < cnt; ++t) sum += sr[t];  // in key order
  std::fill(s, sr, 0.0f);
  std::fill(s + valid, s + n, 0.0f);
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// Scratch of `attend_range` (block_size keys a run, `rows` query rows).
struct RunScratch {
  float* kbuf;            // (block_size, D): a run's keys as float32 (non-float32 caches)
  float* vbuf;            // (block_size, D): its values
  float* kt;              // (D, kKeys): 16 keys transposed
  float* scores;          // (rows, block_size rounded up to kKeys): scores, then weights
  float* alpha;   // (rows,)
};

// Attends `rows` pre-scaled query rows `q (rows, D)` over positions [begin, end) of one
// sequence, row r only over positions [lows[r], limits[r]] (its sliding window's first
// position, else 0, up to its own), updating `st` in place. `rels` (nullptr: no bias) holds
// each row's `rel (extent,)` bias by distance from its own position `limits[r]`.
template <typename C>
void attend_range(const float* q, const int64_t* lows, const int64_t* limits,
                  const float* const* rels, int64_t extent, int64_t rows, int64_t dim,
                  const HeadView<C>& kv, const HeadView<C>& vv, const int64_t* block_table,
                  int64_t begin, int64_t end, SoftmaxState st, RunScratch sc) {
  const int64_t bs = kv.block_size;
  const int64_t lds = (bs + kKeys - 1) / kKeys * kKeys;
  for (int64_t start = begin; start < end;) {
    const int64_t block = block_table[start / bs];
    const int64_t off0 = start % bs;
    const int64_t n = std::min(bs - off0, end - start);
    const Rows keys = load_rows(kv, block, off0, n, dim, sc.kbuf);
    const Rows values = load_rows(vv, block, off0, n, dim, sc.vbuf);
    run_scores(q, rows, dim, keys, n, sc.kt, sc.scores, lds);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t skip = std::min(n, std::max<int64_t>(lows[r] - start, 0));  // pre-window
      const int64_t valid = std::max<int64_t>(0, std::min(n, limits[r] - start + 1));  // causal
      const RowBias bias{rels == nullptr ? nullptr : rels[r], extent,
                         limits[r] - (start + skip)};
      sc.alpha[r] = softmax_row(sc.scores + r * lds, n, skip, valid, bias, st.m[r], st.l[r]);
    }
    run_values(sc.scores, lds, sc.alpha, values, n, rows, dim, st.acc);
    start += n;
  }
}

// Resets `rows` softmax states.
void reset_state(SoftmaxState st, int64_t rows, int64_t dim) {
  std::fill(st.m, st.m + rows, kNegInf);
  std::fill(st.l, st.l + rows, 0.0f);
  std::fill(st.acc, st.acc + rows * dim, 0.0f);
}

// Loads `count` query heads starting at `q` (head stride `dim`) as float32, times `scale`.
template <typename Q>
void load_query(const Q* q, int64_t count, int64_t dim, float scale, float* dst) {
#pragma omp simd
  for (int64_t i = 0; i < count * dim; ++i) dst[i] = to_f32(q[i]) * scale;
}

// The factor a finished row's `acc` is multiplied by: `1 / l` (0 where l == 0), or with a
// sink logit, `w / (l w + exp(sink - m'))` with `m' = max(m, sink)` and `w = exp(m - m')`.
inline float finish_factor(float m, float l, const float* sink) {
  if (sink == nullptr) return l > 0.0f ? 1.0f / l : 0.0f;
  const float top = std::max(m, *sink);
  const float w = l > 0.0f ? std::exp(m - top) : 0.0f;
  return w / (l * w + std::exp(*sink - top));
}

// Writes finished softmax states, rows ordered (token, group head), as `acc / l` (zeros where
// l == 0; `sinks (rows,)` or nullptr, see `finish_factor`) to `out`, whose tokens are
// `token_stride` apart and group heads `dim` apart.
template <typename Q>
void store_tile(const float* acc, const float* m, const float* l, const float* sinks,
                int64_t tokens, int64_t group, int64_t dim, Q* out, int64_t token_stride) {
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float inv = finish_factor(m[r], l[r], sinks == nullptr ? nullptr : sinks + r);
      Q* o = out + i * token_stride + g * dim;
      const float* a = acc + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<Q>(a[d] * inv);
    }
  }
}

// Per-thread scratch of the attention kernels.
struct Scratch {
  std::vector<float> q, m, l, acc, kbuf, vbuf, kt, scores, alpha, sinks;
  std::vector<int64_t> lows, limits;
  std::vector<const float*> rels;
  Scratch(int64_t rows, int64_t dim, int64_t bs)
      : q(rows * dim), m(rows), l(rows), acc(rows * dim), kbuf(bs * dim), vbuf(bs * dim),
        kt(dim * kKeys), scores(rows * ((bs + kKeys - 1) / kKeys * kKeys)), alpha(rows),
        sinks(rows), lows(rows), limits(rows), rels(rows) {}
  SoftmaxState state() { return {m.data(), l.data(), acc.data()}; }
  RunScratch run() {
    return {kbuf.data(), vbuf.data(), kt.data(), scores.data(), alpha.data()};
  }
};

// Runs `task(i, scratch)` for i in [0, n), task i on worker i mod workers, each worker with
// its own scratch for `rows` query rows. `work` (multiply-adds) below kMinParallelWork per
// worker runs on fewer threads: waking a thread costs more than a few microseconds of work.
template <typename Fn>
void round_robin(int64_t n, int64_t work, int64_t rows, int64_t dim, int64_t bs, Fn&& task) {
  const int64_t by_work = std::max<int64_t>(1, work / kMinParallelWork);
  const int64_t workers = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), n, by_work}));
  at::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
    Scratch sc(rows, dim, bs);
    for (int64_t w = lo; w < hi; ++w) {
      for (int64_t i = w; i < n; i += workers) task(i, sc);
    }
  });
}

// Shapes and strides shared by the attention kernels.
struct AttnShape {
  int64_t q_heads, kv_heads, group, dim, block_size;
  float scale;
  int64_t window;  // sliding window in tokens, 0 for none
};

// The optional score terms as float32 `(T, Hq, E)` and `(T, Hq)`; null pointers when absent.
struct ScoreTerms {
  at::Tensor rel_t, sinks_t;
  const float* rel = nullptr;
  const float* sinks = nullptr;
  int64_t extent = 0;
  // Row of query token t, head h: its bias by distance, or nullptr.
  const float* rel_row(int64_t t, int64_t h, int64_t q_heads) const {
    return rel == nullptr ? nullptr : rel + (t * q_heads + h) * extent;
  }
};

ScoreTerms score_terms(const c10::optional<at::Tensor>& rel,
                       const c10::optional<at::Tensor>& sinks, int64_t tokens,
                       int64_t q_heads) {
  ScoreTerms st;
  if (rel.has_value()) {
    TORCH_CHECK(rel->dim() == 3 && rel->size(0) == tokens && rel->size(1) == q_heads &&
                    rel->size(2) > 0,
                "rel must be (tokens, Hq, E) with E > 0, got ", rel->sizes());
    st.rel_t = rel->to(at::kFloat).contiguous();
    st.rel = st.rel_t.data_ptr<float>();
    st.extent = rel->size(2);
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 2 && sinks->size(0) == tokens && sinks->size(1) == q_heads,
                "sinks must be (tokens, Hq), got ", sinks->sizes());
    st.sinks_t = sinks->to(at::kFloat).contiguous();
    st.sinks = st.sinks_t.data_ptr<float>();
  }
  return st;
}

AttnShape attn_shape(const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "sliding_window must be >= 0, got ", window);
  TORCH_CHECK(query.dim() == 3, "query must be (tokens, Hq, D)");
  check_cache(k_cache, v_cache, query.size(2));
  const int64_t hq = query.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads ", hq, " not a multiple of kv heads ", hkv);
  return {hq, hkv, hq / hkv, query.size(2), k_cache.size(1), static_cast<float>(scale),
          window};
}

// Decode splits per sequence: enough tasks for every thread, at least kMinSplitTokens each.
int64_t decode_splits(int64_t batch, int64_t kv_heads, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  const int64_t tasks = std::max<int64_t>(1, batch * kv_heads);
  const int64_t wanted = (2 * threads + tasks - 1) / tasks;
  const int64_t most = std::max<int64_t>(1, max_len / kMinSplitTokens);
  return std::max<int64_t>(1, std::min(wanted, most));
}

// Merges the split states of one (row, kv head) `(splits, G)` into the output heads; `sinks
// (G,)` or nullptr.
template <typename Q>
void merge_splits(const float* m, const float* l, const float* acc, const float* sinks,
                  int64_t splits, int64_t group, int64_t dim, Q* out) {
  std::vector<float> total(dim);
  for (int64_t g = 0; g < group; ++g) {
    float m_max = kNegInf;
    for (int64_t s = 0; s < splits; ++s) m_max = std::max(m_max, m[s * group + g]);
    float l_sum = 0.0f;
    std::fill(total.begin(), total.end(), 0.0f);
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t r = s * group + g;
      if (l[r] <= 0.0f) continue;
      const float w = std::exp(m[r] - m_max);
      l_sum += l[r] * w;
      const float* a = acc + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) total[d] += w * a[d];
    }
    store_tile(total.data(), &m_max, &l_sum, sinks == nullptr ? nullptr : sinks + g, 1, 1, dim,
               out + g * dim, 0);
  }
}

template <typename Q, typename C>
void decode_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const int64_t* lens, const AttnShape& a,
                 const ScoreTerms& terms, at::Tensor& out) {
  const int64_t batch = query.size(0), hkv = a.kv_heads, g = a.group, dim = a.dim;
  int64_t max_span = 0;  // positions one row reads, at most
  for (int64_t b = 0; b < batch; ++b) {
    max_span = std::max(max_span, lens[b] - window_start(lens[b] - 1, a.window));
  }
  const int64_t splits = decode_splits(batch, hkv, max_span);
  // Partial states (B, Hkv, splits, G [, D]); splits without positions keep l = 0.
  std::vector<float> pm(batch * hkv * splits * g), pl(pm.size()), pacc(pm.size() * dim);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const Q* qp = query.data_ptr<Q>();
  const int64_t work = batch * max_span * a.q_heads * dim * 2;
  round_robin(batch * hkv * splits, work, g, dim, a.block_size, [&](int64_t i, Scratch& sc) {
    const int64_t b = i / (hkv * splits), h = (i / splits) % hkv, s = i % splits;
    SoftmaxState st{pm.data() + i * g, pl.data() + i * g, pacc.data() + i * g * dim};
    reset_state(st, g, dim);
    const int64_t len = lens[b];
    if (len <= 0) return;
    const int64_t first = window_start(len - 1, a.window);
    const int64_t chunk = ((len - first + splits - 1) / splits + a.block_size - 1) /
                          a.block_size * a.block_size;  // whole blocks per split
    const int64_t begin = first + s * chunk, end = std::min(len, begin + chunk);
    if (begin >= end) return;
    load_query(qp + b * query.stride(0) + h * g * dim, g, dim, a.scale, sc.q.data());
    std::fill(sc.lows.begin(), sc.lows.end(), first);
    std::fill(sc.limits.begin(), sc.limits.end(), len - 1);
    for (int64_t r = 0; r < g; ++r) sc.rels[r] = terms.rel_row(b, h * g + r, a.q_heads);
    attend_range(sc.q.data(), sc.lows.data(), sc.limits.data(),
                 terms.rel == nullptr ? nullptr : sc.rels.data(), terms.extent, g, dim,
                 head_view<C>(k_cache, h),
                 head_view<C>(v_cache, h), tp + b * tables.stride(0), begin, end, st,
                 sc.run());
  });
  Q* op = out.data_ptr<Q>();
  at::parallel_for(0, batch * hkv, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / hkv, h = i % hkv;
      merge_splits(pm.data() + i * splits * g, pl.data() + i * splits * g,
                   pacc.data() + i * splits * g * dim,
                   terms.sinks == nullptr ? nullptr : terms.sinks + b * a.q_heads + h * g,
                   splits, g, dim, op + b * a.q_heads * dim + h * g * dim);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, const c10::optional<at::Tensor>& rel,
                                  const c10::optional<at::Tensor>& sinks) {
  const AttnShape a = attn_shape(query_in, k_cache, v_cache, scale, sliding_window);
  const int64_t batch = query_in.size(0);
  const ScoreTerms terms = score_terms(rel, sinks, batch, a.q_heads);
  TORCH_CHECK(seq_lens.numel() == batch && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch,
              "block_tables must be (B, max_blocks) and seq_lens (B,)");
  const at::Tensor query = query_in.stride(2) == 1 && query_in.stride(1) == a.dim
                               ? query_in
                               : query_in.contiguous();
  const at::Tensor tables = as_index(block_tables);
  const at::Tensor lens = as_index(seq_lens);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    check_row(tables.data_ptr<int64_t>() + b * tables.size(1), tables.size(1), lp[b],
              a.block_size, k_cache.size(0), window_start(lp[b] - 1, a.window));
  }
  at::Tensor out = at::empty({batch, a.q_heads, a.dim}, query.options());
  dispatch_kv(query, "query", [&](auto* qt) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    dispatch_kv(k_cache, "k_cache", [&](auto* ct) {
      using C = std::remove_pointer_t<decltype(ct)>;
      decode_impl<Q, C>(query, k_cache, v_cache, tables, lp, a, terms, out);
    });
  });
  return out;
}

template <typename Q, typename C>
void prefill_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const int64_t* qsl, const int64_t* lens,
                  const AttnShape& a, const ScoreTerms& terms, at::Tensor& out) {
  const int64_t seqs = tables.size(0), hkv = a.kv_heads, g = a.group, dim = a.dim;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first query of the tile)
  int64_t work = 0;  // query-key pairs, about
  for (int64_t p = 0; p < seqs; ++p) {
    const int64_t q_len = qsl[p + 1] - qsl[p];
    for (int64_t j = 0; j < q_len; j += kPrefillTile) tiles.emplace_back(p, j);
    const int64_t span = lens[p] - q_len / 2;
    work += q_len * (a.window > 0 ? std::min(span, a.window) : span);
  }
  work *= a.q_heads * dim * 2;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const Q* qp = query.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const int64_t q_stride = query.stride(0), o_stride = a.q_heads * dim;
  const int64_t n_tasks = static_cast<int64_t>(tiles.size()) * hkv;
  round_robin(n_tasks, work, kPrefillTile * g, dim, a.block_size, [&](int64_t i, Scratch& sc) {
    const auto [p, j0] = tiles[i / hkv];
    const int64_t h = i % hkv, q_len = qsl[p + 1] - qsl[p], len = lens[p];
    const int64_t n_tok = std::min(kPrefillTile, q_len - j0), rows = n_tok * g;
    const int64_t first = qsl[p] + j0;  // flat index of the tile's first query
    for (int64_t t = 0; t < n_tok; ++t) {
      load_query(qp + (first + t) * q_stride + h * g * dim, g, dim, a.scale,
                 sc.q.data() + t * g * dim);
      const int64_t pos = len - q_len + j0 + t;
      std::fill_n(sc.lows.data() + t * g, g, window_start(pos, a.window));
      std::fill_n(sc.limits.data() + t * g, g, pos);  // own position
      for (int64_t r = 0; r < g; ++r) {
        sc.rels[t * g + r] = terms.rel_row(first + t, h * g + r, a.q_heads);
        if (terms.sinks != nullptr) sc.sinks[t * g + r] = terms.sinks[(first + t) * a.q_heads + h * g + r];
      }
    }
    reset_state(sc.state(), rows, dim);
    attend_range(sc.q.data(), sc.lows.data(), sc.limits.data(),
                 terms.rel == nullptr ? nullptr : sc.rels.data(), terms.extent, rows, dim,
                 head_view<C>(k_cache, h), head_view<C>(v_cache, h), tp + p * tables.stride(0),
                 window_start(len - q_len + j0, a.window),
                 len - q_len + j0 + n_tok, sc.state(), sc.run());
    store_tile(sc.acc.data(), sc.m.data(), sc.l.data(),
               terms.sinks == nullptr ? nullptr : sc.sinks.data(), n_tok, g, dim,
               op + first * o_stride + h * g * dim, o_stride);
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& query_in, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                   double scale, int64_t sliding_window,
                                   const c10::optional<at::Tensor>& rel,
                                   const c10::optional<at::Tensor>& sinks) {
  const AttnShape a = attn_shape(query_in, k_cache, v_cache, scale, sliding_window);
  const int64_t seqs = seq_lens.numel();
  const ScoreTerms terms = score_terms(rel, sinks, query_in.size(0), a.q_heads);
  TORCH_CHECK(query_start_loc.numel() == seqs + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) == seqs,
              "query_start_loc must be (P + 1,), seq_lens (P,), block_tables (P, max_blocks)");
  const at::Tensor query = query_in.stride(2) == 1 && query_in.stride(1) == a.dim
                               ? query_in
                               : query_in.contiguous();
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
              a.block_size, k_cache.size(0), window_start(lens[p] - q_len, a.window));
  }
  at::Tensor out = at::zeros({query.size(0), a.q_heads, a.dim}, query.options());
  dispatch_kv(query, "query", [&](auto* qt) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    dispatch_kv(k_cache, "k_cache", [&](auto* ct) {
      using C = std::remove_pointer_t<decltype(ct)>;
      prefill_impl<Q, C>(query, k_cache, v_cache, tables, qsl, lens, a, terms, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

}  // namespace vllm_mamba
