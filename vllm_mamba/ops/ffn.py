"""The `ffn` op family: a decoder layer's feed-forward stage for a few rows in one kernel call.

`mlp_decode` is `h + rm * GatedMLP(rms_norm(h))` and `moe_decode` is `h + rm * (routed
experts + shared expert)(rms_norm(h))` (C++: `torch.ops.vllm_mamba.fused_mlp_decode` /
`fused_moe_decode`, `csrc/fused_decode_ffn.cpp`, bound in `vllm_mamba.ops.cpu_kernels`): up to
`MAX_ROWS` rows, weight-streaming products inside one parallel region, the MoE's router, top-k,
chosen experts and shared expert without a Python loop. Their references below compose the
unfused math (`F.linear` in float32 on the weights as stored, int8 and 4-bit dequantised), so the
two paths have one definition; the layers plan them in `layers.mlp.plan_mlp` /
`layers.moe.plan_moe`.

`moe_experts` is an MoE's routed experts alone, `sum_j w[t, j] * expert_{ids[t, j]}(x[t])`, for
any number of rows (C++: `torch.ops.vllm_mamba.moe_experts`, `csrc/moe_experts.cpp`): the
prefill, batched and mixed steps the decode kernel does not take, each chosen expert's rows
together and its products as GEMMs in one call (`layers.moe.plan_grouped_experts`), where the
unfused layer gathers, multiplies and scatters expert by expert from Python.

`params` is a list of tensors in a fixed order (`MLP_PARAMS`, `MOE_PARAMS`; absent optional
entries None). The norm weight is the float32 vector the norm multiplies by (`w` for `RMSNorm`,
`1 + w` for `ZeroCenteredRMSNorm`). Each projection weight (`*_w`) is float32, bfloat16, int8
with its per-row float32 scale in the matching `*_scale` entry, or 4-bit (uint8 `(rows, cols/2)`
with `(rows, cols/32)` float16 group scales); a gate weight with no up weight is the merged
`[gate | up]` one. The MoE's experts are stacked: `experts_gate_up_w (E * 2I, H)` (expert e's
gate rows then its up rows) and `experts_down_w (E * H, I)`.

Routers (`router_kind`): 0, softmax over the E logits, top-k by logit, weights renormalised over
the k when `renormalize` (Qwen3-Next, Qwen3.5-MoE; top-k-then-softmax, Granite, is the same with
`renormalize`); 1, sigmoid scores, chosen by score plus `router_bias` among the best `topk_group`
of `n_group` groups (a group scored by its two best), weighted by the scores, divided by their
sum plus `renorm_eps` when `renormalize`, times `scaling`. Ties of the top-k: the larger value
first, equal values in ascending expert (group) id, where torch.topk leaves their order open.
The chosen experts are summed in ascending expert id (`layers.moe.dispatch_experts`' order).

`act` is a code of `ACT_CODES`. Every row's products are independent of the other rows (a
speculative chain's rows equal its tokens decoded one by one); `int_dot` asks for integer dot
products of int8 / 4-bit weights (`fused::Weight::int_dot`; the references multiply the same
weights with x quantised to int8 blocks, `fused_decode._linear`; float weights ignore it).

Glossary: B rows, H hidden, I expert (or MLP) width, S shared-expert width, E experts, k experts
per token.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.fused_decode import _linear, _rms_norm

Tensor = torch.Tensor
Params = list[torch.Tensor | None]

MAX_ROWS = 8  # rows one call takes (`fused::kGemvMaxBatch`)
ACT_CODES = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu": 2, "relu": 3, "relu2": 4}
ROUTER_SOFTMAX, ROUTER_SIGMOID = 0, 1

MLP_PARAMS = ("norm_w", "gate_w", "up_w", "down_w", "gate_scale", "up_scale", "down_scale")
MOE_PARAMS = (
    "norm_w", "router_w", "router_bias", "experts_gate_up_w", "experts_down_w", "shared_gate_w",
    "shared_up_w", "shared_down_w", "shared_expert_gate_w", "router_scale",
    "experts_gate_up_scale", "experts_down_scale", "shared_gate_scale", "shared_up_scale",
    "shared_down_scale", "shared_expert_gate_scale",
)  # fmt: skip
EXPERT_PARAMS = ("gate_up_w", "down_w", "gate_up_scale", "down_scale")
# `params` by name, in the order of the C++ index constants (`MlpParam`, `MoeParam`).
MlpParams = NamedTuple("MlpParams", [(n, "Tensor | None") for n in MLP_PARAMS])
MoeParams = NamedTuple("MoeParams", [(n, "Tensor | None") for n in MOE_PARAMS])


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_ACTS = (F.silu, partial(F.gelu, approximate="tanh"), F.gelu, F.relu, _relu2)


def _gated(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor | None,
    down_w: torch.Tensor,
    scales: tuple[torch.Tensor | None, ...],
    act: int,
    gate_multiplier: float = 1.0,
    clip: float = 0.0,
    clip_before_act: bool = False,
    int_dot: bool = False,
) -> torch.Tensor:
    """`down(act(gate(x) * gm) * up(x))` in float32; `up_w` None: `gate_w` is `[gate | up]`;
    `clip` > 0: `up` clipped to +-clip and the gate to at most `clip` before the activation
    (`clip_before_act`) or after it (`layers.clamped_swiglu`); `int_dot`: the int8 / 4-bit
    products on int8-quantised inputs (`fused_decode._linear`)."""
    gate_scale, up_scale, down_scale = scales
    if up_w is None:
        gate, up = _linear(x, gate_w, None, gate_scale, int_dot).chunk(2, dim=-1)
    else:
        gate = _linear(x, gate_w, None, gate_scale, int_dot)
        up = _linear(x, up_w, None, up_scale, int_dot)
    if gate_multiplier != 1.0:
        gate = gate * gate_multiplier
    if not clip:
        return _linear(_ACTS[act](gate) * up, down_w, None, down_scale, int_dot)
    if clip_before_act:
        activated = _ACTS[act](gate.clamp(max=clip))
    else:
        activated = _ACTS[act](gate).clamp(max=clip)
    return _linear(activated * up.clamp(-clip, clip), down_w, None, down_scale, int_dot)


def fused_mlp_decode_ref(
    hidden: torch.Tensor,
    params: Params,
    norm_eps: float,
    act: int,
    gate_multiplier: float,
    down_multiplier: float,
    residual_multiplier: float,
    out_dtype: torch.dtype,
    int_dot: bool = False,
    residual: bool = True,
    clip: float = 0.0,
    clip_before_act: bool = False,
) -> torch.Tensor:
    """`hidden + rm * GatedMLP(rms_norm(hidden))` for `hidden (B, H)`, math in float32; without
    `residual` `rm * GatedMLP(...)` alone, with no norm weight on `hidden` itself, the SwiGLU
    clipped by `clip` (before the activation with `clip_before_act`; 0: none) as `_gated`.

    Args:
        params: `MLP_PARAMS`: norm_w `(H,)`, gate_w `(I, H)` (or `(2I, H)` `[gate | up]` with
            up_w None), up_w `(I, H)`, down_w `(H, I)`, and their scales.
        norm_eps: the norm's epsilon; act: a code of `ACT_CODES`.
        gate_multiplier, down_multiplier: the MLP's muP multipliers; residual_multiplier: the
            layer's (`rm`).
        out_dtype: the result's dtype.
    """
    p = MlpParams(*params)
    x = hidden.float()
    scales = (p.gate_scale, p.up_scale, p.down_scale)
    xn = x if p.norm_w is None else _rms_norm(x, p.norm_w, norm_eps)
    y = _gated(xn, p.gate_w, p.up_w, p.down_w, scales, act, gate_multiplier, clip,
               clip_before_act, int_dot)  # fmt: skip
    if down_multiplier != 1.0:
        y = y * down_multiplier
    y = y if residual_multiplier == 1.0 else y * residual_multiplier
    return (x + y if residual else y).to(out_dtype)


def route_ref(
    logits: torch.Tensor,
    top_k: int,
    router_kind: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
    renorm_eps: float,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits (B, E)` float32 -> weights `(B, k)` float32 and expert ids `(B, k)` (see the
    module docstring; ties by stable sorts: ascending id)."""

    def best(v: torch.Tensor, k: int) -> torch.Tensor:
        return torch.sort(v, dim=-1, descending=True, stable=True)[1][..., :k]

    if router_kind == ROUTER_SOFTMAX:
        probs = logits.softmax(dim=-1)
        chosen = best(logits, top_k)
        weights = probs.gather(1, chosen)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen
    scores = logits.sigmoid()
    choice = scores + bias if bias is not None else scores
    if n_group > 1:
        rows, experts = choice.shape
        grouped = choice.view(rows, n_group, experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (B, n_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, best(group_scores, topk_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // n_group, 1), -torch.inf)
    chosen = best(choice, top_k)
    weights = scores.gather(1, chosen)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + renorm_eps)
    return weights * scaling, chosen


def fused_moe_decode_ref(
    hidden: torch.Tensor,
    params: Params,
    top_k: int,
    router_kind: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
    renorm_eps: float,
    norm_eps: float,
    act: int,
    residual_multiplier: float,
    out_dtype: torch.dtype,
    int_dot: bool = False,
    residual: bool = True,
    clip: float = 0.0,
    shared_clip: float = 0.0,
    clip_before_act: bool = False,
) -> torch.Tensor:
    """`hidden + rm * (sum_k w_k expert_k(x) + g * shared(x))`, `x = rms_norm(hidden)`, for
    `hidden (B, H)`, math in float32; without `residual` the sum alone (`rm * ...`), and with
    no norm weight `x = hidden` (a stage inside residual streams: its input comes normed);
    `clip` / `shared_clip` the routed / shared experts' SwiGLU clips (`_gated`; 0: none),
    before the activation with `clip_before_act`.

    Args:
        params: `MOE_PARAMS`: norm_w `(H,)`, router_w `(E, H)`, router_bias `(E,)` or None,
            experts_gate_up_w `(E * 2I, H)`, experts_down_w `(E * H, I)`, the shared expert's
            shared_gate_w / shared_up_w / shared_down_w (None: no shared expert; shared_up_w
            None: merged), shared_expert_gate_w `(1, H)` (None: `g = 1`, else
            `g = sigmoid(x @ w^T)`), and the scales.
        top_k ... renorm_eps: the router (see the module docstring).
        norm_eps, act, residual_multiplier, out_dtype: as `fused_mlp_decode_ref`.
    """
    p = MoeParams(*params)
    x = hidden.float()
    xn = x if p.norm_w is None else _rms_norm(x, p.norm_w, norm_eps)
    logits = _linear(xn, p.router_w, None, p.router_scale)  # (B, E)
    weights, chosen = route_ref(
        logits, top_k, router_kind, renormalize, n_group, topk_group, scaling, renorm_eps,
        p.router_bias,
    )  # fmt: skip
    experts = [p.experts_gate_up_w, p.experts_down_w, p.experts_gate_up_scale,
               p.experts_down_scale]  # fmt: skip
    out = moe_experts_ref(xn, weights, chosen, experts, act, int_dot, clip, clip_before_act)
    if p.shared_gate_w is not None:
        scales = (p.shared_gate_scale, p.shared_up_scale, p.shared_down_scale)
        shared = _gated(
            xn,
            p.shared_gate_w,
            p.shared_up_w,
            p.shared_down_w,
            scales,
            act,
            1.0,
            shared_clip,
            clip_before_act,
            int_dot,
        )
        if p.shared_expert_gate_w is not None:
            gate = _linear(xn, p.shared_expert_gate_w, None, p.shared_expert_gate_scale, int_dot)
            shared = torch.sigmoid(gate) * shared
        out = out + shared
    out = out if residual_multiplier == 1.0 else out * residual_multiplier
    return (x + out if residual else out).to(out_dtype)


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    params: Params,
    act: int,
    int_dot: bool = False,
    clip: float = 0.0,
    clip_before_act: bool = False,
) -> torch.Tensor:
    """`sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` for `x (T, H)`, float32, the chosen
    experts of a row added in ascending expert id; each expert `_gated` (its SwiGLU clipped by
    `clip`, `clip_before_act`; `int_dot`: integer dot products).

    Args:
        weights: `(T, k)` routing weights; ids: `(T, k)` expert ids.
        params: `EXPERT_PARAMS`: gate_up_w `(E * 2I, H)` (expert e's gate rows then its up
            rows), down_w `(E * H, I)`, and their scales (None for float weights).
        act: a code of `ACT_CODES`.

    Returns:
        `(T, H)` float32.
    """
    gate_up_w, down_w, gate_up_scale, down_scale = params
    x = x.float()
    hidden_size = x.shape[1]
    inter = gate_up_w.shape[0] * hidden_size // (2 * down_w.shape[0])
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # ascending
        rows, pos = torch.where(ids == e)  # (M,), (M,): a row chooses an expert once
        gu = slice(e * 2 * inter, (e + 1) * 2 * inter)
        dn = slice(e * hidden_size, (e + 1) * hidden_size)
        scales = (
            gate_up_scale[gu] if gate_up_scale is not None else None,
            None,
            down_scale[dn] if down_scale is not None else None,
        )
        y = _gated(x[rows], gate_up_w[gu], None, down_w[dn], scales, act, 1.0, clip,
                   clip_before_act, int_dot)  # fmt: skip
        out.index_add_(0, rows, y * weights[rows, pos, None].float())
    return out


class FusedMlpDecodeOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: Params, norm_eps: float, act: int, gate_multiplier: float,
        down_multiplier: float, residual_multiplier: float, out_dtype: torch.dtype,
        int_dot: bool = False, residual: bool = True, clip: float = 0.0,
        clip_before_act: bool = False,
    ) -> Tensor: ...  # fmt: skip


class FusedMoeDecodeOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: Params, top_k: int, router_kind: int, renormalize: bool,
        n_group: int, topk_group: int, scaling: float, renorm_eps: float, norm_eps: float,
        act: int, residual_multiplier: float, out_dtype: torch.dtype, int_dot: bool = False,
        residual: bool = True, clip: float = 0.0, shared_clip: float = 0.0,
        clip_before_act: bool = False,
    ) -> Tensor: ...  # fmt: skip


class MoeExpertsOp(Protocol):
    def __call__(
        self, x: Tensor, weights: Tensor, ids: Tensor, params: Params, act: int,
        int_dot: bool = False, clip: float = 0.0, clip_before_act: bool = False,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "ffn",
    {
        "mlp_decode": OpSpec(FusedMlpDecodeOp, fused_mlp_decode_ref),
        "moe_decode": OpSpec(FusedMoeDecodeOp, fused_moe_decode_ref),
        "moe_experts": OpSpec(MoeExpertsOp, moe_experts_ref),
    },
)
