"""`MLSTMLayer`: xLSTM's mLSTM mixer (`mlstm_layer`) over one flat varlen batch.

    q, k = q(x), k(x) per head                     # (T, NH, Dk) each
    v = v(x) per head                              # (T, NH, Dv)
    i, f = cap(igate_preact(x)), cap(fgate_preact(x))   # (T, NH), cap = c tanh(. / c)
    h = mlstm(q, k, v, i, f)                       # ops family `mlstm`: exponential gates,
                                                   # matrix memory, stabilised normaliser
    y = out_proj(sigmoid(ogate_preact(x)) * multihead_norm(h))

`c` is the config's `gate_soft_cap`; `multihead_norm` is a LayerNorm over each head's `Dv`
channels (statistics in float32, epsilon `norm_eps`) with one weight (and, with `use_bias`, one
bias) over all heads. The cell's own epsilon (`eps`) is the denominator's (`ops.mlstm`).

Checkpoint names (`backbone.blocks.N.mlstm_layer.*`, `weight_mode="single"`): `q`, `k`
`(NH Dk, H)`, `v`, `ogate_preact` `(NH Dv, H)`, `igate_preact`, `fgate_preact` `(NH, H)` with
biases, `multihead_norm.weight (NH Dv,)`, `out_proj (H, NH Dv)`; with `use_bias` every
projection and the norm have biases.

Per-sequence state (`state_spec`): `C (NH, Dk, Dv)`, `n (NH, Dk)` (float32 unless
`ssm_state_dtype` says otherwise) and `m (NH,)` (always float32: the stabiliser is a log
scale). Decode rows, speculative waves, padding and prefill chunks go through the one
recurrent step (`layers.recurrent_step`).

Tensor parallelism (`tp`): each rank holds NH / N heads: their rows of the six input
projections (column-parallel), their channels of the norm, and their input columns of
`out_proj` (row-parallel, all-reduced).

Glossary: T tokens in the step, H hidden size, NH heads (this rank's), Dk query / key head
dim, Dv value head dim, N ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.ops import mlstm as mlstm_ops
from vllm_mamba.ops.table import MambaOps


class HeadLayerNorm(nn.Module):
    """A LayerNorm over each head's channels (biased variance, statistics in float32, cast to
    the input's dtype before the affine part) with one weight and optional bias over all
    heads, sharded by heads."""

    def __init__(
        self, heads: int, head_dim: int, eps: float, bias: bool, first: int, tp: TensorParallel
    ) -> None:
        """Args: `heads` this rank's, from head `first` of `heads * tp.size`."""
        super().__init__()
        self.eps = eps
        width = heads * head_dim
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None
        if tp.size > 1:
            for name in ("weight", "bias") if bias else ("weight",):
                shard_param(self, name, 0, [(first * head_dim, width)], width * tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, NH, Dv)` -> `(T, NH Dv)` in x's dtype."""
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = xf.var(-1, keepdim=True, unbiased=False)
        y = ((xf - mean) * torch.rsqrt(var + self.eps)).to(x.dtype).flatten(1)
        y = y * self.weight
        return y if self.bias is None else y + self.bias


class MLSTMLayer(StatefulLayer):
    """The mLSTM mixer (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        *,
        use_bias: bool,
        gate_soft_cap: float,
        norm_eps: float,
        eps: float,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if qk_dim % num_heads or v_dim % num_heads:
            raise ValueError(
                f"the query/key ({qk_dim}) and value ({v_dim}) widths must be multiples of "
                f"num_heads ({num_heads})"
            )
        heads = tp.split(num_heads, "num_heads")  # this rank's
        self.heads, self.dk, self.dv = heads, qk_dim // num_heads, v_dim // num_heads
        self.gate_soft_cap, self.eps = gate_soft_cap, eps
        self.cell = ops.family(mlstm_ops.FAMILY)
        self.q = column_linear(hidden_size, [qk_dim], use_bias, ops, tp)
        self.k = column_linear(hidden_size, [qk_dim], use_bias, ops, tp)
        self.v = column_linear(hidden_size, [v_dim], use_bias, ops, tp)
        self.ogate_preact = column_linear(hidden_size, [v_dim], use_bias, ops, tp)
        self.igate_preact = column_linear(hidden_size, [num_heads], True, ops, tp)
        self.fgate_preact = column_linear(hidden_size, [num_heads], True, ops, tp)
        self.multihead_norm = HeadLayerNorm(heads, self.dv, norm_eps, use_bias, tp.rank * heads, tp)
        self.out_proj = row_linear(v_dim, hidden_size, use_bias, ops, tp)

    def state_spec(self) -> StateSpec:
        """`C (NH, Dk, Dv)`, `n (NH, Dk)` and `m (NH,)` (float32)."""
        return StateSpec(
            (
                StateTensor("C", (self.heads, self.dk, self.dv)),
                StateTensor("n", (self.heads, self.dk)),
                StateTensor("m", (self.heads,), dtype=torch.float32),
            )
        )

    def _gate(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A gate's pre-activation `(T, NH)`, soft-capped."""
        cap = self.gate_soft_cap
        return cap * torch.tanh(proj(x) / cap)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Mixes `hidden (T, H)`, advancing each sequence's `C`, `n` and `m` in place.

        Returns:
            `(T, H)` in the model dtype.
        """
        rows = hidden.shape[0]
        q = self.q(hidden).view(rows, self.heads, self.dk)
        k = self.k(hidden).view(rows, self.heads, self.dk)
        v = self.v(hidden).view(rows, self.heads, self.dv)
        i, f = self._gate(self.igate_preact, hidden), self._gate(self.fgate_preact, hidden)
        c, n, m = self.state["C"], self.state["n"], self.state["m"]
        h = recurrent_step(  # (T, NH, Dv)
            meta, [c, n, m],
            decode=lambda r, slots: self.cell.update(
                q=q[r], k=k[r], v=v[r], igate=i[r], fgate=f[r], c_states=c, n_states=n,
                m_states=m, state_indices=slots, eps=self.eps,
            ),
            prefill=lambda r: self.cell.varlen(
                q=q[r], k=k[r], v=v[r], igate=i[r], fgate=f[r], c_states=c, n_states=n,
                m_states=m, query_start_loc=meta.prefill_query_start_loc,
                state_indices=meta.prefill_state_indices,
                has_initial_state=meta.prefill_has_initial_state, eps=self.eps,
            ),
        )  # fmt: skip
        gated = torch.sigmoid(self.ogate_preact(hidden)) * self.multihead_norm(h)  # (T, NH Dv)
        return self.out_proj(gated)


__all__ = ["HeadLayerNorm", "MLSTMLayer"]
