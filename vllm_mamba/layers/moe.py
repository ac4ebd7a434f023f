"""Sparse mixtures of experts: the routers, the expert containers and the one dispatch loop.

`SparseMoE` = a router (`ExpertRouter`), experts (a list of MLPs, `ExpertList`, or stacked
gated matrices, `StackedGatedExperts`), optional latent projections around the experts
(Nemotron-H) and optional shared experts with or without a sigmoid gate. Its forward:

    weights, chosen = router(x)                     # (T, k) each
    inner = latent_in(x)                             # when configured
    out = sum over chosen experts e of weights * expert_e(inner)    (in routing order)
    out = all_reduce(out); out = latent_out(out)     # the experts' parts summed once
    out = out + gate(x) * shared(x)                  # when configured

Routers (`kind`), as transformers computes them:
- `softmax_topk`: softmax of the logits in float32, top-k of the probabilities, renormalised
  over the k when `renormalize` (Jamba: not); with `float32_logits` the logits themselves are
  products of float32 inputs and weights (Lara-4-Mini), else of the model dtype's.
- `topk_softmax`: top-k of the float32 logits, softmax over those k (Granite 4.0-H).
- `sigmoid_grouped`: DeepSeek-V3's: sigmoid scores; experts chosen by score plus
  `e_score_correction_bias` among the best `topk_group` of `n_group` groups (a group scored
  by its two best), weighted by the raw scores, renormalised when `renormalize`, times
  `scaling` (Nemotron-H).
- `sigmoid_topk`: sigmoid scores; experts chosen by score plus `e_score_correction_bias` (when
  `score_bias`; the bias only selects), weighted by the raw scores, renormalised when
  `renormalize` (adding `renorm_eps` to the sum), times `scaling` (LFM2-MoE).

The experts' outputs are accumulated in float32 (`accumulate_fp32`) or in the model dtype
with the weights cast to it first, as each reference does. Expert `e` is run on the tokens
that chose it, in ascending `e` (the order transformers adds them in).

Fused decode (`layers.decode_plan`): `plan_moe` plans a layer's feed-forward stage
`h + rm * moe(norm(h))` (plus a second, ungated shared-expert part such as Granite's
`shared_mlp`) as one call of the `ffn` family's `moe_decode` op (`vllm_mamba.ops.ffn`: norm,
router, top-k, the chosen experts, the weighted sum in ascending expert id, the shared expert
and its sigmoid gate, residual; no Python loop, no gather or scatter). It applies to every
router kind, one rank, no latent projections, experts that are `GatedMLP`s of plain bias-free
`Linear`s (or `StackedGatedExperts`) with one activation, and a plain or zero-centred
`RMSNorm`. The kernel reads the experts stacked, `(E * 2F, H)` gate and up rows and
`(E * H, F)` down rows: `ExpertList.stacked` copies a list's weights (float, int8 or 4-bit, with
their scales) into two stacked tensors once and points each expert's `Linear` at its rows of
them, so the unfused path reads the same memory and the model holds the experts once. Top-k
ties go to the lower expert id (torch.topk leaves them unspecified), so a fused and an unfused
step may choose differently only between experts of equal scores.

Grouped experts (`SparseMoE.stage_plan`, made by `plan_decode` with the decode plans): the steps
the fused stage does not take (prefill chunks, mixed and larger steps) run the routed experts in
one call of the `ffn` family's `moe_experts` op (`plan_grouped_experts`, `GroupedExperts`): each
chosen expert's rows together, its gate/up and down products as GEMMs (integer-dot GEMM panels
with `w8a8` / `w4a8`), the rows' sums in ascending expert id, in float32, on the same stacked
experts; the router, latent projections and shared experts stay as they are. A 512-token
prefill of Qwen3.6-35B-A3B's layers (`w4a8`, 2 threads of a Zen 5) ran at 886 tok/s against
666 through the loop. `VLLM_MAMBA_FUSED_DECODE=0` keeps the loop.

Glossary: T tokens, H hidden size, E experts, k experts per token, F expert size.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decode_plan import PlannedStage
from vllm_mamba.layers.mlp import (
    FusedFfnStep,
    Projections,
    act_code,
    ffn_norm_vector,
    gated_projections,
    kernel_computes,
    swiglu_clip,
)
from vllm_mamba.layers.parallel_linear import even_ranges, shard_param
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops import ffn as ffn_ops
from vllm_mamba.ops.families import own_op
from vllm_mamba.ops.int_dot_linear import STRIP_ROWS
from vllm_mamba.ops.table import MambaOps
from vllm_mamba.worker.huge_pages import TRIM_BYTES, release_freed_heap

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "sigmoid_topk")
# Most rows of a decode step whose MoE stage runs fused, in calls of `ffn.MAX_ROWS` rows (each
# reading the experts its rows chose); larger steps run the grouped experts (`GroupedExperts`:
# each chosen expert read once for all its rows) with the router and shared experts unfused.
# Decode tok/s, w4a8, 2 threads of a Zen 5 (2026-12-07), fused in parts / grouped: Qwen3.6-35B-
# A3B's layers (256 experts of 512, top 8) 16 rows 180 / 171, 32 rows 258 / 266, 64 rows
# 209 / 233; the Kimi shape (64 experts of 256, top 8) 16 rows 339 / 310, 32 rows 388 / 400.
# (Against the Python loop the grouped call replaced, fused in parts had led at 16-64 rows.)
MOE_MAX_ROWS = 32
# The same for bfloat16 experts on a CPU with bfloat16 instructions, whose grouped call
# multiplies an expert's rows by `bf16_gemm` (`csrc/bf16_gemm.h`) where the fused stage widens
# the weights to float32 row by row. Decode tok/s, bfloat16, 2 threads of a Zen 5 (2026-12-08),
# fused in parts / grouped: Qwen3.6-35B-A3B's layers 8 rows 78 / 74, 16 rows 97 / 93, 32 rows
# 102 / 120; the Qwen3-Next-shaped 1B MoE 32 rows 176 / 222 (float32 there: 116 / 110).
MOE_MAX_ROWS_BF16 = 16


@dataclass(frozen=True)
class RouterConfig:
    """How an `ExpertRouter` chooses and weights experts (see the module docstring)."""

    kind: str
    num_experts: int
    top_k: int
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    score_bias: bool = False  # an `e_score_correction_bias (E,)` parameter
    renorm_eps: float = 1e-20  # added to the sum of the k weights when renormalising (sigmoid)
    float32_logits: bool = False  # softmax_topk: logits from float32 inputs and weights

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"router kind {self.kind!r} is not one of {ROUTER_KINDS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, {self.num_experts}]"
            )
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide the experts")


class ExpertRouter(nn.Module):
    """`weight (E, H)` (and `e_score_correction_bias (E,)`): `x` -> weights and expert ids.

    With `ops`, the router's product runs through `ops.linear`, whose decode-sized kernel
    gives each row the same bits whatever the number of rows (a speculative chain's rows
    route exactly as the tokens decoded one by one); without, `F.linear`.
    """

    def __init__(self, hidden_size: int, config: RouterConfig, ops: MambaOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self._linear = ops.linear if ops is not None else F.linear
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        if config.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x (T, H)` -> float32 weights `(T, k)` and expert ids `(T, k)`."""
        c = self.config
        if c.kind == "softmax_topk":
            if c.float32_logits:
                logits = self._linear(x.float(), self.weight.float(), None)  # (T, E)
            else:
                logits = self._linear(x, self.weight, None)  # (T, E)
            probs = rowwise(lambda t: t.softmax(dim=-1, dtype=torch.float32), logits, -math.inf)
            weights, chosen = probs.topk(c.top_k, dim=-1)
            if c.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, chosen
        if c.kind == "topk_softmax":
            logits = self._linear(x, self.weight, None).float()  # (T, E)
            top, chosen = logits.topk(c.top_k, dim=-1)
            return top.softmax(dim=-1), chosen
        return self._sigmoid(x)

    def _sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`sigmoid_grouped` and `sigmoid_topk`: chosen by the (biased) scores, weighted by the
        raw ones."""
        c = self.config
        scores = rowwise(
            torch.sigmoid, self._linear(x.float(), self.weight.float(), None)
        )  # (T, E)
        choice = scores + self.e_score_correction_bias.float() if c.score_bias else scores
        if c.kind == "sigmoid_grouped":
            chosen = self._best_in_groups(choice)
        else:
            chosen = choice.topk(c.top_k, dim=-1)[1]  # (T, k)
        weights = scores.gather(1, chosen)
        if c.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + c.renorm_eps)
        return weights * c.scaling, chosen

    def _best_in_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The top-k of `choice (T, E)` among the best `topk_group` groups -> ids `(T, k)`."""
        c = self.config
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, c.n_group, num_experts // c.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, n_group)
        groups = group_scores.topk(c.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()  # (T, n_group)
        keep = keep[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        return choice.masked_fill(~keep, float("-inf")).topk(c.top_k, dim=-1, sorted=False)[1]


def dispatch_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    run_expert: Callable[[int, torch.Tensor], torch.Tensor],
    acc_dtype: torch.dtype,
) -> torch.Tensor:
    """`sum_k weights[t, k] * expert_{chosen[t, k]}(x[t])` for each token `t`.

    Args:
        x: `(T, D)` expert inputs; weights: `(T, k)`; chosen: `(T, k)` expert ids.
        run_expert: `(e, rows (M, D)) -> (M, D)`.
        acc_dtype: the accumulator's dtype.

    Returns:
        `(T, D)` in `acc_dtype`.
    """
    out = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
    if x.shape[0] == 1:  # one token (single-stream decode): no gathers, scatters or unique
        ids = chosen[0].tolist()
        for k in sorted(range(len(ids)), key=ids.__getitem__):  # ascending expert ids
            out += (run_expert(ids[k], x) * weights[0, k]).to(acc_dtype)
        return out
    for expert in torch.unique(chosen).tolist():  # ascending, as transformers adds them
        token_idx, k_pos = torch.where(chosen == expert)  # (M,), (M,): tokens are distinct
        y = run_expert(expert, x[token_idx]) * weights[token_idx, k_pos, None]
        out[token_idx] += y.to(acc_dtype)
    return out


class ExpertList(nn.ModuleList):
    """Experts as separate MLP modules (`experts.E.*` in the checkpoints)."""

    # Weak references to the `Linear`s' weights when last stacked and to the stacked experts
    # (held by the plan that uses them): a stacking that no plan holds is not kept alive.
    _stacked: tuple[tuple[weakref.ref, ...], weakref.ref] | None = None

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on rows `x (M, D)`."""
        return self[expert](x)

    def stacked(self) -> StackedExperts | None:
        """The experts' weights stacked for the fused kernel, or None (experts that are not
        bias-free `GatedMLP`s of separate plain `Linear`s of one dtype, quantisation and
        activation, without multipliers; integer-dot experts whose row counts are not whole
        strips of 16).

        The first call copies the weights (and int8 / 4-bit scales) into `(E, 2F, ...)` gate/up
        and `(E, H, ...)` down tensors and points each `Linear`'s weight (and scale) at its rows
        of them; later calls return the same tensors while a plan holds them and the `Linear`s
        keep those weights (else they stack again, from the views: the memory is freed once the
        old stacking has no views left).
        """
        experts = list(self)
        if not experts or any(not kernel_computes(m) or m._merged is not None for m in experts):
            return None
        if len({swiglu_clip(m) for m in experts}) != 1:
            return None
        if len({act_code(m.act) for m in experts}) != 1 or act_code(experts[0].act) is None:
            return None
        if any(m.gate_multiplier != 1.0 or m.down_multiplier != 1.0 for m in experts):
            return None
        linears = [lin for m in experts for lin in (m.gate_proj, m.up_proj, m.down_proj)]
        current = tuple(lin.weight for lin in linears)
        if self._stacked is not None:
            refs, ref = self._stacked
            cached = ref()
            if cached is not None and all(r() is w for r, w in zip(refs, current, strict=True)):
                return cached
        got = Projections(experts[0].ops.linear)
        found = [gated_projections(m, got) for m in experts]
        dtype = got.dtype()
        if dtype is None or any(f is None for f in found):
            return None
        kinds = {(gate[0].dtype, gate[1] is None) for f in found for gate in f}  # type: ignore[union-attr]
        if len(kinds) != 1:
            return None
        if got.int_dot and any(lin.weight.shape[0] % STRIP_ROWS for lin in linears):
            return None  # strip-layout weights stack into one only in whole strips of rows
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, as loaded weights
            stacked = _stack(self, found, dtype, got.int_dot)  # type: ignore[arg-type]
        self._stacked = (tuple(weakref.ref(lin.weight) for lin in linears), weakref.ref(stacked))
        return stacked


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """Experts as the fused kernel reads them: `gate_up (E * 2F, H)` (expert e's gate rows, then
    its up rows), `down (E * H, F)` (int8: `(rows,)` float32 scales; 4-bit: packed uint8 weights
    with `(rows, cols / 32)` float16 scales; float: scales None), the model dtype, the
    activation's kernel code and whether the products use integer dots."""

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor | None
    down: torch.Tensor
    down_scale: torch.Tensor | None
    dtype: torch.dtype
    act: int
    int_dot: bool
    clip: tuple[float, bool] = (0.0, False)  # the experts' SwiGLU clip (`swiglu_clip`)


def _stack(
    experts: ExpertList,
    found: list[tuple[tuple[torch.Tensor, torch.Tensor | None], ...]],
    dtype: torch.dtype,
    int_dot: bool,
) -> StackedExperts:
    """Copies the experts' `found` weights into stacked tensors and points their `Linear`s at
    them (see `ExpertList.stacked`), expert by expert: each expert's own tensors are dropped
    from `found` once copied (and the heap trimmed every `TRIM_BYTES`), so that the copy holds
    little twice (a layer's experts copied at once held them all twice for a moment: 0.8 GB
    more at the end of each int8 Qwen3.6-35B-A3B layer's load)."""
    num = len(found)
    quantised = found[0][0][1] is not None

    def parts(f: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]) -> list[tuple]:
        """One expert's parts of each stacked tensor: gate/up, down (and their scales)."""
        out = [(f[0][0], f[1][0]), (f[2][0],)]
        return [*out, (f[0][1], f[1][1]), (f[2][1],)] if quantised else out

    # `(E, rows, ...)` each: a view where the experts already lie so in one storage (stacked at
    # load: `stack_experts`), else a fresh tensor filled below
    stacks: list[tuple[torch.Tensor, bool]] = []  # (the stacked tensor, whether it is fresh)
    for k, group in enumerate(parts(found[0])):
        view = _stacked_view([parts(f)[k] for f in found])
        if view is not None:
            stacks.append((view, False))
            continue
        rows = sum(t.shape[0] for t in group)
        stacks.append((torch.empty((num, rows, *group[0].shape[1:]), dtype=group[0].dtype), True))
    gate_up, down = stacks[0][0], stacks[1][0]
    gu_scale = stacks[2][0] if quantised else None
    dn_scale = stacks[3][0] if quantised else None
    inter = gate_up.shape[1] // 2
    copied = 0
    for e, mlp in enumerate(experts):
        for (out, fresh), group in zip(stacks, parts(found[e]), strict=True):
            if fresh:
                torch.cat(group, out=out[e])
                copied += sum(t.nbytes for t in group)
        found[e] = ()  # its own tensors die with the views below
        views = (
            (mlp.gate_proj, gate_up[e, :inter], gu_scale[e, :inter] if quantised else None),
            (mlp.up_proj, gate_up[e, inter:], gu_scale[e, inter:] if quantised else None),
            (mlp.down_proj, down[e], dn_scale[e] if quantised else None),
        )
        for linear, weight, scale in views:
            linear.weight.data = weight
            if scale is not None:
                linear.weight_scale = scale
        if copied >= TRIM_BYTES:
            release_freed_heap()
            copied = 0
    return StackedExperts(
        gate_up.flatten(0, 1),
        gu_scale.flatten(0, 1) if quantised else None,
        down.flatten(0, 1),
        dn_scale.flatten(0, 1) if quantised else None,
        dtype,
        act_code(experts[0].act),
        int_dot,
        swiglu_clip(experts[0]),
    )  # type: ignore[arg-type]


def _stacked_view(parts: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
    """`(E, rows, ...)` over the storage the experts' parts (E groups of contiguous tensors of
    one dtype and trailing shape) already share, where they lie in it as a stack would: each
    group's tensors one after another, the groups one after another; else None."""
    first = parts[0][0]
    storage, base = first.untyped_storage(), first.storage_offset()
    rest = first.shape[1:]
    step = sum(t.numel() for t in parts[0])
    for e, group in enumerate(parts):
        offset = base + e * step
        for t in group:
            if (
                t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.dtype != first.dtype
                or t.shape[1:] != rest
                or not t.is_contiguous()
                or t.storage_offset() != offset
            ):
                return None
            offset += t.numel()
    rows = sum(t.shape[0] for t in parts[0])
    return torch.empty(0, dtype=first.dtype).set_(storage, base, (len(parts), rows, *rest))


def stack_experts(model: nn.Module) -> None:
    """Stacks every `ExpertList`'s weights once at load (`ExpertList.stacked`), before the
    weights move to their final memory: the experts' `Linear`s then view one stacked tensor,
    so the fused decode plan later views it too instead of copying every expert (which kept
    the loaded copies alive beside the stack: twice the experts' memory)."""
    for module in model.modules():
        if isinstance(module, ExpertList):
            module.stacked()


class StackedGatedExperts(nn.Module):
    """Experts as stacked matrices: `input_linear.weight (E, 2F, H)` (gate and up halves) and
    `output_linear.weight (E, H, F)`; expert `e` is `out_e(act(g) * u)`, `g, u = in_e(x)`.

    With tensor parallelism each rank holds its F columns of every expert (the gate and up
    halves each split), leaving the all-reduce to the caller.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_size: int,
        tp: TensorParallel = SINGLE,
        act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ) -> None:
        super().__init__()
        local = tp.split(ffn_size, "intermediate_size")  # this rank's expert width
        self.input_linear = _Stacked(num_experts, 2 * local, hidden_size)
        self.output_linear = _Stacked(num_experts, hidden_size, local)
        self.act = act
        if tp.size > 1:
            halves = even_ranges([ffn_size, ffn_size], tp, "intermediate_size")
            shard_param(self.input_linear, "weight", 1, halves, 2 * ffn_size)
            shard_param(self.output_linear, "weight", 2, [tp.range(ffn_size, "ffn")], ffn_size)

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on rows `x (M, H)`."""
        gate, up = F.linear(x, self.input_linear.weight[expert]).chunk(2, dim=-1)
        act = rowwise(self.act, gate)  # each row as alone: M is the tokens routed here
        return F.linear(act * up, self.output_linear.weight[expert])  # (M, H)


class _Stacked(nn.Module):
    """One `weight (E, out, in)` parameter: the experts' matrices stacked."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class SparseMoE(PlannedStage):
    """A router, its experts and the optional latent projections and shared experts.

    Parts are registered under the checkpoint's names (`names`: router, experts, shared
    experts, shared-expert gate, latent in, latent out). Its `stage_plan` (`GroupedExperts`,
    made by `plan_decode`) runs the routed experts of a step in one kernel call.
    """

    def __init__(
        self,
        router: ExpertRouter,
        experts: ExpertList | StackedGatedExperts,
        tp: TensorParallel = SINGLE,
        *,
        accumulate_fp32: bool = False,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
        latent: tuple[nn.Module, nn.Module] | None = None,
        names: tuple[str, ...] = ("router", "experts", "shared_experts", "shared_expert_gate"),
        latent_names: tuple[str, str] = ("fc1_latent_proj", "fc2_latent_proj"),
    ) -> None:
        super().__init__()
        self.tp = tp
        self.accumulate_fp32 = accumulate_fp32
        self._names = names
        self._latent_names = latent_names if latent is not None else None
        parts = [router, experts, shared, shared_gate]
        for name, module in zip(names, parts):
            if module is not None:
                self.add_module(name, module)
        self._has_shared, self._has_gate = shared is not None, shared_gate is not None
        if latent is not None:
            self.add_module(latent_names[0], latent[0])
            self.add_module(latent_names[1], latent[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        router, experts = getattr(self, self._names[0]), getattr(self, self._names[1])
        weights, chosen = router(x)  # (T, k) each, float32
        acc = torch.float32 if self.accumulate_fp32 else x.dtype
        inner = x if self._latent_names is None else getattr(self, self._latent_names[0])(x)
        grouped = self.stage_plan
        if isinstance(grouped, GroupedExperts) and grouped.takes(inner):
            out = grouped(inner, weights, chosen).to(acc)  # float32 throughout
        else:
            if not self.accumulate_fp32:
                weights = weights.to(x.dtype)
            out = dispatch_experts(inner, weights, chosen, experts.run, acc)
        out = all_reduce(out, self.tp).to(x.dtype)  # the experts' parts, summed once
        if self._latent_names is not None:
            out = getattr(self, self._latent_names[1])(out)
        if self._has_shared:
            shared = getattr(self, self._names[2])(x)
            if self._has_gate:
                shared = rowwise(torch.sigmoid, getattr(self, self._names[3])(x)) * shared
            out = out + shared
        return out

    def make_stage_plan(self) -> GroupedExperts | None:
        return plan_grouped_experts(self)


@dataclass(frozen=True, eq=False)
class GroupedExperts:
    """An MoE's routed experts in one call of the `ffn` family's `moe_experts` op: every
    chosen expert's rows together, its products as GEMMs (`csrc/moe_experts.cpp`); `keep` the
    stacked experts the parameters view."""

    op: Callable[..., torch.Tensor]
    params: list[torch.Tensor | None]
    act: int
    int_dot: bool
    clip: tuple[float, bool]
    keep: object

    def takes(self, x: torch.Tensor) -> bool:
        """A step on the CPU without autograd."""
        return x.device.type == "cpu" and not torch.is_grad_enabled()

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """`x (T, D)`, routing `weights (T, k)` and expert ids `chosen (T, k)` -> `(T, D)`
        float32, as `dispatch_experts` sums them (ascending expert id; float32 throughout)."""
        return self.op(x, weights, chosen, self.params, self.act, self.int_dot, *self.clip)


def plan_grouped_experts(moe: SparseMoE) -> GroupedExperts | None:
    """`moe`'s routed experts as one `moe_experts` call (`GroupedExperts`), or None where the
    kernel does not apply: tensor parallelism, experts that do not stack (`ExpertList.stacked`:
    `GatedMLP`s of plain bias-free `Linear`s of one dtype and quantisation, one activation, no
    multipliers), or a backend without the kernel."""
    router, experts = getattr(moe, moe._names[0]), getattr(moe, moe._names[1])
    if moe.tp.size != 1 or type(router) is not ExpertRouter or router.ops is None:
        return None
    op = own_op("ffn", router.ops.name, "moe_experts")
    if op is None:
        return None
    stacked = _stacked_of(experts)
    if stacked is None:
        return None
    params = [stacked.gate_up, stacked.down, stacked.gate_up_scale, stacked.down_scale]
    return GroupedExperts(op, params, stacked.act, stacked.int_dot, stacked.clip, stacked)


def _stacked_of(experts: nn.Module, dtype: torch.dtype | None = None) -> StackedExperts | None:
    """An MoE's experts as the kernels read them (`ExpertList.stacked`; `StackedGatedExperts`'
    parameters in `dtype`, by default their own), or None."""
    if isinstance(experts, ExpertList):
        return experts.stacked()
    if type(experts) is StackedGatedExperts:
        return _stacked_gated(experts, dtype or experts.input_linear.weight.dtype)
    return None


def _stacked_gated(experts: StackedGatedExperts, dtype: torch.dtype) -> StackedExperts | None:
    """`StackedGatedExperts`' float parameters as the kernel reads them, or None."""
    gate_up, down = experts.input_linear.weight, experts.output_linear.weight
    code = act_code(experts.act)
    if code is None or {gate_up.dtype, down.dtype} != {dtype} or gate_up.device.type != "cpu":
        return None
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        return None
    return StackedExperts(
        gate_up.detach().flatten(0, 1), None, down.detach().flatten(0, 1), None, dtype, code, False
    )


def plan_moe(
    moe: nn.Module,
    norm: nn.Module | None,
    residual_multiplier: float,
    shared: nn.Module | None = None,
    residual: bool = True,
) -> FusedFfnStep | None:
    """`h + rm * (moe(norm(h)) + shared(norm(h)))` as one `moe_decode` call, or None where the
    kernel does not apply (see the module docstring).

    Args:
        moe: the layer's `SparseMoE`.
        norm: the feed-forward stage's norm (None: the stage has none).
        residual_multiplier: the layer's `rm`.
        shared: a second feed-forward part summed after the MoE (an ungated `GatedMLP`; the MoE
            then has no shared expert of its own), or None.
        residual: False for the stage's output alone, `rm * (...)` without `h` (a stage inside
            residual streams, whose connection mixes it back).
    """
    if type(moe) is not SparseMoE or moe.tp.size != 1 or moe._latent_names is not None:
        return None
    router, experts = getattr(moe, moe._names[0]), getattr(moe, moe._names[1])
    if type(router) is not ExpertRouter or router.ops is None:
        return None
    op = own_op("ffn", router.ops.name, "moe_decode")
    normed = (None, 0.0) if norm is None else ffn_norm_vector(norm)
    if op is None or normed is None or (shared is not None and moe._has_shared):
        return None
    if shared is not None and swiglu_clip(shared)[0]:
        return None  # a second feed-forward part is summed unclipped
    gate = None
    if moe._has_shared:
        shared = getattr(moe, moe._names[2])
        gate = getattr(moe, moe._names[3]) if moe._has_gate else None
    got = Projections(router.ops.linear)
    shared_found = ((None, None),) * 3
    shared_clip = (0.0, False) if shared is None else swiglu_clip(shared)
    if shared is not None:
        found = gated_projections(shared, got)
        if found is None or shared.gate_multiplier != 1.0 or shared.down_multiplier != 1.0:
            return None
        shared_found = found
    gate_w, gate_s = got.take(gate) if gate is not None else (None, None)
    dtype = got.dtype()
    if not got.ok or (got.dtypes and dtype is None):
        return None
    stacked = _stacked_of(experts, dtype)
    if stacked is None or (dtype is not None and dtype != stacked.dtype):
        return None
    if got.int_dots and got.int_dot != stacked.int_dot:
        return None
    if shared is not None and act_code(shared.act) != stacked.act:
        return None
    clips = [c for c in (stacked.clip, shared_clip) if c[0]]
    if len({before for _, before in clips}) > 1:
        return None  # one clip position for both
    before = clips[0][1] if clips else False
    weight = router.weight.detach()
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        return None
    c = router.config
    bias = _f32_or_none(getattr(router, "e_score_correction_bias", None)) if c.score_bias else None
    (sh_gate, sh_gate_s), (sh_up, sh_up_s), (sh_down, sh_down_s) = shared_found
    params = ffn_ops.MoeParams(
        norm_w=normed[0], router_w=weight, router_bias=bias, experts_gate_up_w=stacked.gate_up,
        experts_down_w=stacked.down, shared_gate_w=sh_gate, shared_up_w=sh_up,
        shared_down_w=sh_down, shared_expert_gate_w=gate_w, router_scale=None,
        experts_gate_up_scale=stacked.gate_up_scale, experts_down_scale=stacked.down_scale,
        shared_gate_scale=sh_gate_s, shared_up_scale=sh_up_s, shared_down_scale=sh_down_s,
        shared_expert_gate_scale=gate_s,
    )  # fmt: skip
    softmax = c.kind in ("softmax_topk", "topk_softmax")
    kind = ffn_ops.ROUTER_SOFTMAX if softmax else ffn_ops.ROUTER_SIGMOID
    renormalize = c.renormalize or c.kind == "topk_softmax"
    grouped = c.kind == "sigmoid_grouped"
    args = (
        c.top_k, kind, renormalize, c.n_group if grouped else 1, c.topk_group if grouped else 1,
        float(c.scaling), float(c.renorm_eps), normed[1], stacked.act, float(residual_multiplier),
    )  # fmt: skip
    tail = (residual, stacked.clip[0], shared_clip[0], before)
    bf16 = stacked.dtype == torch.bfloat16 and not stacked.int_dot and cpu_kernels.native_bf16()
    max_rows = MOE_MAX_ROWS_BF16 if bf16 else MOE_MAX_ROWS
    return FusedFfnStep(
        op, list(params), args, stacked.dtype, stacked.int_dot, stacked, tail, max_rows
    )


def _f32_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()
