// Schemas of the `torch.ops.vllm_mamba` CPU kernels, and the Python module whose import loads
// them: `vllm_mamba._C_<level>`, one build per ISA level (`setup.py`), of which
// `vllm_mamba/ops/cpu_isa.py` imports the one this CPU runs. Its `ISA` attribute names the
// level the build was compiled for. The implementations are registered next to each kernel.
// Argument names and order match the `_ref` functions in `vllm_mamba/ops`.
#include <Python.h>
#include <torch/library.h>

#include "vec.h"

TORCH_LIBRARY(vllm_mamba, m) {
  m.def(
      "causal_conv1d_varlen(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, "
      "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state, "
      "bool activation) -> Tensor");
  m.def(
      "causal_conv1d_update(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
      "Tensor state_indices, bool activation) -> Tensor");
  m.def(
      "selective_scan_varlen(Tensor u, Tensor dt, Tensor A, Tensor B_, Tensor C, Tensor? D_skip, "
      "Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor(a!) ssm_states, "
      "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state) -> Tensor");
  m.def(
      "selective_state_update(Tensor(a!) ssm_states, Tensor u, Tensor dt, Tensor A, Tensor B_, "
      "Tensor C, Tensor? D_skip, Tensor? z, Tensor? dt_bias, bool dt_softplus, "
      "Tensor state_indices) -> Tensor");
  m.def("linear_small_batch(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "grouped_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? bias, "
      "int bits, int group) -> Tensor");
  m.def(
      "ssd_chunk_scan_varlen(Tensor x, Tensor dt, Tensor A, Tensor B_, Tensor C, Tensor? D_skip, "
      "Tensor? dt_bias, bool dt_softplus, float dt_min, float dt_max, Tensor(a!) ssm_states, "
      "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state, "
      "int chunk_size) -> Tensor");
  m.def(
      "ssd_state_update(Tensor(a!) ssm_states, Tensor x, Tensor dt, Tensor A, Tensor B_, "
      "Tensor C, Tensor? D_skip, Tensor? dt_bias, bool dt_softplus, "
      "Tensor state_indices) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor z, Tensor weight, int group_size, float eps) -> Tensor");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window=0, Tensor? rel=None, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
      "int sliding_window=0, Tensor? rel=None, Tensor? sinks=None) -> Tensor");
  m.def(
      "gated_delta_varlen(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, float beta_scale, Tensor(a!) ssm_states, Tensor query_start_loc, "
      "Tensor state_indices, Tensor has_initial_state, int chunk_size=64) -> Tensor");
  m.def(
      "gated_delta_update(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, float beta_scale, Tensor(a!) ssm_states, Tensor state_indices) -> Tensor");
  m.def("rms_norm_gated(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def(
      "kda_varlen(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, Tensor(a!) ssm_states, Tensor query_start_loc, Tensor state_indices, "
      "Tensor has_initial_state, int chunk_size=12, float lower_bound=0.0) -> Tensor");
  m.def(
      "kda_update(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias, Tensor(a!) ssm_states, Tensor state_indices, "
      "float lower_bound=0.0) -> Tensor");
  m.def("kda_norm_gate(Tensor o, Tensor gate, Tensor weight, float eps) -> Tensor");
  m.def("mla_cache_write(Tensor latent, Tensor(a!) cache, Tensor slot_mapping) -> ()");
  m.def(
      "mla_decode_attention(Tensor query, Tensor cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int v_dim) -> Tensor");
  m.def(
      "mla_prefill_attention(Tensor query, Tensor cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int v_dim) -> Tensor");
  m.def(
      "short_conv_update(Tensor bcx, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
      "Tensor state_indices) -> Tensor");
  m.def(
      "short_conv_varlen(Tensor bcx, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
      "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state) -> Tensor");
  m.def(
      "rwkv7_varlen(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "Tensor(a!) states, Tensor query_start_loc, Tensor state_indices, "
      "Tensor has_initial_state) -> Tensor");
  m.def(
      "rwkv7_update(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, "
      "Tensor(a!) states, Tensor state_indices) -> Tensor");
  m.def(
      "rwkv4_varlen(Tensor w, Tensor u, Tensor k, Tensor v, Tensor(a!) num_states, "
      "Tensor(b!) den_states, Tensor(c!) max_states, Tensor query_start_loc, "
      "Tensor state_indices, Tensor has_initial_state) -> Tensor");
  m.def(
      "rwkv4_update(Tensor w, Tensor u, Tensor k, Tensor v, Tensor(a!) num_states, "
      "Tensor(b!) den_states, Tensor(c!) max_states, Tensor state_indices) -> Tensor");
  m.def(
      "rwkv7_shift_mix(Tensor x, Tensor(a!) shift, Tensor state_indices, Tensor mixes, "
      "Tensor? src_state_indices=None) -> Tensor");
  m.def(
      "rwkv7_fused_update(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor g, "
      "Tensor? v_first, Tensor? v_gate, Tensor k_k, Tensor k_a, Tensor r_k, Tensor gn_weight, "
      "Tensor gn_bias, float gn_eps, Tensor(a!) states, Tensor state_indices, "
      "Tensor? src_state_indices=None) -> Tensor");
}

#define VLLM_MAMBA_CONCAT_(a, b) a##b
#define VLLM_MAMBA_CONCAT(a, b) VLLM_MAMBA_CONCAT_(a, b)
#define VLLM_MAMBA_STR_(x) #x
#define VLLM_MAMBA_STR(x) VLLM_MAMBA_STR_(x)

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, VLLM_MAMBA_STR(TORCH_EXTENSION_NAME), nullptr,
                              -1, nullptr};

PyMODINIT_FUNC VLLM_MAMBA_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* module = PyModule_Create(&kModule);
  if (module != nullptr && PyModule_AddStringConstant(module, "ISA", vllm_mamba::vec::kLevel) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
