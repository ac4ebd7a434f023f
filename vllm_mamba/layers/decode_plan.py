"""The decode plan: how a layer runs its decode-only steps, decided once after load and binding.

A layer's decode-only steps may run as one fused kernel call instead of its parts: the whole
decoder layer (RWKV-7: `rwkv7_decode`), the mixer stage with the block's norm and residual
(Mamba, Mamba2: `fused_decode_layer`), or the mixer alone (a Mamba / Mamba2 mixer in a layer
the block kernel does not cover: multipliers, another norm, several mixers; Zamba2's layers).
Each `PlannedLayer` holds a `DecodePlan` (which scope, which part, the `FusedStep` with its
kernel and parameter list built once) or None (unfused), made by `plan_decode(model)`.

A second, independent plan covers the feed-forward stage `h + rm * ffn(ffn_norm(h))`
(`PlannedLayer.ffn_plan`, scope `FFN`): a dense gated MLP (`layers.mlp.plan_mlp`) or an MoE
with its router, top-k, chosen experts and shared expert (`layers.moe.plan_moe`) in one call of
the `ffn` family's kernels (`vllm_mamba.ops.ffn`), up to 8 rows, whatever the mixer's plan.
A third covers the steps neither takes: an MoE's routed experts for any number of rows
(`PlannedStage.stage_plan` of a `SparseMoE`, `layers.moe.plan_grouped_experts`: the `ffn`
family's `moe_experts`, each chosen expert's rows multiplied together in one C++ call).

Decided at plan time, once per layer:
- `VLLM_MAMBA_FUSED_DECODE` (read then; `0`: no layer is fused) and whether the ops table has
  the kernel (the backend's own `fused_decode` / `rwkv7.decode_layer` op);
- the layer's structure (one mixer, which norms, multipliers, a stateful feed-forward) and
  whether the mixer declares its math fusable (`StateSpaceMixer.fused_decode`);
- for the feed-forward stage, its parts (one gated MLP, an MoE with or without a shared
  expert, an MoE plus an ungated shared MLP), a plain or zero-centred `RMSNorm`, no post-norm,
  no per-sequence state, the router kind and the experts' layout (a list of expert `Linear`s is
  stacked once, `ExpertList.stacked`);
- the weights as loaded, quantised (`quantization`) and sharded (tensor parallelism): plain
  CPU `Linear`s with float32 / bfloat16, int8 or 4-bit weights of one model dtype, else
  unfused; the norms' types; the parameter list, by name (`ops.fused_decode.MambaParams`,
  `Mamba2Params`, `ops.rwkv7.DecodeLayerParams`), and the constant arguments (epsilons,
  groups, the result dtype where it is fixed);
- the bound states' dtypes (float32 or bfloat16 each).

Decided per step (`FusedStep.takes`, `decode_only`), the one question a step asks: is every
row a decode the kernel takes? No prefill rows, no autograd, at least one row; speculative
chains only where the kernel runs them (Mamba, Mamba2, RWKV-7: up to `CHAIN_MAX_ROWS` rows with
their source slots); Mamba at most `MAMBA_MAX_ROWS` rows outside chains; RWKV-7 an input
in the model dtype; the feed-forward stage at most 8 rows (chains included, each row computed
as alone) with an input in the model dtype. The step's slots and, for the Mamba block without
a float32 residual, its input's dtype are read per step; the states through the mixer's
binding, per call.

Re-planning: a plan holds the weights it was made from and the decisions on the states bound
then. `StateCache.bind` binds every layer and then calls `plan_decode(model)`, so a (re)binding
makes new plans; `CausalLM.process_weights_after_loading` and `quantize_model` drop them
(`drop_decode_plans`): the layers run unfused until the next binding or `plan_decode`. A layer
never planned (bound on its own, outside a state cache) has no plan and runs unfused; weights
changed any other way after planning need `plan_decode(model)` again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from vllm_mamba import envs
from vllm_mamba.attention.mamba_metadata import MambaMetadata

# Mamba rows up to which the fused layer runs. Above it the kernel's GEMM path was measured
# no faster than the unfused one (its per-channel selective-scan stage costs as much as the
# dispatch it saves: benchmarks/README.md), so larger Mamba batches stay unfused. Mamba2's
# fused layer runs at every batch size.
MAMBA_MAX_ROWS = 8
CHAIN_MAX_ROWS = 64  # rows of a step with speculative chains that the fused layers take


class FusedStep(Protocol):
    """One layer part's decode-only step in one kernel call, its parameters bound at plan time."""

    def takes(self, hidden: torch.Tensor, meta: MambaMetadata) -> bool:
        """Whether this step (`hidden (T, H)`, `meta`) is one the kernel runs."""
        ...

    def __call__(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """The part's output `(T, H)`, its states advanced in place."""
        ...


class DecodeScope(enum.Enum):
    """What a fused step replaces in its layer."""

    LAYER = "layer"  # the whole layer (its first norm to its last residual)
    BLOCK = "block"  # the mixer stage: `h + mixer(norm(h))`
    MIXER = "mixer"  # one mixer's call: `mixer(x)`
    FFN = "ffn"  # the feed-forward stage: `h + rm * ffn(ffn_norm(h))` (`PlannedLayer.ffn_plan`)


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """A layer's fused decode: `step` replaces `scope` (the mixer `part` for `MIXER`)."""

    scope: DecodeScope
    step: FusedStep
    part: str


def decode_only(
    hidden: torch.Tensor,
    meta: MambaMetadata,
    max_rows: int | None = None,
    chain_rows: int | None = None,
) -> bool:
    """A step of decode rows only (at least one), no prefill, without autograd.

    Args:
        hidden: `(T, H)`, the rows.
        max_rows: most rows outside speculative chains (None: any).
        chain_rows: most rows of a step with speculative chains, which the kernel then runs in
            order, each reading the slot the row before wrote (None: no chains).
    """
    rows = hidden.shape[0]
    if meta.num_prefills or rows == 0 or meta.num_decodes != rows or torch.is_grad_enabled():
        return False
    if meta.decode_waves:
        return chain_rows is not None and rows <= chain_rows and meta.decode_chain_src is not None
    return max_rows is None or rows <= max_rows


def decode_slots(meta: MambaMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots the rows write their states to, and read them from when those differ
    (speculative chains: each position's state in its own slot)."""
    if meta.decode_waves:
        assert meta.decode_chain_dst is not None
        return meta.decode_chain_dst, meta.decode_chain_src
    return meta.decode_state_indices, None


class PlannedLayer(nn.Module):
    """A layer whose decode-only steps may run fused: it holds its `decode_plan` and its
    feed-forward stage's `ffn_plan`, made by `make_decode_plan` / `make_ffn_plan` when
    `plan_decode(model)` runs (None until then, and when unfused)."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_plan: DecodePlan | None = None
        self.ffn_plan: DecodePlan | None = None

    def make_decode_plan(self) -> DecodePlan | None:
        """This layer's plan from its weights and bound states now, or None (unfused)."""
        raise NotImplementedError

    def make_ffn_plan(self) -> DecodePlan | None:
        """This layer's feed-forward plan from its weights now, or None (unfused, the default)."""
        return None


class PlannedStage(nn.Module):
    """A part of a layer (not a layer) with a fused plan for the steps the decode plans do not
    take (prefill, mixed and larger batches): an MoE's grouped experts
    (`layers.moe.SparseMoE`). It holds its `stage_plan`, made by `make_stage_plan` when
    `plan_decode(model)` runs (None until then, and when unfused)."""

    def __init__(self) -> None:
        super().__init__()
        self.stage_plan: object | None = None

    def make_stage_plan(self) -> object | None:
        """This stage's plan from its weights now, or None (unfused, the default)."""
        return None


def planned_layers(model: nn.Module) -> list[PlannedLayer]:
    """The model's `PlannedLayer`s, in module order."""
    return [m for m in model.modules() if isinstance(m, PlannedLayer)]


def plan_decode(model: nn.Module) -> list[DecodePlan | None]:
    """Makes every layer's plans (none with `VLLM_MAMBA_FUSED_DECODE=0`); after the weights are
    final and the states bound (`StateCache.bind` calls it). Returns the mixer plans
    (`decode_plan`), in order; the feed-forward plans are each layer's `ffn_plan`."""
    fused = envs.VLLM_MAMBA_FUSED_DECODE
    layers = planned_layers(model)
    for layer in layers:
        layer.decode_plan = layer.make_decode_plan() if fused else None
        layer.ffn_plan = layer.make_ffn_plan() if fused else None
    for stage in _planned_stages(model):
        stage.stage_plan = stage.make_stage_plan() if fused else None
    return [layer.decode_plan for layer in layers]


def _planned_stages(model: nn.Module) -> list[PlannedStage]:
    return [m for m in model.modules() if isinstance(m, PlannedStage)]


def drop_decode_plans(model: nn.Module) -> None:
    """Drops every layer's plans (its weights are about to change): unfused until re-planned."""
    for layer in planned_layers(model):
        layer.decode_plan = None
        layer.ffn_plan = None
    for stage in _planned_stages(model):
        stage.stage_plan = None


__all__ = [
    "CHAIN_MAX_ROWS",
    "MAMBA_MAX_ROWS",
    "DecodePlan",
    "DecodeScope",
    "FusedStep",
    "PlannedLayer",
    "PlannedStage",
    "decode_only",
    "decode_slots",
    "drop_decode_plans",
    "plan_decode",
    "planned_layers",
]
