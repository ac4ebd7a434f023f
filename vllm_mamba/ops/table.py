"""`MambaOps`: the ops table the layers receive, one backend's view of the op registry.

The core ops (conv1d, selective scan, SSD, gated RMSNorm, paged attention, the projections and
the fused Mamba decode layers) are fields that the layers call with keyword arguments; every
other family is reached by name through `MambaOps.family`. `bind_ops(backend)` fills the table
from the one registry (`vllm_mamba.ops.families`): each field is the backend's own op where it
registered one, else the family's `_ref`; the fused decode layers have no default (None: the
layers run unfused) and are switched off by `VLLM_MAMBA_FUSED_DECODE=0`. The signatures are
the families' protocols, next to their references (`causal_conv1d`, `selective_scan`, `ssd`,
`gated_rms_norm`, `paged_attention`, `linear`, `fused_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from vllm_mamba import envs
from vllm_mamba.ops.causal_conv1d import ConvUpdateOp, ConvVarlenOp
from vllm_mamba.ops.families import family_ops, load_backend, own_op
from vllm_mamba.ops.fused_decode import FusedMamba2DecodeOp, FusedMambaDecodeOp
from vllm_mamba.ops.gated_rms_norm import GatedRMSNormOp
from vllm_mamba.ops.linear import (
    BlockLinearOp,
    GroupedLinearOp,
    Int4LinearOp,
    Int8LinearOp,
    LinearOp,
)
from vllm_mamba.ops.paged_attention import PagedDecodeOp, PagedPrefillOp, ReshapeAndCacheOp
from vllm_mamba.ops.selective_scan import ScanUpdateOp, ScanVarlenOp
from vllm_mamba.ops.ssd import SSDUpdateOp, SSDVarlenOp

__all__ = ["FIELDS", "MambaOps", "bind_ops"]


@dataclass(frozen=True)
class MambaOps:
    """The kernels the layers call, with the signatures of the `_ref` functions.

    Mamba uses the conv and selective-scan ops; Mamba2 the conv, SSD and gated-norm ops; every
    projection goes through `linear` (`int8_linear` / `int4_linear` once its weight is
    quantised, `w8a8_linear` / `w4a8_linear` with integer dot products); the attention layers
    of hybrids write their KV cache with `reshape_and_cache` and read it with the paged
    attention ops. `fused_mamba_decode` / `fused_mamba2_decode` are
    None where the backend has no fused layer.
    """

    name: str
    causal_conv1d_varlen: ConvVarlenOp
    causal_conv1d_update: ConvUpdateOp
    selective_scan_varlen: ScanVarlenOp
    selective_state_update: ScanUpdateOp
    linear: LinearOp
    block_linear: BlockLinearOp
    ssd_chunk_scan_varlen: SSDVarlenOp
    ssd_state_update: SSDUpdateOp
    gated_rms_norm: GatedRMSNormOp
    reshape_and_cache: ReshapeAndCacheOp
    paged_decode_attention: PagedDecodeOp
    paged_prefill_attention: PagedPrefillOp
    int8_linear: Int8LinearOp
    int4_linear: Int4LinearOp
    grouped_linear: GroupedLinearOp
    w8a8_linear: Int8LinearOp
    w4a8_linear: Int4LinearOp
    fused_mamba_decode: FusedMambaDecodeOp | None = None
    fused_mamba2_decode: FusedMamba2DecodeOp | None = None

    def family(self, name: str) -> SimpleNamespace:
        """The ops of family `name` (`vllm_mamba.ops.families`) for this backend."""
        return family_ops(name, self.name)


# Each field of the table: the family and op of the registry it holds.
FIELDS: dict[str, tuple[str, str]] = {
    "causal_conv1d_varlen": ("causal_conv1d", "varlen"),
    "causal_conv1d_update": ("causal_conv1d", "update"),
    "selective_scan_varlen": ("selective_scan", "varlen"),
    "selective_state_update": ("selective_scan", "update"),
    "linear": ("linear", "linear"),
    "block_linear": ("linear", "block_linear"),
    "ssd_chunk_scan_varlen": ("ssd", "chunk_scan_varlen"),
    "ssd_state_update": ("ssd", "state_update"),
    "gated_rms_norm": ("gated_rms_norm", "gated_rms_norm"),
    "reshape_and_cache": ("paged_attention", "reshape_and_cache"),
    "paged_decode_attention": ("paged_attention", "decode"),
    "paged_prefill_attention": ("paged_attention", "prefill"),
    "int8_linear": ("linear", "int8_linear"),
    "int4_linear": ("linear", "int4_linear"),
    "grouped_linear": ("linear", "grouped_linear"),
    "w8a8_linear": ("linear", "w8a8_linear"),
    "w4a8_linear": ("linear", "w4a8_linear"),
    "fused_mamba_decode": ("fused_decode", "mamba"),
    "fused_mamba2_decode": ("fused_decode", "mamba2"),
}
_NO_DEFAULT = {"fused_mamba_decode", "fused_mamba2_decode"}  # the backend's own, else None


def bind_ops(backend: str) -> MambaOps:
    """The table of `backend` (its module's ops registered first, `families.load_backend`).

    Raises:
        ValueError: the backend does not run here.
    """
    if not load_backend(backend):
        raise ValueError(f"ops backend {backend!r} is not available here")
    ops = {}
    for name, (family, op) in FIELDS.items():
        if name in _NO_DEFAULT:
            ops[name] = own_op(family, backend, op) if envs.VLLM_MAMBA_FUSED_DECODE else None
        else:
            ops[name] = getattr(family_ops(family, backend), op)
    return MambaOps(name=backend, **ops)
