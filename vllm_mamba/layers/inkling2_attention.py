"""`Inkling2Attention`: one attention layer of Inkling 2 (sliding or full), over the paged KV
cache with its relative-position bias and sinks (`layers.relative_bias_attention`).

Inputs: `xq` (the queries', the relative bias's, the sinks' and the output gate's), `xk`, `xv`
(the keys' and values'; all three the same normed hidden state in a sliding layer). Per head:

    q = clip(q_proj.norm.scale * q_proj.linear(xq))              # to `qk_l2_clip_threshold`
    k = clip(k_proj.sconv(k_proj.linear(xk)))
    v = rms(v_proj.sconv(v_proj.linear(xv)))                      # weightless RMSNorm
    r = clip(bias.norm.scale * bias.linear(xq))                   # to `rel_l2_clip_threshold`
    rel = r @ bias.proj                                           # (E,) bias by distance
    sink = sink_proj(xq)                                          # one logit per head
    out = o_proj.linear(attention(q, k, v, rel, sink) * sigmoid(o_proj.gate_proj(xq)))

(`bias` is `relative_position_bias`.)

`clip(x)` scales a head vector down to the threshold when its L2 norm exceeds it
(`x * min(1, t / (|x| + 1e-6))`), in float32. The softmax scale is `D ** -0.5`. Sliding layers
(`swa_*` heads) read the last `sliding_window_size` keys with a bias extent of that window, and
their convs are static (`ResidualShortConv`, divided by `sqrt(K + 1)`); full layers read every
key with a bias extent of `rel_extent`, their key/value convs take per-token taps from `xk` /
`xv` (`DynamicShortConv`), and their queries and relative states are also scaled by
`tau = 1 + alpha * log(max((p + 1) / n_floor, 1))` at position p after the clip.

Tensor parallelism: by heads (queries, relative states, sinks and gates with their heads; keys
and values with theirs, replicated where there are fewer than ranks), `o_proj.linear`
row-parallel; the bias table `proj` replicated.

Glossary: T tokens, H hidden size, Hq / Hkv query / key-value heads, D head dim, E extent.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.dynamic_short_conv import DynamicShortConv
from vllm_mamba.layers.layernorm import weightless_rms_norm
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, shard_param
from vllm_mamba.layers.relative_bias_attention import log_scale
from vllm_mamba.layers.residual_short_conv import ResidualShortConv
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops.table import MambaOps

CLIP_EPS = 1e-6  # added to the norm before dividing the threshold by it


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each vector of `x (..., D)` scaled down to L2 norm `threshold` where longer (float32)."""
    xf = x.float()
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    return xf * (threshold / (norm + CLIP_EPS)).clamp(max=1.0)


class ScaledL2Clip(nn.Module):
    """`scale (heads, D)` then `l2_clip`, then (full layers) the log scaling by position."""

    def __init__(
        self, heads: int, dim: int, threshold: float, log_scaling: tuple[int, float] | None,
        tp: TensorParallel,
    ) -> None:  # fmt: skip
        super().__init__()
        start, local = tp.range(heads, "num_attention_heads")
        self.scale = nn.Parameter(torch.empty(local, dim))
        if tp.size > 1:
            shard_param(self, "scale", 0, [(start, local)], heads)
        self.threshold, self.log_scaling = threshold, log_scaling

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`x (T, heads, D)` -> `(T, heads, D)` in x's dtype."""
        out = l2_clip(x.float() * self.scale.float(), self.threshold).to(x.dtype)
        if self.log_scaling is None:
            return out
        tau = log_scale(positions, *self.log_scaling)[:, None, None]  # (T, 1, 1)
        return (out.float() * tau).to(x.dtype)


class Inkling2Attention(nn.Module):
    """One Inkling 2 attention layer (see the module docstring)."""

    def __init__(
        self, config: Any, sliding: bool, ops: MambaOps, tp: TensorParallel, passes: int = 1
    ) -> None:
        """Args: `passes` how many times a step runs the layer (a looped layer: a KV cache and
        conv histories per pass)."""
        super().__init__()
        hidden, kernel = config.hidden_size, config.conv_kernel_size
        prefix = "swa_" if sliding else ""
        heads = getattr(config, f"{prefix}num_attention_heads")
        kv_heads = getattr(config, f"{prefix}num_key_value_heads")
        d = self.head_dim = getattr(config, f"{prefix}head_dim")
        floor = None if sliding else config.log_scaling_n_floor
        log_scaling = None if floor is None else (int(floor), float(config.log_scaling_alpha))
        self.clip, self.eps = float(config.qk_l2_clip_threshold), float(config.rms_norm_eps)
        kv_ranges, local_kv = kv_head_ranges(kv_heads, d, tp)
        first = kv_ranges[0][0] // d if kv_ranges else tp.range(kv_heads, "kv heads")[0]
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Module() for _ in range(4))
        self.q_proj.linear = column_linear(hidden, [heads * d], False, ops, tp)
        self.q_proj.norm = ScaledL2Clip(heads, d, self.clip, log_scaling, tp)
        for proj in (self.k_proj, self.v_proj):
            proj.linear = column_linear(hidden, [kv_heads * d], False, ops, tp, kv_ranges)
            if sliding:
                ranges = None if tp.size == 1 else [(first * d, local_kv * d)]
                proj.sconv = ResidualShortConv(
                    kv_heads * d, kernel, ops, out_divisor=math.sqrt(kernel + 1), ranges=ranges,
                    passes=passes,
                )  # fmt: skip
            else:
                proj.sconv = DynamicShortConv(
                    hidden, kv_heads, d, kernel, ops, tp, (first, local_kv), passes
                )
        self.o_proj.gate_proj = column_linear(hidden, [heads * d], False, ops, tp)
        self.o_proj.linear = row_linear(heads * d, hidden, False, ops, tp)
        self.sink_proj = column_linear(hidden, [heads], False, ops, tp)
        extent = config.sliding_window_size if sliding else config.rel_extent
        bias = self.relative_position_bias = nn.Module()
        bias.linear = column_linear(hidden, [heads * config.d_rel], False, ops, tp)
        bias.norm = ScaledL2Clip(
            heads, config.d_rel, float(config.rel_l2_clip_threshold), log_scaling, tp
        )
        bias.proj = nn.Parameter(torch.empty(config.d_rel, extent))
        window = config.sliding_window_size if sliding else None
        local_heads = tp.split(heads, "num_attention_heads")
        self.attn = nn.ModuleList(  # one KV cache per pass
            PagedAttention(local_heads, local_kv, d, d**-0.5, ops, window) for _ in range(passes)
        )
        self.dynamic = not sliding

    def forward(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        xv: torch.Tensor,
        meta: PagedMetadata,
        pass_index: int = 0,
    ) -> torch.Tensor:
        """`xq`, `xk`, `xv (T, H)` -> `(T, H)`; the conv histories and the KV cache of pass
        `pass_index` advanced."""
        num_tokens, d, pos = xq.shape[0], self.head_dim, meta.positions
        q = self.q_proj.norm(self.q_proj.linear(xq).view(num_tokens, -1, d), pos)  # (T, Hq, D)
        k = self._conv(self.k_proj, xk, meta, pass_index)  # (T, Hkv, D)
        v = self._conv(self.v_proj, xv, meta, pass_index)
        k = l2_clip(k, self.clip).to(k.dtype)  # (T, Hkv, D)
        v = weightless_rms_norm(v, self.eps)
        bias = self.relative_position_bias
        rel_states = bias.linear(xq).view(num_tokens, q.shape[1], -1)  # (T, Hq, d_rel)
        rel = bias.norm(rel_states, pos) @ bias.proj  # (T, Hq, E)
        out = self.attn[pass_index](q, k, v, meta, rel=rel, sinks=self.sink_proj(xq))  # (T, Hq D)
        gate = rowwise(torch.sigmoid, self.o_proj.gate_proj(xq).float())  # each row as alone
        return self.o_proj.linear((out.float() * gate).to(out.dtype))

    def _conv(
        self, proj: nn.Module, x: torch.Tensor, meta: PagedMetadata, pass_index: int
    ) -> torch.Tensor:
        """A key or value projection of `x (T, H)` through its conv -> `(T, Hkv, D)`."""
        states = proj.linear(x)
        if self.dynamic:
            states = proj.sconv(states, x, meta, pass_index)
        else:
            states = proj.sconv(states, meta, pass_index)
        return states.view(x.shape[0], -1, self.head_dim)
