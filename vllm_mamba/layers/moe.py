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
  over the k when `renormalize` (Jamba: not).
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

Glossary: T tokens, H hidden size, E experts, k experts per token, F expert size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.parallel_linear import even_ranges, shard_param
from vllm_mamba.ops.table import MambaOps

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "sigmoid_topk")


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
        self._linear = ops.linear if ops is not None else F.linear
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        if config.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x (T, H)` -> float32 weights `(T, k)` and expert ids `(T, k)`."""
        c = self.config
        if c.kind == "softmax_topk":
            probs = self._linear(x, self.weight, None).softmax(dim=-1, dtype=torch.float32)
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
        scores = _rowwise_sigmoid(self._linear(x.float(), self.weight.float(), None))  # (T, E)
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


def _rowwise_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`x.sigmoid()` of `x (T, E)` whose bits per row do not depend on `T`.

    torch's elementwise loop runs over the flat tensor two vectors at a time and finishes the
    rest with scalar code, which rounds differently; a row whose width is not a multiple of
    32 would take one path alone and the other among more rows (a speculative chain's rows
    must route exactly as the tokens decoded one by one). Padding the rows to a multiple of 32
    columns puts every row in the vector loop (up to torch's parallel grain, far above a
    decode step's router).
    """
    pad = -x.shape[-1] % 32
    if not pad:
        return x.sigmoid()
    return F.pad(x, (0, pad)).sigmoid()[:, : x.shape[-1]]


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

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on rows `x (M, D)`."""
        return self[expert](x)


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
        return F.linear(self.act(gate) * up, self.output_linear.weight[expert])  # (M, H)


class _Stacked(nn.Module):
    """One `weight (E, out, in)` parameter: the experts' matrices stacked."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class SparseMoE(nn.Module):
    """A router, its experts and the optional latent projections and shared experts.

    Parts are registered under the checkpoint's names (`names`: router, experts, shared
    experts, shared-expert gate, latent in, latent out).
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
        if not self.accumulate_fp32:
            weights = weights.to(x.dtype)
        inner = x if self._latent_names is None else getattr(self, self._latent_names[0])(x)
        out = dispatch_experts(inner, weights, chosen, experts.run, acc)
        out = all_reduce(out, self.tp).to(x.dtype)  # the experts' parts, summed once
        if self._latent_names is not None:
            out = getattr(self, self._latent_names[1])(out)
        if self._has_shared:
            shared = getattr(self, self._names[2])(x)
            if self._has_gate:
                shared = torch.sigmoid(getattr(self, self._names[3])(x)) * shared
            out = out + shared
        return out
