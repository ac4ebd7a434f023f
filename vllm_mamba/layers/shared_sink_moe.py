"""`SharedSinkMoE`: Inkling's mixture of experts, whose router weighs the shared experts in the
same normalisation as the routed ones (the shared experts act as a sink of expert weight).

    logits = x @ gate.weight.T                       # (T, E + S), float32 inputs and weights
    chosen = topk(sigmoid(logits[:, :E]) + e_score_correction_bias, k)    # the bias only selects
    s = sigmoid([logits[chosen] | logits[E:]])       # (T, k + S)
    w = s / sum(s) * route_scale * global_scale      # transformers: exp(logsigmoid - logsumexp)
    out = sum_k w_k * expert_k(x) + sum_s shared_s(x, w_{k+s})

`expert_e(x) = down(act(gate(x)) * up(x))` (`layers.mlp.GatedMLP`), dispatched in ascending
expert id with the weights in the model dtype (`layers.moe.dispatch_experts`), as transformers
adds them; each shared expert scales its activation by its weight before its down
projection, and their outputs are summed in float32. Checkpoint names (transformers'):
`gate.weight (E + S, H)`, `gate.global_scale (1,)`, `gate.e_score_correction_bias (E,)`, the
experts one by one (`experts.e.{gate,up,down}_proj`, split from transformers' stacked tensors
by the model) and `shared_experts.s.{gate,up,down}_proj` (likewise).

Tensor parallelism: every routed and shared expert column- then row-parallel (each rank its
F columns), their partial sums all-reduced once; the router replicated.

Glossary: T tokens, H hidden size, E routed experts, S shared experts, k experts per token,
F expert width.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, dispatch_experts
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops.table import MambaOps


class SharedSinkRouter(nn.Module):
    """`weight (E + S, H)`, `global_scale (1,)`, `e_score_correction_bias (E,)`: `x` -> the
    routed weights and ids and the shared experts' weights (see the module docstring)."""

    def __init__(
        self, hidden_size: int, num_experts: int, num_shared: int, top_k: int, scale: float,
        ops: MambaOps,
    ) -> None:  # fmt: skip
        super().__init__()
        if num_shared < 1:
            raise ValueError(f"n_shared_experts ({num_shared}) must be at least 1")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        self.num_experts, self.top_k, self.scale = num_experts, top_k, float(scale)
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(num_experts + num_shared, hidden_size))
        self.global_scale = nn.Parameter(torch.empty(1))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x (T, H)` -> routed weights `(T, k)`, expert ids `(T, k)` and shared weights
        `(T, S)`, the weights float32."""
        logits = self.ops.linear(x.float(), self.weight.float(), None)  # (T, E + S)
        routed = logits[:, : self.num_experts]
        # Each row's elementwise functions as alone (`layers.rowwise`): a speculative chain's
        # rows route as the tokens decoded one by one.
        choice = rowwise(torch.sigmoid, routed) + self.e_score_correction_bias.float()
        chosen = choice.topk(self.top_k, dim=-1)[1]  # (T, k)
        picked = torch.cat([routed.gather(1, chosen), logits[:, self.num_experts :]], dim=-1)
        log_scores = rowwise(nn.functional.logsigmoid, picked)  # (T, k + S)
        weights = rowwise(
            lambda s: torch.exp(s - s.logsumexp(dim=-1, keepdim=True)), log_scores, -math.inf
        )
        weights = weights * self.scale * self.global_scale.float()
        return weights[:, : self.top_k], chosen, weights[:, self.top_k :]


class SharedSinkMoE(nn.Module):
    """The router `gate`, routed `experts` and `shared_experts` (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        num_shared: int,
        top_k: int,
        expert_size: int,
        route_scale: float,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = SharedSinkRouter(hidden_size, num_experts, num_shared, top_k, route_scale, ops)
        self.experts, self.shared_experts = (
            ExpertList(
                GatedMLP(hidden_size, expert_size, False, ops, tp, act=act, reduce=False)
                for _ in range(count)
            )
            for count in (num_experts, num_shared)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        weights, chosen, gammas = self.gate(x)
        weights, gammas = weights.to(x.dtype), gammas.to(x.dtype)
        out = dispatch_experts(x, weights, chosen, self.experts.run, x.dtype)  # (T, H)
        shared = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for s, mlp in enumerate(self.shared_experts):
            inner = rowwise(mlp.act, mlp.gate_proj(x)) * mlp.up_proj(x) * gammas[:, s : s + 1]
            shared += mlp.down_proj(inner).float()
        return all_reduce(out + shared.to(x.dtype), self.tp)
