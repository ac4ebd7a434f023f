"""RWKV-4 time mix and channel mix over one flat varlen batch (decodes first, then prefill
chunks), under transformers' names (`RwkvSelfAttention`, `RwkvFeedForward`).

Time mix (`attention`), per token with `x` its normed input and `x'` the previous token's:

    x_k, x_v, x_r = x * mu_* + x' * (1 - mu_*)       token shift, 3 mixes (`time_mix_*`)
    k, v, r = key(x_k), value(x_v), sigmoid(receptance(x_r))
    o = wkv(w = -exp(time_decay), u = time_first, k, v)   the op family `rwkv4`
    out = output(r * o)

Channel mix (`feed_forward`):

    x_k, x_r = x * mu_* + x' * (1 - mu_*)            its own token shift, 2 mixes
    out = sigmoid(receptance(x_r)) * value(relu(key(x_k)) ** 2)

The mixes run as `x + (x' - x) * (1 - mu)` (`layers.token_shift`, the decode rows through the
`rwkv7` family's fused `shift_mix`), with `1 - mu` stacked once after loading.

Per-sequence state: each part's `shift (H,)` (the previous token's normed input, kind `conv`,
model dtype) and the time mix's `num`, `den`, `max` `(A,)` (the WKV's running numerator and
denominator divided by `exp(max)`), declared float32 so a bfloat16 or float16 model keeps its
WKV state in float32. A fresh slot holds zeros, not the reference's `max = -1e38`: the kernels
never read a slot whose chunk has no initial state (`has_initial_state` false, they start from
`(0, 0, MAX_INIT)`), decode rows only run on slots a prefill has written, and forks, prefix
snapshots and speculative rollbacks copy all three tensors; so the zeros are never used.

`rescale` (transformers' `rescale_every`, see `models.rwkv4`) divides the `output` and channel
mix `value` weights by a power of two after loading.

Tensor parallelism (`tp`) is by channels: each rank holds A/N of the time mix's `key`,
`value`, `receptance` rows, `time_decay`, `time_first` and WKV state, and the matching input
columns of `output` (row-parallel); the channel mix's `key` is column-parallel and its `value`
row-parallel, its `receptance` (H -> H, gating the reduced output) is replicated. The shift
states and mixes are kept whole on every rank.

Glossary: T tokens in the step, H hidden size, A the time mix's channels on this rank
(`attention_hidden_size / N`), F the channel mix's width, S state slots.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.token_shift import shift_mix
from vllm_mamba.ops import rwkv4 as rwkv4_ops
from vllm_mamba.ops import rwkv7 as rwkv7_ops
from vllm_mamba.ops.table import MambaOps

TIME_MIXES = ("time_mix_key", "time_mix_value", "time_mix_receptance")
CHANNEL_MIXES = ("time_mix_key", "time_mix_receptance")
WKV_STATES = ("num", "den", "max")  # the time mix's float32 WKV state, in the ops' order


def _stack_mixes(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """`1 - mu` of each of `names` (`(1, 1, H)` parameters) as `(M, 1, H)`, the weight of the
    previous token in `x + (x' - x) * (1 - mu)`."""
    mus = torch.cat([getattr(module, n).detach().reshape(1, 1, -1) for n in names])
    return 1 - mus


class Rwkv4TimeMix(StatefulLayer):
    """RWKV-4's time mix (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        attention_size: int,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        rescale: int = 1,
    ) -> None:
        """Args: `attention_size` the WKV's channels over all ranks (`attention_hidden_size`);
        `rescale` the power of two the `output` weight is divided by after loading."""
        super().__init__()
        start, local = tp.range(attention_size, "RWKV-4 attention_hidden_size")
        self.hidden_size, self.channels, self.rescale = hidden_size, local, rescale
        self.wkv = ops.family(rwkv4_ops.FAMILY)
        self.shift_ops = ops.family(rwkv7_ops.FAMILY)  # its `shift_mix` runs the decode rows
        self.time_decay = nn.Parameter(torch.zeros(local))
        self.time_first = nn.Parameter(torch.zeros(local))
        for name in TIME_MIXES:
            self.register_parameter(name, nn.Parameter(torch.zeros(1, 1, hidden_size)))
        self.key = column_linear(hidden_size, [attention_size], False, ops, tp)
        self.value = column_linear(hidden_size, [attention_size], False, ops, tp)
        self.receptance = column_linear(hidden_size, [attention_size], False, ops, tp)
        self.output = row_linear(attention_size, hidden_size, False, ops, tp)
        self.register_buffer("mixes", torch.empty(0), persistent=False)  # (3, 1, H)
        self.register_buffer("w", torch.empty(0), persistent=False)  # (A,) float32
        self.register_buffer("u", torch.empty(0), persistent=False)  # (A,) float32
        if tp.size > 1:
            for name in ("time_decay", "time_first"):
                shard_param(self, name, 0, [(start, local)], attention_size)

    def process_weights_after_loading(self) -> None:
        """Stacks `1 - mu` of the three mixes, takes `w = -exp(time_decay)` and `u` in float32
        and divides the `output` weight by `rescale`."""
        self.mixes = _stack_mixes(self, TIME_MIXES)
        self.w = -torch.exp(self.time_decay.detach().float())
        self.u = self.time_first.detach().float()
        if self.rescale != 1:
            with torch.no_grad():
                self.output.weight.div_(self.rescale)

    def state_spec(self) -> StateSpec:
        """`shift (H,)` in the model dtype; `num`, `den`, `max` `(A,)` float32."""
        wkv = [StateTensor(n, (self.channels,), "recurrent", torch.float32) for n in WKV_STATES]
        return StateSpec((StateTensor("shift", (self.hidden_size,), "conv"), *wkv))

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `x (T, H)` (the normed input), advancing `shift` and the WKV state in place.

        Returns:
            `(T, H)` in x's dtype.
        """
        mixed = shift_mix(x, self.state["shift"], self.mixes, meta, self.shift_ops)  # (3, T, H)
        xk, xv, xr = mixed.unbind(0)  # (T, H) each
        k, v = self.key(xk), self.value(xv)  # (T, A)
        r = torch.sigmoid(self.receptance(xr))  # (T, A)
        states = [self.state[n] for n in WKV_STATES]  # (S, A) float32 each
        o = recurrent_step(  # (T, A)
            meta, states,
            decode=lambda rows, slots: self.wkv.update(
                self.w, self.u, k[rows], v[rows], *states, slots
            ),
            prefill=lambda p: self.wkv.varlen(
                self.w, self.u, k[p], v[p], *states, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state,
            ),
        )  # fmt: skip
        return self.output(r * o)


class Rwkv4ChannelMix(StatefulLayer):
    """RWKV-4's channel mix: `sigmoid(receptance(x_r)) * value(relu(key(x_k)) ** 2)`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        rescale: int = 1,
    ) -> None:
        """Args: `rescale` the power of two the `value` weight is divided by after loading."""
        super().__init__()
        self.hidden_size, self.rescale = hidden_size, rescale
        self.shift_ops = ops.family(rwkv7_ops.FAMILY)
        for name in CHANNEL_MIXES:
            self.register_parameter(name, nn.Parameter(torch.zeros(1, 1, hidden_size)))
        self.key = column_linear(hidden_size, [intermediate_size], False, ops, tp)
        self.receptance = Linear(hidden_size, hidden_size, False, ops)  # replicated
        self.value = row_linear(intermediate_size, hidden_size, False, ops, tp)
        self.register_buffer("mixes", torch.empty(0), persistent=False)  # (2, 1, H)

    def process_weights_after_loading(self) -> None:
        """Stacks `1 - mu` of the two mixes and divides the `value` weight by `rescale`."""
        self.mixes = _stack_mixes(self, CHANNEL_MIXES)
        if self.rescale != 1:
            with torch.no_grad():
                self.value.weight.div_(self.rescale)

    def state_spec(self) -> StateSpec:
        """`shift (H,)`: the previous token's normed input, in the model dtype."""
        return StateSpec((StateTensor("shift", (self.hidden_size,), "conv"),))

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`, advancing `shift` in place."""
        mixed = shift_mix(x, self.state["shift"], self.mixes, meta, self.shift_ops)  # (2, T, H)
        xk, xr = mixed.unbind(0)
        hidden = torch.relu(self.key(xk)).square()  # (T, F)
        return torch.sigmoid(self.receptance(xr)) * self.value(hidden)
