// xLSTM's mLSTM cell on the CPU, as the references in `vllm_mamba/ops/mlstm.py`: `mlstm_varlen`
// over packed prefill chunks (each from its slot's state, or zeros) and `mlstm_update` for one
// token per row.
//
// Per (sequence or row, head) the kernel walks its tokens with the cell's recurrent form (the
// reference prefills chunkwise; both are exact reformulations of the same recurrence):
//
//   lf = logsigmoid(f), m' = max(lf + m, i), decay = exp(lf + m - m'), gain = exp(i - m')
//   C = decay C + gain k^T v,  n = decay n + gain k
//   h = (s q) C / (max(|(s q) . n|, exp(-m')) + eps),  s = Dk ** -0.5
//
// keeping C (Dk, Dv) and n (Dk,) in float32 scratch for the whole chunk (loaded from and stored
// to the slot once), vectorised over Dv. The tasks (sequence, head) are independent. q, k, v
// and the gates are float32 or bfloat16; C and n float32 or bfloat16 (math float32), m float32;
// the output takes q's dtype.
//
// Glossary: T tokens, B sequences (or rows), S slots, H heads, Dk / Dv head dims.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernel_math.h"

namespace vllm_mamba {
namespace {

// The tensors of one call, as raw pointers and strides (token-major inputs, contiguous).
template <typename T, typename S>
struct Cell {
  const T *q, *k, *v, *ig, *fg;  // (T, H, Dk), (T, H, Dk), (T, H, Dv), (T, H), (T, H)
  S *c, *n;                      // (S, H, Dk, Dv), (S, H, Dk)
  float* m;                      // (S, H)
  T* out;                        // (T, H, Dv)
  int64_t heads, dk, dv;
  float eps;
};

// Runs tokens [begin, end) of one head `h` from the state of `slot` (zeros when `fresh`), and
// stores the state back. `cs (Dk * Dv)`, `ns (Dk)`, `qs (Dk)` are float32 scratch.
template <typename T, typename S>
void run_head(const Cell<T, S>& a, int64_t slot, int64_t h, int64_t begin, int64_t end,
              bool fresh, float* cs, float* ns, float* qs) {
  const int64_t dk = a.dk, dv = a.dv, H = a.heads;
  S* c_slot = a.c + (slot * H + h) * dk * dv;
  S* n_slot = a.n + (slot * H + h) * dk;
  float m = fresh ? 0.0f : a.m[slot * H + h];
  for (int64_t i = 0; i < dk * dv; ++i) cs[i] = fresh ? 0.0f : to_f32(c_slot[i]);
  for (int64_t i = 0; i < dk; ++i) ns[i] = fresh ? 0.0f : to_f32(n_slot[i]);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = begin; t < end; ++t) {
    const float f = to_f32(a.fg[t * H + h]), in = to_f32(a.ig[t * H + h]);
    const float lf = std::min(f, 0.0f) - std::log1p(std::exp(-std::fabs(f)));  // logsigmoid
    const float m_new = std::max(lf + m, in);
    const float decay = std::exp(lf + m - m_new), gain = std::exp(in - m_new);
    const T* k = a.k + (t * H + h) * dk;
    const T* v = a.v + (t * H + h) * dv;
    const T* q = a.q + (t * H + h) * dk;
    T* out = a.out + (t * H + h) * dv;
    float den = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      const float ki = to_f32(k[i]);
      ns[i] = decay * ns[i] + gain * ki;
      qs[i] = to_f32(q[i]) * scale;
      den += qs[i] * ns[i];
      const float g = gain * ki;
      float* row = cs + i * dv;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) row[j] = decay * row[j] + g * to_f32(v[j]);
    }
    const float inv = 1.0f / (std::max(std::fabs(den), std::exp(-m_new)) + a.eps);
    for (int64_t j = 0; j < dv; ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < dk; ++i) acc += qs[i] * cs[i * dv + j];
      out[j] = static_cast<T>(acc * inv);
    }
    m = m_new;
  }
  for (int64_t i = 0; i < dk * dv; ++i) c_slot[i] = static_cast<S>(cs[i]);
  for (int64_t i = 0; i < dk; ++i) n_slot[i] = static_cast<S>(ns[i]);
  a.m[slot * H + h] = m;
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ig,
           const at::Tensor& fg, const at::Tensor& c, const at::Tensor& n, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1),
              "q, k must be (T, H, Dk) and v (T, H, Dv)");
  TORCH_CHECK(ig.dim() == 2 && ig.size(0) == q.size(0) && ig.size(1) == q.size(1) &&
                  fg.sizes() == ig.sizes(),
              "igate and fgate must be (T, H)");
  for (const at::Tensor* t : {&k, &v, &ig, &fg}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k, v and the gates differ in dtype");
  }
  TORCH_CHECK(c.dim() == 4 && c.size(1) == q.size(1) && c.size(2) == q.size(2) &&
                  c.size(3) == v.size(2) && c.is_contiguous(),
              "c_states must be contiguous (S, H, Dk, Dv)");
  TORCH_CHECK(n.dim() == 3 && n.size(0) == c.size(0) && n.size(1) == q.size(1) &&
                  n.size(2) == q.size(2) && n.is_contiguous() &&
                  n.scalar_type() == c.scalar_type(),
              "n_states must be contiguous (S, H, Dk) in c_states' dtype");
  TORCH_CHECK(m.dim() == 2 && m.size(0) == c.size(0) && m.size(1) == q.size(1) &&
                  m.is_contiguous() && m.scalar_type() == at::kFloat,
              "m_states must be contiguous float32 (S, H)");
}

// Calls `fn` with null pointers of the input and state element types.
template <typename Fn>
void dispatch(const at::Tensor& q, const at::Tensor& c, Fn&& fn) {
  dispatch_float_bf16(q, "q", [&](auto* qt) {
    dispatch_float_bf16(c, "c_states", [&](auto* ct) { fn(qt, ct); });
  });
}

template <typename T, typename S>
Cell<T, S> cell(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& ig, const at::Tensor& fg, at::Tensor& c, at::Tensor& n,
                at::Tensor& m, at::Tensor& out, double eps) {
  return {q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), ig.data_ptr<T>(),
          fg.data_ptr<T>(), c.data_ptr<S>(), n.data_ptr<S>(), m.data_ptr<float>(),
          out.data_ptr<T>(), q.size(1), q.size(2), v.size(2), static_cast<float>(eps)};
}

// Tokens [begin, end) of one sequence, from zeros when `fresh`.
struct Span {
  int64_t begin, end;
  bool fresh;
};

// Runs `tasks` (sequence or row, head) pairs: task i covers tokens `span(i / H)` of head i % H.
template <typename SpanFn>
void run_tasks(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
               const at::Tensor& ig_in, const at::Tensor& fg_in, at::Tensor& c, at::Tensor& n,
               at::Tensor& m, const int64_t* slots, int64_t rows, double eps, at::Tensor& out,
               SpanFn&& span) {
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor ig = ig_in.contiguous(), fg = fg_in.contiguous();
  check(q, k, v, ig, fg, c, n, m);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(slots[b] < c.size(0), "state index ", slots[b], " outside the state slots");
  }
  const int64_t H = q.size(1), dk = q.size(2), dv = v.size(2);
  dispatch(q, c, [&](auto* qt, auto* ct) {
    using T = std::remove_pointer_t<decltype(qt)>;
    using S = std::remove_pointer_t<decltype(ct)>;
    const Cell<T, S> a = cell<T, S>(q, k, v, ig, fg, c, n, m, out, eps);
    at::parallel_for(0, rows * H, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> cs(dk * dv), ns(dk), qs(dk);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / H;
        if (slots[b] < 0) continue;  // padding
        const auto [begin, end, fresh] = span(b);
        // an empty fresh sequence stores a zero state, as the reference does
        run_head(a, slots[b], i % H, begin, end, fresh, cs.data(), ns.data(), qs.data());
      }
    });
  });
}

at::Tensor mlstm_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& igate, const at::Tensor& fgate, at::Tensor& c_states,
                        at::Tensor& n_states, at::Tensor& m_states,
                        const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                        const at::Tensor& has_initial_state, double eps, int64_t chunk_size) {
  (void)chunk_size;  // the recurrent form needs no chunks
  const at::Tensor qsl = as_index(query_start_loc), slots = as_index(state_indices);
  const at::Tensor init = has_initial_state.to(at::kBool).contiguous();
  const int64_t seqs = slots.numel();
  TORCH_CHECK(qsl.numel() == seqs + 1 && init.numel() == seqs,
              "query_start_loc must be (B + 1,) and has_initial_state (B,)");
  const int64_t* qp = qsl.data_ptr<int64_t>();
  TORCH_CHECK(qp[0] >= 0 && qp[seqs] <= q.size(0), "query_start_loc beyond the tokens");
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(qp[b + 1] >= qp[b], "query_start_loc must not decrease");
  }
  const bool* has_init = init.data_ptr<bool>();
  at::Tensor out = at::zeros({q.size(0), q.size(1), v.size(2)}, q.options());
  run_tasks(q, k, v, igate, fgate, c_states, n_states, m_states, slots.data_ptr<int64_t>(), seqs,
            eps, out, [&](int64_t b) { return Span{qp[b], qp[b + 1], !has_init[b]}; });
  return out;
}

at::Tensor mlstm_update(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& igate, const at::Tensor& fgate, at::Tensor& c_states,
                        at::Tensor& n_states, at::Tensor& m_states,
                        const at::Tensor& state_indices, double eps) {
  const at::Tensor slots = as_index(state_indices);
  TORCH_CHECK(slots.numel() == q.size(0), "state_indices must be (B,)");
  at::Tensor out = at::zeros({q.size(0), q.size(1), v.size(2)}, q.options());
  run_tasks(q, k, v, igate, fgate, c_states, n_states, m_states, slots.data_ptr<int64_t>(),
            slots.numel(), eps, out, [](int64_t b) { return Span{b, b + 1, false}; });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def(
      "mlstm_varlen(Tensor q, Tensor k, Tensor v, Tensor igate, Tensor fgate, "
      "Tensor(a!) c_states, Tensor(b!) n_states, Tensor(c!) m_states, Tensor query_start_loc, "
      "Tensor state_indices, Tensor has_initial_state, float eps=1e-6, int chunk_size=64) "
      "-> Tensor");
  m.def(
      "mlstm_update(Tensor q, Tensor k, Tensor v, Tensor igate, Tensor fgate, "
      "Tensor(a!) c_states, Tensor(b!) n_states, Tensor(c!) m_states, Tensor state_indices, "
      "float eps=1e-6) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mamba, CPU, m) {
  m.impl("mlstm_varlen", &mlstm_varlen);
  m.impl("mlstm_update", &mlstm_update);
}

}  // namespace vllm_mamba
