"""`ZayaMoE`: ZAYA1's mixture of experts (`mlp`): a top-1 router with an MLP, whose hidden state
carries from each layer's router to the next layer's, over stacked gated experts and a skip
expert.

    r = down_proj(x) (+ r_prev * router_states_scale)   # (T, R); r_prev: the previous layer's r
    p = softmax(out_proj(gelu(fc2(gelu(fc1(norm(r)))))))  # (T, E + 1), the last: skip
    e = argmax(p + balancing_biases)                     # the biases only choose
    out = p[e] * expert_e(x), or zeros where e is the skip expert (no expert runs)

The carried state is per token and lives only within one forward: layer i's router reads the
`r` of layer i - 1 for the same token (the first layer's router has no `router_states_scale`
and reads none), so it is passed along the layers, never cached between steps. Expert e is a
`GatedMLP` `down_proj(act(gate_proj(x)) * up_proj(x))` (an `ExpertList`, so int8 / 4-bit
quantisation reaches the experts; the model splits the checkpoint's stacked `gate_up_proj
(E, 2F, H)` and `down_proj (E, H, F)` into them); its output is scaled by the router's
probability in the model dtype, as transformers does.

In the checkpoints (`mlp.*`): `gate.down_proj (R, H)` with bias, `gate.router_states_scale
(R,)`, `gate.router_mlp.{norm (R,), fc1, fc2 (R, R) with biases, out_proj (E + 1, R)}`,
`gate.balancing_biases (E + 1,)` (a float32 buffer in transformers, here a parameter held in
the model dtype), `experts.E.{gate_proj, up_proj, down_proj}` as loaded.

Tensor parallelism (`tp`): the router runs whole on every rank; each rank holds its F columns
of every expert, and the experts' partial outputs are all-reduced.

Glossary: T tokens, H hidden size, R router hidden size, E experts, F expert size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ExpertList, dispatch_experts
from vllm_mamba.ops.table import MambaOps


class RouterMLP(nn.Module):
    """`out_proj(gelu(fc2(gelu(fc1(norm(r))))))`: `(T, R)` -> logits `(T, E + 1)`."""

    def __init__(self, width: int, classes: int, eps: float, ops: MambaOps) -> None:
        super().__init__()
        self.norm = RMSNorm(width, eps=eps)
        self.fc1 = Linear(width, width, True, ops)
        self.fc2 = Linear(width, width, True, ops)
        self.out_proj = Linear(width, classes, False, ops)

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        """`r (T, R)` -> `(T, E + 1)`."""
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(r))))))


class ZayaRouter(nn.Module):
    """The router of one layer (see the module docstring); `carries`: it reads the previous
    layer's router state (every layer but the first)."""

    def __init__(
        self, hidden_size: int, width: int, num_experts: int, eps: float, carries: bool,
        ops: MambaOps,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts = num_experts
        self.down_proj = Linear(hidden_size, width, True, ops)
        scale = nn.Parameter(torch.empty(width)) if carries else None
        self.register_parameter("router_states_scale", scale)
        self.router_mlp = RouterMLP(width, num_experts + 1, eps, ops)
        self.balancing_biases = nn.Parameter(torch.empty(num_experts + 1), requires_grad=False)

    def forward(
        self, x: torch.Tensor, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x (T, H)` and the previous layer's state `(T, R)` (None for the first layer) ->
        each token's weight `(T,)` (model dtype), expert `(T,)` (E: the skip expert) and this
        layer's state `(T, R)`."""
        state = self.down_proj(x)  # (T, R)
        if carried is not None and self.router_states_scale is not None:
            state = state + carried * self.router_states_scale
        probs = torch.softmax(self.router_mlp(state), dim=-1)  # (T, E + 1)
        biased = probs.float() + self.balancing_biases.float()
        chosen = biased.topk(1, dim=-1)[1]  # (T, 1)
        return probs.gather(1, chosen)[:, 0], chosen[:, 0], state


class ZayaMoE(nn.Module):
    """The router and the experts (checkpoint names `gate`, `experts`)."""

    def __init__(
        self,
        hidden_size: int,
        router_width: int,
        num_experts: int,
        expert_size: int,
        eps: float,
        carries: bool,
        act: str,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = ZayaRouter(hidden_size, router_width, num_experts, eps, carries, ops)
        self.experts = ExpertList(
            GatedMLP(hidden_size, expert_size, False, ops, tp, act=act, reduce=False)
            for _ in range(num_experts)
        )

    def forward(
        self, x: torch.Tensor, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x (T, H)`, the previous layer's router state -> `(T, H)` and this layer's state."""
        weights, chosen, state = self.gate(x, carried)
        routed = chosen != self.gate.num_experts  # (T,): not the skip expert
        if bool(routed.all()):
            out = dispatch_experts(x, weights[:, None], chosen[:, None], self.experts.run, x.dtype)
        else:
            rows = routed.nonzero()[:, 0]
            out = x.new_zeros(x.shape)
            if rows.numel():
                out[rows] = dispatch_experts(
                    x[rows], weights[rows, None], chosen[rows, None], self.experts.run, x.dtype
                )
        return all_reduce(out, self.tp), state
