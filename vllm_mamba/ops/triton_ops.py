"""The Triton backend of the ops: which op of which family each Triton kernel implements.

The kernels live in `triton_conv1d`, `triton_selective_scan`, `triton_ssd`, `triton_attention`,
`triton_gated_delta`, `triton_kda`, `triton_mla`, `triton_rwkv`, `triton_short_conv`,
`triton_rglru`, `triton_mlstm`, `triton_dynamic_conv` and `triton_cca`; this module says
whether they can run here (`available`) and registers them as the `triton` backend's ops
(`register`, called once by `vllm_mamba.ops.families.load_backend`). Every other op (the
projections: `F.linear`, i.e. cuBLAS; the gated RMSNorm; CCA's shifts) runs its `_ref`.
They run on CUDA devices, and on the CPU under the Triton interpreter (`TRITON_INTERPRET=1`),
which is how the tests check them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from vllm_mamba.ops.families import register_op_impl
from vllm_mamba.ops.table import MambaOps, bind_ops

# family -> {op: "module:function"} of each Triton kernel's launcher (in `vllm_mamba.ops`)
TRITON_OPS: dict[str, dict[str, str]] = {
    "causal_conv1d": {"varlen": "triton_conv1d:causal_conv1d_varlen",
                      "update": "triton_conv1d:causal_conv1d_update"},
    "selective_scan": {"varlen": "triton_selective_scan:selective_scan_varlen",
                       "update": "triton_selective_scan:selective_state_update"},
    "ssd": {"chunk_scan_varlen": "triton_ssd:ssd_chunk_scan_varlen",
            "state_update": "triton_ssd:ssd_state_update"},
    "paged_attention": {"reshape_and_cache": "triton_attention:reshape_and_cache",
                        "decode": "triton_attention:paged_decode_attention",
                        "prefill": "triton_attention:paged_prefill_attention"},
    "gated_delta": {"varlen": "triton_gated_delta:gated_delta_varlen",
                    "update": "triton_gated_delta:gated_delta_update",
                    "norm_gate": "triton_gated_delta:rms_norm_gated"},
    "kda": {"varlen": "triton_kda:kda_varlen", "update": "triton_kda:kda_update",
            "norm_gate": "triton_kda:kda_norm_gate"},
    "mla": {"cache_write": "triton_mla:mla_cache_write",
            "decode_attention": "triton_mla:mla_decode_attention",
            "prefill_attention": "triton_mla:mla_prefill_attention"},
    "short_conv": {"update": "triton_short_conv:short_conv_update",
                   "varlen": "triton_short_conv:short_conv_varlen"},
    "rwkv7": {"varlen": "triton_rwkv:wkv7_varlen", "update": "triton_rwkv:wkv7_update"},
    "rwkv4": {"varlen": "triton_rwkv:wkv4_varlen", "update": "triton_rwkv:wkv4_update"},
    "rglru": {"varlen": "triton_rglru:rglru_varlen", "update": "triton_rglru:rglru_update"},
    "mlstm": {"varlen": "triton_mlstm:mlstm_varlen", "update": "triton_mlstm:mlstm_update"},
    "dynamic_conv": {"varlen": "triton_dynamic_conv:dynamic_conv_varlen",
                     "update": "triton_dynamic_conv:dynamic_conv_update"},
    "cca": {"conv_varlen": "triton_cca:cca_conv_varlen",
            "conv_update": "triton_cca:cca_conv_update"},
}  # fmt: skip


def available() -> bool:
    """True when triton is installed and there is a CUDA device or the interpreter is on."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def register() -> None:
    """Registers every kernel of `TRITON_OPS` as the `triton` backend's op."""
    for family, ops in TRITON_OPS.items():
        impls = {}
        for op, where in ops.items():
            module, function = where.split(":")
            impls[op] = getattr(importlib.import_module(f"vllm_mamba.ops.{module}"), function)
        register_op_impl(family, "triton", **impls)


def make_ops() -> MambaOps:
    """The ops table of the Triton backend."""
    return bind_ops("triton")
