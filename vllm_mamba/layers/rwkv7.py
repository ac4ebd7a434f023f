"""RWKV-7 ("Goose") time mix and channel mix over one flat varlen batch (decodes first, then
prefill chunks), under the Hugging Face (fla-hub) names.

Time mix (`attn`), per token with `x` its normed input and `x'` the previous token's:

    d = x' - x ;  x_r, x_w, x_k, x_v, x_a, x_g = x + d * mu_*          token shift, 6 mixes
    r, k, v = r_proj(x_r), k_proj(x_k), v_proj(x_v)
    w = -exp(-0.5) * sigmoid(w_lora(x_w))      the log decay; w_lora = w2 tanh(w1 x) + w0
    a = sigmoid(a_lora(x_a))                   the in-context learning rate (a2 a1 x + a0)
    g = g_lora(x_g)                            the output gate, g2 sigmoid(g1 x)
    kk = l2norm(k * k_k) per head ;  k = k * (1 + (a - 1) * k_a)
    v = v + (v_first - v) * sigmoid(v_lora(x_v))     (layer 0: v_first = v, no v_lora)
    o = wkv(r, w, k, v, a=-kk, b=kk * a)       the op family `rwkv7` over the state S
    o = group_norm(o) per head + (sum(r * k * r_k) per head) * v
    out = o_proj(o * g)

Channel mix (`ffn`): `out = value(relu(key(x + (x' - x) * x_k)) ** 2)`.

Per-sequence state: the time mix's `shift (H,)` (the previous token's normed input, model
dtype) and `wkv (NH, Dv, Dk)` (float32 unless `ssm_state_dtype`); the channel mix's own
`shift (H,)`. `v_first` is layer 0's value, read by every later layer of the same step: the
layers of one model share a `ValueFirst` holder (the forward runs the layers in order).

Tensor parallelism (`tp`) is by heads: each rank holds NH/N heads' rows of `r_proj`, `k_proj`,
`v_proj` and of the LoRAs' second matrices (and biases), their `k_k`, `k_a`, `r_k`, group-norm
weights and state, and their input columns of `o_proj` (row-parallel); the LoRAs' first
matrices and the shift mixes are replicated. The channel mix is column- then row-parallel.
The hidden-sized shift states are kept whole on every rank.

Glossary: T tokens in the step, H hidden size, NH heads (this rank's), Dk head size, Dv value
head size (`value_dim / num_heads`, Dk in the released models), C = NH * Dk, CV = NH * Dv,
F the channel mix's width, S state slots.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers import rwkv7_decode
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.decode_plan import FusedStep
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.token_shift import shift_mix
from vllm_mamba.ops import rwkv7 as rwkv7_ops
from vllm_mamba.ops.families import has_own_op
from vllm_mamba.ops.table import MambaOps

MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


class ValueFirst:
    """Layer 0's value `(T, CV)` of the step being run, read by the later layers."""

    value: torch.Tensor | None = None


class LoRA(nn.Module):
    """`up(act(down(x)))` under fla's names `lora.0` (down, `(r, H)`, replicated) and `lora.2`
    (up, `(out, r)`, column-parallel by heads, with an optional bias)."""

    def __init__(
        self,
        hidden: int,
        out: int,
        rank: int,
        bias: bool,
        activation: str | None,
        ops: MambaOps,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.lora = nn.ModuleList(
            [
                Linear(hidden, rank, False, ops),
                nn.Identity(),
                column_linear(rank, [out], bias, ops, tp),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, out)`."""
        h = self.lora[0](x)
        if self.activation == "tanh":
            h = torch.tanh(h)
        elif self.activation == "sigmoid":
            h = torch.sigmoid(h)
        return self.lora[2](h)


class HeadGroupNorm(nn.Module):
    """The weights of `nn.GroupNorm` with one group per head (`g_norm`), sharded by heads; the
    norm itself runs in the glue after the rule (`ops.rwkv7.glue_output`, `fused_update`)."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        eps: float,
        start: int,
        total_heads: int,
        tp: TensorParallel,
    ) -> None:
        """Args: `heads` this rank's, from head `start` of `total_heads`."""
        super().__init__()
        self.heads, self.eps = heads, eps
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(heads * head_dim))
        if tp.size > 1:
            part = [(start * head_dim, heads * head_dim)]
            for name in ("weight", "bias"):
                shard_param(self, name, 0, part, total_heads * head_dim)


class Rwkv7TimeMix(StatefulLayer):
    """RWKV-7's time mix (see the module docstring)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        head_dim: int,
        value_dim: int,
        ranks: dict[str, int],
        layer_idx: int,
        group_norm_eps: float,
        value_first: ValueFirst,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Args: `ranks` the LoRA ranks by name (`w`, `a`, `v`, `g`); `value_dim` the width of
        v over all heads; `value_first` the model's shared holder of layer 0's value."""
        super().__init__()
        if hidden_size % head_dim:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be a multiple of head_dim ({head_dim})"
            )
        heads = hidden_size // head_dim
        if value_dim % heads:
            raise ValueError(f"value_dim ({value_dim}) must be a multiple of the heads ({heads})")
        start, local = tp.range(heads, "RWKV-7 heads (hidden_size / head_dim)")
        self.ops = ops
        self.wkv = ops.family(rwkv7_ops.FAMILY)
        # decode rows: the backend's fused glue, else its one-token rule inside tensor ops
        self.fused_decode = has_own_op(rwkv7_ops.FAMILY, ops.name, "fused_update")
        # decode-only steps of a few rows: the whole decoder layer in one call (`rwkv7_decode`)
        self.fused_layer = has_own_op(rwkv7_ops.FAMILY, ops.name, "decode_layer")
        self.layer_idx, self.value_first = layer_idx, value_first
        self.heads, self.head_dim, self.head_v_dim = local, head_dim, value_dim // heads
        self.hidden_size = hidden_size
        for name in MIXES:
            self.register_parameter(name, nn.Parameter(torch.zeros(1, 1, hidden_size)))
        key_dim = hidden_size
        self.k_k = nn.Parameter(torch.zeros(local * head_dim))
        self.k_a = nn.Parameter(torch.zeros(local * head_dim))
        self.r_k = nn.Parameter(torch.zeros(local, head_dim))
        self.r_proj = column_linear(hidden_size, [key_dim], False, ops, tp)
        self.k_proj = column_linear(hidden_size, [key_dim], False, ops, tp)
        self.v_proj = column_linear(hidden_size, [value_dim], False, ops, tp)
        self.o_proj = row_linear(value_dim, hidden_size, False, ops, tp)
        self.w_lora = LoRA(hidden_size, key_dim, ranks["w"], True, "tanh", ops, tp)
        if layer_idx != 0:
            self.v_lora = LoRA(hidden_size, value_dim, ranks["v"], True, None, ops, tp)
        self.a_lora = LoRA(hidden_size, key_dim, ranks["a"], True, None, ops, tp)
        self.g_lora = LoRA(hidden_size, value_dim, ranks["g"], False, "sigmoid", ops, tp)
        self.register_buffer("mixes", torch.empty(0), persistent=False)
        self.g_norm = HeadGroupNorm(local, self.head_v_dim, group_norm_eps, start, heads, tp)
        if tp.size > 1:
            keys = [(start * head_dim, local * head_dim)]
            shard_param(self, "k_k", 0, keys, key_dim)
            shard_param(self, "k_a", 0, keys, key_dim)
            shard_param(self, "r_k", 0, [(start, local)], heads)

    def process_weights_after_loading(self) -> None:
        """Stacks the six shift mixes into `mixes (6, 1, H)`."""
        self.mixes = torch.cat([getattr(self, n).detach() for n in MIXES]).view(6, 1, -1)

    def state_spec(self) -> StateSpec:
        """`shift (H,)` in the model dtype and `wkv (NH, Dv, Dk)`."""
        return StateSpec(
            (
                StateTensor("shift", (self.hidden_size,), "conv"),
                StateTensor("wkv", (self.heads, self.head_v_dim, self.head_dim), "recurrent"),
            )
        )

    def fused_layer_step(self, layer: nn.Module) -> FusedStep | None:
        """The whole decoder layer's decode-only steps in one fused call, planned once; None
        where that does not apply (`layers.rwkv7_decode`)."""
        return rwkv7_decode.plan_layer(self, layer)

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `x (T, H)` (the normed input), advancing `shift` and `wkv` in place.

        Decode rows run the glue around the rule as one fused op (`fused_update`) where the
        backend has one, else as tensor ops around its one-token rule; prefill chunks as tensor
        ops around the chunked rule (`glue_inputs`, `varlen`, `glue_output`).

        Returns:
            `(T, H)` in the model dtype.
        """
        mixed = shift_mix(x, self.state["shift"], self.mixes, meta, self.wkv)  # (6, T, H)
        xr, xw, xk, xv, xa, xg = mixed.unbind(0)  # (T, H) each
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)  # (T, C), (T, C), (T, CV)
        w, a = self.w_lora(xw), self.a_lora(xa)  # (T, C) raw: the sigmoids are in the glue
        g = self.g_lora(xg)  # (T, CV)
        if self.layer_idx == 0:
            self.value_first.value = v
            v_first = v_gate = None
        else:
            v_first = self.value_first.value
            assert v_first is not None, "RWKV-7 layer 0 must run before the others"
            v_gate = self.v_lora(xv)  # (T, CV) raw
        states = self.state["wkv"]  # (S, NH, Dv, Dk)
        consts = (self.k_k, self.k_a)
        norm = (self.r_k, self.g_norm.weight, self.g_norm.bias, self.g_norm.eps)

        def decode(rows: slice, slots: torch.Tensor) -> torch.Tensor:
            first = None if v_first is None else v_first[rows]
            gate = None if v_gate is None else v_gate[rows]
            if self.fused_decode:
                return self.wkv.fused_update(
                    r[rows], w[rows], k[rows], v[rows], a[rows], g[rows], first, gate, *consts,
                    *norm, states, slots,
                )  # fmt: skip
            rh, wh, kh, vh, ah, bh = rwkv7_ops.glue_inputs(
                r[rows], w[rows], k[rows], v[rows], a[rows], first, gate, *consts, self.head_dim
            )
            o = self.wkv.update(rh, wh, kh, vh, ah, bh, states, slots)
            return rwkv7_ops.glue_output(o, rh, kh, vh, g[rows], *norm)

        def prefill(p: slice) -> torch.Tensor:
            first = None if v_first is None else v_first[p]
            gate = None if v_gate is None else v_gate[p]
            rh, wh, kh, vh, ah, bh = rwkv7_ops.glue_inputs(
                r[p], w[p], k[p], v[p], a[p], first, gate, *consts, self.head_dim
            )
            o = self.wkv.varlen(
                rh, wh, kh, vh, ah, bh, states, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state,
            )  # fmt: skip
            return rwkv7_ops.glue_output(o, rh, kh, vh, g[p], *norm)

        o = recurrent_step(meta, [states], decode=decode, prefill=prefill)  # (T, CV)
        return self.o_proj(o)


class Rwkv7ChannelMix(StatefulLayer):
    """RWKV-7's channel mix: `value(relu(key(x + (x' - x) * x_k)) ** 2)`."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, ops: MambaOps, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.wkv = ops.family(rwkv7_ops.FAMILY)  # its `shift_mix` runs the decode rows
        self.x_k = nn.Parameter(torch.zeros(hidden_size))
        self.key = column_linear(hidden_size, [intermediate_size], False, ops, tp)
        self.value = row_linear(intermediate_size, hidden_size, False, ops, tp)

    def state_spec(self) -> StateSpec:
        """`shift (H,)`: the previous token's normed input, in the model dtype."""
        return StateSpec((StateTensor("shift", (self.hidden_size,), "conv"),))

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`, advancing `shift` in place."""
        mixed = shift_mix(x, self.state["shift"], self.x_k.view(1, 1, -1), meta, self.wkv)[0]
        hidden = torch.relu(self.key(mixed)).square()  # (T, F)
        return self.value(hidden)
