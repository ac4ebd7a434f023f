"""The Gated DeltaNet (GDN) mixer over one flat varlen batch: decodes first, then prefill chunks.

    q, k, v, z, b, a = projections(x)             # the layout is the model's (below)
    q, k, v = silu(causal_conv([q | k | v]))      # depthwise, no bias, history in the state
    o = gated_delta_rule(q, k, v, a, b)           # ops family `gated_delta`: L2 norms, gates,
                                                  # the delta rule over the state S
    y = out_proj(rmsnorm_per_head(o) * silu(z))

Three checkpoint layouts of the same mixer, each a small subclass that builds and splits its
input projections (and names its norm and output projection):

- `Qwen3_5GatedDeltaNet` (Qwen3.5 / 3.6): `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
  `conv1d`, `norm`, `out_proj`.
- `Qwen3NextGatedDeltaNet` (Qwen3-Next): `in_proj_qkvz` and `in_proj_ba`, whose rows are
  interleaved per key-head group (`[q_g | k_g | v_g | z_g]`, `[b_g | a_g]` for each key head g,
  v_g and z_g holding its Hv/Hk value heads); reordered once after loading into
  `[q | k | v | z]` and `[b | a]`, so the forward is a split.
- `OlmoHybridGatedDeltaNet` (OLMo Hybrid): `q_proj`, `k_proj`, `v_proj`, `g_proj` (the gate z),
  `a_proj`, `b_proj`, three convs `q_conv1d`, `k_conv1d`, `v_conv1d` (concatenated after
  loading), `o_norm`, `o_proj`; `beta_scale` 2 with `linear_allow_neg_eigval`.

Per-sequence state (`state_spec`): `conv (CD, K - 1)` in the model dtype and
`recurrent (Hv, Dk, Dv)`, float32 unless `ssm_state_dtype` says otherwise.

With tensor parallelism (`tp`) each rank holds Hk/N key heads and their Hv/N value heads
(`mixer_sharding.gated_delta_shard`): their rows of every input projection (for Qwen3-Next, its
key-head groups, which are contiguous rows of the interleaved layout), their conv channels,
`A_log`, `dt_bias` and state; the norm is per head (replicated) and the output projection
row-parallel.

A layer's decode-only steps may run as one fused call (`fused_mixer_step`, planned once:
`layers.fused_delta_decode`), with the block's norm and residual: each layout names its input
projections in the order of their outputs `[q | k | v | z | b | a]` (`FUSED_INPUTS`).

Glossary: T tokens in the step, H hidden size, Hk / Hv key / value heads and Dk / Dv their head
dims (this rank's counts), r = Hv / Hk, K conv width, CD conv channels `2 Hk Dk + Hv Dv`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.decode_plan import FusedStep
from vllm_mamba.layers.fused_delta_decode import plan_gdn
from vllm_mamba.layers.mixer_base import Conv1dWeights, causal_conv
from vllm_mamba.layers.mixer_sharding import GatedDeltaShard, gated_delta_shard
from vllm_mamba.layers.parallel_linear import Ranges, column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops.gated_delta import FAMILY
from vllm_mamba.ops.table import MambaOps

Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class HeadGatedRMSNorm(nn.Module):
    """`weight * rmsnorm(o) * silu(z)` per value head (`weight (Dv,)`, the `norm_gate` op)."""

    def __init__(self, head_dim: int, eps: float, norm_gate: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps
        self.norm_gate = norm_gate

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`o, z (T, Hv, Dv)` -> `(T, Hv, Dv)` in o's dtype."""
        return self.norm_gate(o, z, self.weight, self.variance_epsilon)


class GatedDeltaNet(StatefulLayer):
    """The mixer; a subclass builds its projections (`_build_projections`) and splits their
    outputs (`_project`). `NORM` and `OUT` are its names of the norm and output projection;
    `FUSED_INPUTS` its input projections whose outputs concatenated are `[q | k | v | z | b |
    a]` (empty: no fused decode). `fused_decode` says whether the decode-only steps may run as
    one fused call (read when the layer's decode plan is made)."""

    NORM = "norm"
    OUT = "out_proj"
    FAMILY = FAMILY  # the op family of the delta rule (`kda` for Kimi's per-channel decay)
    FUSED_INPUTS: tuple[str, ...] = ()
    fused_decode: bool = True

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        norm_eps: float,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        *,
        beta_scale: float = 1.0,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        shard = gated_delta_shard(num_k_heads, num_v_heads, head_k_dim, head_v_dim, tp)
        self.ops = ops
        self.gd = ops.family(self.FAMILY)
        self.num_k_heads, self.num_v_heads = shard.k_heads[1], shard.v_heads[1]
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = self.num_k_heads * head_k_dim  # this rank's q (and k) channels
        self.value_dim = self.num_v_heads * head_v_dim  # this rank's v (and z) channels
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.beta_scale = float(beta_scale)
        self.chunk_size = chunk_size
        self._build_projections(hidden_size, shard, ops, tp)
        self._build_conv(shard, tp)
        self._build_gates(shard, tp)
        self.add_module(self.NORM, HeadGatedRMSNorm(head_v_dim, norm_eps, self.gd.norm_gate))
        self.add_module(self.OUT, row_linear(shard.value_total, hidden_size, False, ops, tp))
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def _build_gates(self, shard: GatedDeltaShard, tp: TensorParallel) -> None:
        """The decay parameters: `A_log (Hv,)` and `dt_bias (Hv,)` (this rank's heads)."""
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        if tp.size > 1:
            for name in ("A_log", "dt_bias"):
                shard_param(self, name, 0, [shard.v_heads], shard.num_v_heads)

    def _gate_args(self) -> dict[str, object]:
        """The decay and beta parameters, as the family's ops take them."""
        return {"A_log": self.A_log, "dt_bias": self.dt_bias, "beta_scale": self.beta_scale}

    def _build_projections(
        self, hidden_size: int, shard: GatedDeltaShard, ops: MambaOps, tp: TensorParallel
    ) -> None:
        """Registers the input projections (this rank's rows of them)."""
        raise NotImplementedError

    def _project(self, hidden: torch.Tensor) -> Projected:
        """`hidden (T, H)` -> `qkv (T, CD)`, `z (T, Hv Dv)`, `b (T, Hv)`, `a (T, Hv)`."""
        raise NotImplementedError

    def _build_conv(self, shard: GatedDeltaShard, tp: TensorParallel) -> None:
        """One depthwise conv over `[q | k | v]` (`conv1d.weight (CD, 1, K)`)."""
        self.conv1d = Conv1dWeights(self.conv_dim, self.conv_kernel, bias=False)
        if tp.size > 1:
            total = 2 * shard.key_total + shard.value_total
            shard_param(self.conv1d, "weight", 0, shard.conv_ranges(), total)

    def _conv_filters(self) -> torch.Tensor:
        """The loaded conv filters `(CD, K)`."""
        return self.conv1d.weight.detach()[:, 0, :]

    def process_weights_after_loading(self) -> None:
        """Precomputes the `(CD, K)` conv filters."""
        self.conv_weight = self._conv_filters().contiguous()

    def state_spec(self) -> StateSpec:
        """conv `(CD, K - 1)` (the model dtype) and recurrent `(Hv, Dk, Dv)` (float32 by
        default)."""
        return StateSpec((
            StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), "conv"),
            StateTensor("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
        ))  # fmt: skip

    def fused_mixer_step(
        self, norm: nn.Module | None, residual_in_fp32: bool, residual_scale: float = 1.0
    ) -> FusedStep | None:
        """The decode-only steps in one fused kernel call (with the block's `norm` and residual
        when given), planned once; None where that does not apply (`fused_delta_decode`): a
        mixer of another delta rule (`FAMILY`) or output norm, a residual multiplier."""
        if (
            residual_scale != 1.0
            or self.FAMILY != FAMILY
            or type(getattr(self, self.NORM)) is not HeadGatedRMSNorm
        ):
            return None
        return plan_gdn(self, norm, residual_in_fp32)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)` and advances each sequence's state in place.

        `self.state["conv"]` is `(S, CD, K - 1)`, `self.state["recurrent"]` `(S, Hv, Dk, Dv)`.

        Returns:
            `(T, H)` in the model dtype.
        """
        num_tokens = hidden.shape[0]
        if meta.decode_waves and self.chain_log is not None:
            self.chain_log.active = False  # this chain's states go to the spare slots
        qkv, z, b, a = self._project(hidden)
        qkv = causal_conv(self.ops, qkv, self.conv_weight, None, self.state["conv"], meta)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)  # (T, Hk, Dk)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)  # (T, Hk, Dk)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)  # (T, Hv, Dv)
        gates = self._gate_args()
        rec = self.state["recurrent"]  # (S, Hv, Dk, Dv)
        o = recurrent_step(  # (T, Hv, Dv)
            meta, [rec],
            decode=lambda r, slots: self.gd.update(
                q=q[r], k=k[r], v=v[r], a=a[r], b=b[r], ssm_states=rec, state_indices=slots,
                **gates,
            ),
            prefill=lambda r: self.gd.varlen(
                q=q[r], k=k[r], v=v[r], a=a[r], b=b[r], ssm_states=rec,
                query_start_loc=meta.prefill_query_start_loc,
                state_indices=meta.prefill_state_indices,
                has_initial_state=meta.prefill_has_initial_state, chunk_size=self.chunk_size,
                **gates,
            ),
        )  # fmt: skip
        o = getattr(self, self.NORM)(o, z.reshape(o.shape))
        return getattr(self, self.OUT)(o.reshape(num_tokens, self.value_dim))


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's layout: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`."""

    FUSED_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _build_projections(
        self, hidden_size: int, shard: GatedDeltaShard, ops: MambaOps, tp: TensorParallel
    ) -> None:
        conv = [2 * shard.key_total + shard.value_total]
        heads, values = [shard.v_heads], [shard.value_range()]
        self.in_proj_qkv = column_linear(hidden_size, conv, False, ops, tp, shard.conv_ranges())
        self.in_proj_z = column_linear(hidden_size, [shard.value_total], False, ops, tp, values)
        self.in_proj_b = column_linear(hidden_size, [shard.num_v_heads], False, ops, tp, heads)
        self.in_proj_a = column_linear(hidden_size, [shard.num_v_heads], False, ops, tp, heads)

    def _project(self, hidden: torch.Tensor) -> Projected:
        return (
            self.in_proj_qkv(hidden),
            self.in_proj_z(hidden),
            self.in_proj_b(hidden),
            self.in_proj_a(hidden),
        )


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layout: `in_proj_qkvz` and `in_proj_ba`, interleaved per key-head group
    (`[q | k | v | z]` and `[b | a]` after `process_weights_after_loading`)."""

    FUSED_INPUTS = ("in_proj_qkvz", "in_proj_ba")

    def _build_projections(
        self, hidden_size: int, shard: GatedDeltaShard, ops: MambaOps, tp: TensorParallel
    ) -> None:
        num_k, (k0, hk) = shard.num_k_heads, shard.k_heads
        ratio = shard.num_v_heads // num_k  # r value heads per key head
        group = 2 * self.head_k_dim + 2 * ratio * self.head_v_dim  # rows of one key head
        self._ratio = ratio
        self.in_proj_qkvz = column_linear(
            hidden_size, [num_k * group], False, ops, tp, [(k0 * group, hk * group)]
        )
        self.in_proj_ba = column_linear(
            hidden_size, [num_k * 2 * ratio], False, ops, tp, [(k0 * 2 * ratio, hk * 2 * ratio)]
        )

    def process_weights_after_loading(self) -> None:
        """Reorders the interleaved rows into `[q | k | v | z]` and `[b | a]`, then the conv."""
        super().process_weights_after_loading()
        dk, rdv, hk = self.head_k_dim, self._ratio * self.head_v_dim, self.num_k_heads
        with torch.no_grad():
            w = self.in_proj_qkvz.weight  # (Hk (2 Dk + 2 r Dv), H)
            groups = w.view(hk, -1, w.shape[-1]).split([dk, dk, rdv, rdv], dim=1)
            w.copy_(torch.cat([g.reshape(-1, w.shape[-1]) for g in groups]))
            w = self.in_proj_ba.weight  # (Hk 2 r, H)
            groups = w.view(hk, -1, w.shape[-1]).split([self._ratio, self._ratio], dim=1)
            w.copy_(torch.cat([g.reshape(-1, w.shape[-1]) for g in groups]))

    def _project(self, hidden: torch.Tensor) -> Projected:
        qkv, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)  # (T, Hv) each
        return qkv, z, b, a


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """OLMo Hybrid's layout: separate projections and convs, `o_norm` and `o_proj`."""

    NORM = "o_norm"
    OUT = "o_proj"
    FUSED_INPUTS = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")

    def _build_projections(
        self, hidden_size: int, shard: GatedDeltaShard, ops: MambaOps, tp: TensorParallel
    ) -> None:
        keys, values, heads = [shard.key_range()], [shard.value_range()], [shard.v_heads]
        key_total, value_total, num_v = shard.key_total, shard.value_total, shard.num_v_heads
        self.q_proj = column_linear(hidden_size, [key_total], False, ops, tp, keys)
        self.k_proj = column_linear(hidden_size, [key_total], False, ops, tp, keys)
        self.v_proj = column_linear(hidden_size, [value_total], False, ops, tp, values)
        self.g_proj = column_linear(hidden_size, [value_total], False, ops, tp, values)
        self.a_proj = column_linear(hidden_size, [num_v], False, ops, tp, heads)
        self.b_proj = column_linear(hidden_size, [num_v], False, ops, tp, heads)

    def _build_conv(self, shard: GatedDeltaShard, tp: TensorParallel) -> None:
        """Three depthwise convs, `q_conv1d`, `k_conv1d (Hk Dk, 1, K)`, `v_conv1d (Hv Dv, 1, K)`."""
        parts: list[tuple[str, int, Ranges, int]] = [
            ("q_conv1d", self.key_dim, [shard.key_range()], shard.key_total),
            ("k_conv1d", self.key_dim, [shard.key_range()], shard.key_total),
            ("v_conv1d", self.value_dim, [shard.value_range()], shard.value_total),
        ]
        for name, channels, ranges, total in parts:
            conv = Conv1dWeights(channels, self.conv_kernel, bias=False)
            if tp.size > 1:
                shard_param(conv, "weight", 0, ranges, total)
            self.add_module(name, conv)

    def _conv_filters(self) -> torch.Tensor:
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return torch.cat([c.weight.detach()[:, 0, :] for c in convs])

    def _project(self, hidden: torch.Tensor) -> Projected:
        qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        return qkv, self.g_proj(hidden), self.b_proj(hidden), self.a_proj(hidden)
