"""The ops table: the typed signature of every op the layers call, and `MambaOps` holding them.

A backend (`ref` in `vllm_mamba.ops.dispatch`, `cpu_kernels`, `triton_ops`) fills one
`MambaOps`; the layers call its fields with keyword arguments. Each op's parameters are those
of its pure-PyTorch `_ref` twin, documented there (`causal_conv1d`, `selective_scan`, `ssd`,
`gated_rms_norm`, `paged_attention`).
This module imports no backend, so the backends and the dispatcher can all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.gated_rms_norm import gated_rms_norm_ref
from vllm_mamba.ops.int4_linear import int4_linear_ref
from vllm_mamba.ops.int8_linear import int8_linear_ref
from vllm_mamba.ops.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)
from vllm_mamba.ops.ssd import ssd_chunk_scan_varlen_ref, ssd_state_update_ref

Tensor = torch.Tensor


class LinearOp(Protocol):
    """`x (B, K) @ weight (N, K)^T + bias` -> `(B, N)`."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor: ...


class Int8LinearOp(Protocol):
    """See `int8_linear_ref`: `x (B, K) @ (qweight (N, K) * scale (N,))^T + bias` -> `(B, N)`."""

    def __call__(
        self, x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None
    ) -> Tensor: ...


class ConvVarlenOp(Protocol):
    """See `causal_conv1d_varlen_ref`."""

    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
        activation: bool = True,
    ) -> Tensor: ...  # fmt: skip


class ConvUpdateOp(Protocol):
    """See `causal_conv1d_update_ref`."""

    def __call__(
        self, x: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None,
        state_indices: Tensor, activation: bool = True,
    ) -> Tensor: ...  # fmt: skip


class ScanVarlenOp(Protocol):
    """See `selective_scan_varlen_ref`."""

    def __call__(
        self, u: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor, D_skip: Tensor | None,
        z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, ssm_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class ScanUpdateOp(Protocol):
    """See `selective_state_update_ref`."""

    def __call__(
        self, ssm_states: Tensor, u: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor,
        D_skip: Tensor | None, z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


class SSDVarlenOp(Protocol):
    """See `ssd_chunk_scan_varlen_ref`."""

    def __call__(
        self, x: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor, D_skip: Tensor | None,
        dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float],
        ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
        has_initial_state: Tensor, chunk_size: int,
    ) -> Tensor: ...  # fmt: skip


class SSDUpdateOp(Protocol):
    """See `ssd_state_update_ref`."""

    def __call__(
        self, ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B_: Tensor, C: Tensor,
        D_skip: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


class GatedRMSNormOp(Protocol):
    """See `gated_rms_norm_ref`."""

    def __call__(
        self, x: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float
    ) -> Tensor: ...


class ReshapeAndCacheOp(Protocol):
    """See `reshape_and_cache_ref`."""

    def __call__(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None: ...


class PagedDecodeOp(Protocol):
    """See `paged_decode_attention_ref`."""

    def __call__(
        self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
        seq_lens: Tensor, scale: float,
    ) -> Tensor: ...  # fmt: skip


class PagedPrefillOp(Protocol):
    """See `paged_prefill_attention_ref`."""

    def __call__(
        self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
        query_start_loc: Tensor, seq_lens: Tensor, scale: float,
    ) -> Tensor: ...  # fmt: skip


class FusedMambaDecodeOp(Protocol):
    """See `fused_mamba_decode_ref`."""

    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], conv_states: Tensor,
        ssm_states: Tensor, state_indices: Tensor, norm_eps: float, mixer_eps: float,
        out_dtype: torch.dtype,
    ) -> Tensor: ...  # fmt: skip


class FusedMamba2DecodeOp(Protocol):
    """See `fused_mamba2_decode_ref`."""

    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], conv_states: Tensor,
        ssm_states: Tensor, state_indices: Tensor, n_groups: int, group_size: int,
        norm_eps: float, gate_eps: float, out_dtype: torch.dtype,
    ) -> Tensor: ...  # fmt: skip


@dataclass(frozen=True)
class MambaOps:
    """The kernels the layers call, with the signatures of the `_ref` functions.

    Mamba uses the conv and selective-scan ops; Mamba2 the conv, SSD and gated-norm ops; every
    projection goes through `linear` (`int8_linear` / `int4_linear` once its weight is
    quantised); the attention
    layers of hybrids write their KV cache with `reshape_and_cache` and read it with the paged
    attention ops. A backend without its own kernel for an op with a default keeps that
    default (`F.linear` or the reference).
    """

    name: str
    causal_conv1d_varlen: ConvVarlenOp
    causal_conv1d_update: ConvUpdateOp
    selective_scan_varlen: ScanVarlenOp
    selective_state_update: ScanUpdateOp
    linear: LinearOp = F.linear
    ssd_chunk_scan_varlen: SSDVarlenOp = ssd_chunk_scan_varlen_ref
    ssd_state_update: SSDUpdateOp = ssd_state_update_ref
    gated_rms_norm: GatedRMSNormOp = gated_rms_norm_ref
    reshape_and_cache: ReshapeAndCacheOp = reshape_and_cache_ref
    paged_decode_attention: PagedDecodeOp = paged_decode_attention_ref
    paged_prefill_attention: PagedPrefillOp = paged_prefill_attention_ref
    fused_mamba_decode: FusedMambaDecodeOp | None = None
    fused_mamba2_decode: FusedMamba2DecodeOp | None = None
    int8_linear: Int8LinearOp = int8_linear_ref
    # `(x, qweight (N, K/2) uint8, scales (N, K/32) float16, bias)`, see `int4_linear_ref`.
    int4_linear: Int8LinearOp = int4_linear_ref

    def family(self, name: str) -> SimpleNamespace:
        """The ops of family `name` (`vllm_mamba.ops.families`) for this backend."""
        return family_ops(name, self.name)
