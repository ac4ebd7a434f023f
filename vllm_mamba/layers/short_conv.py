"""`ShortConv`: LFM2's gated short convolution over one flat varlen batch (decodes first, then
prefill chunks).

    B, C, x = in_proj(h).chunk(3)        # (T, D) each, in this order
    y = conv(B * x)                      # depthwise causal conv of width K, no activation
    out = out_proj(C * y)                # (T, H)

`conv` is depthwise (one filter of K taps per channel), causal, with an optional bias, and
starts from each sequence's saved history: the per-sequence state is that history alone,
`conv (D, K - 1)` (the last K - 1 values of `B * x`, kind `conv`, kept in the model dtype).
The gating and the conv run as one op on the in_proj output, the op family `short_conv`
(`vllm_mamba.ops.short_conv`: `update` for the decode rows, `varlen` for the prefill chunks;
float32 math, one rounding of `C * y`).
There is no recurrent state, so forks, preemption and prefix snapshots copy this one tensor.
In the checkpoints: `in_proj.weight (3D, H)`, `conv.weight (D, 1, K)`, `out_proj.weight
(H, D)`; LFM2's `conv_bias` gives all three a bias (`(3D,)`, `(D,)`, `(H,)`).

Tensor parallelism (`tp`): each rank holds D/N channels: its rows of each of B, C and x in
`in_proj` (column-parallel by sections), its conv filters and state, and its input columns of
`out_proj` (row-parallel, all-reduced); the gating is per channel, so no other communication.

Glossary: T tokens in the step, H hidden size, D conv channels (H in LFM2; this rank's D/N under
tensor parallelism), K conv width (`conv_L_cache`), S state slots, N ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.decode_plan import CHAIN_MAX_ROWS, FusedStep, decode_only, decode_slots
from vllm_mamba.layers.fused_decode_layer import _f32 as f32
from vllm_mamba.layers.fused_decode_layer import _out_dtype as fused_out_dtype
from vllm_mamba.layers.fused_decode_layer import _weights as fused_weights
from vllm_mamba.layers.fused_decode_layer import norm_weight, step_out_dtype
from vllm_mamba.layers.mixer_base import Conv1dWeights
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.quantization import uses_int_dot
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops import short_conv as short_conv_ops
from vllm_mamba.ops.families import own_op
from vllm_mamba.ops.table import MambaOps


class ShortConv(StatefulLayer):
    """`out_proj(C * conv(B * x))` with `B, C, x = in_proj(h)` (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        channels: int,
        kernel: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Args: `channels` D (global), `kernel` K, `bias` whether `in_proj`, `conv` and
        `out_proj` have biases."""
        super().__init__()
        if kernel < 2:
            raise ValueError(f"conv_L_cache ({kernel}) must be at least 2")
        start, local = tp.range(channels, "the short conv's channels (hidden_size)")
        self.ops = ops
        self.sc = ops.family(short_conv_ops.FAMILY)  # the fused gated conv ops
        self.channels = local  # this rank's D
        self.kernel = kernel
        self.in_proj = column_linear(hidden_size, [channels] * 3, bias, ops, tp)
        self.conv = Conv1dWeights(local, kernel, bias)
        self.out_proj = row_linear(channels, hidden_size, bias, ops, tp)
        if tp.size > 1:
            shard_param(self.conv, "weight", 0, [(start, local)], channels)
            if bias:
                shard_param(self.conv, "bias", 0, [(start, local)], channels)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes the `(D, K)` conv filters."""
        self.conv_weight = self.conv.weight.detach()[:, 0, :].contiguous()

    def state_spec(self) -> StateSpec:
        """One tensor: the conv history `(D, K - 1)` (the model dtype)."""
        return StateSpec((StateTensor("conv", (self.channels, self.kernel - 1), "conv"),))

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """The decode-only steps as one call of the family's `decode_layer` (with the block's
        plain or zero-centred `RMSNorm` and residual when given), planned once; None where it
        does not apply: no kernel, projections that are not plain `Linear`s of one model dtype
        (float32, bfloat16, int8, 4-bit; tensor-parallel layers are not), another norm, states
        other than float32 / bfloat16, a residual multiplier."""
        if residual_scale != 1.0:
            return None
        op = own_op(short_conv_ops.FAMILY, self.ops.name, "decode_layer")
        conv = self.state["conv"] if self.state else None
        if op is None or conv is None or conv.dtype not in (torch.float32, torch.bfloat16):
            return None
        norm_w = norm_weight(norm) if norm is not None else None
        if norm is not None and norm_w is None:
            return None
        found = fused_weights(self, ("in_proj", "out_proj"))
        if found is None:
            return None
        weights, dtype = found
        params = short_conv_ops.ShortConvParams(
            norm_w=norm_w, in_proj_b=f32(self.in_proj.bias),
            conv_w=f32(self.conv_weight), conv_b=f32(self.conv.bias),
            out_proj_b=f32(self.out_proj.bias), **weights,
        )  # fmt: skip
        eps = norm.variance_epsilon if norm is not None else 0.0
        return FusedShortConvStep(
            op, self, list(params), eps, dtype, fused_out_dtype(dtype, norm, residual_in_fp32)
        )

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's `self.state["conv"]`
        (`(S, D, K - 1)`) in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        bcx = self.in_proj(hidden)  # (T, 3D): [B | C | x]
        conv_states = self.state["conv"]  # (S, D, K - 1)
        gated = recurrent_step(  # (T, D): C * conv(B * x)
            meta, [conv_states],
            decode=lambda r, slots: self.sc.update(
                bcx[r], conv_states, self.conv_weight, self.conv.bias, slots
            ),
            prefill=lambda r: self.sc.varlen(
                bcx[r], conv_states, self.conv_weight, self.conv.bias,
                meta.prefill_query_start_loc, meta.prefill_state_indices,
                meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return self.out_proj(gated)  # (T, H)


@dataclass(frozen=True, eq=False)
class FusedShortConvStep:
    """A `ShortConv`'s decode-only step in one call of `op` (`decode_layer`), with the block's
    norm and residual when planned with one; the result dtype as `FusedMambaStep`'s."""

    op: Callable[..., torch.Tensor]
    mixer: ShortConv
    params: list[torch.Tensor | None]
    norm_eps: float
    dtype: torch.dtype
    out_dtype: torch.dtype | None

    def takes(self, hidden: torch.Tensor, meta: MambaMetadata) -> bool:
        """A decode-only step (see `decode_plan.decode_only`)."""
        return decode_only(hidden, meta, None, CHAIN_MAX_ROWS)

    def __call__(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; the bound history advanced in place."""
        out_dtype = step_out_dtype(self.out_dtype, self.dtype, hidden)
        dst, src = decode_slots(meta)
        return self.op(
            hidden,
            self.params,
            self.mixer.state["conv"],
            dst,
            self.norm_eps,
            out_dtype,
            src,
            uses_int_dot(self.mixer.in_proj),
        )
