"""The RG-LRU (Griffin's Real-Gated Linear Recurrent Unit, RecurrentGemma) as one op family,
`rglru`: the diagonal gated recurrence over a flat varlen batch (`varlen`) and one token per
row (`update`). Pure-PyTorch references (`*_ref`), registered as the op family `rglru`
(`vllm_mamba.ops.families`); a backend registers faster versions under the same names and
signatures (`cpp`: `csrc/rglru.cpp`, `triton`: `vllm_mamba.ops.triton_rglru`).

Per channel and token, with `x` the block's conv output, `gx`, `ga` the input and recurrence
gate logits (the block-diagonal gate projections, computed by the layer) and `c` the layer's
`-8 softplus(recurrent_param)` (`log_a_scale`):

    log_a = c * sigmoid(ga)                      a = exp(log_a)
    u = x * sigmoid(gx) * sqrt(1 - exp(2 log_a))
    h = a * h + u                                y = h

except on a sequence's first token (position 0: a chunk without an initial state), where the
state resets: `h = x * sigmoid(gx)` (no normalisation; transformers' `reset`). The state is
`h (S, L)` float32, one value per channel; math is float32, the output is rounded to x's dtype.

Glossary:
    T: tokens in the flat batch; B: sequences (or decode rows); L: channels (`lru_width`);
    S: state slots. `x`: `(T, L)`; `gates`: `(T, 2L)` as `[gx | ga]`; `log_a_scale`: `(L,)`
    float32. `query_start_loc` is `(B + 1,)`: sequence `b` owns tokens `[qsl[b], qsl[b + 1])`.
    A state index of `PAD_SLOT_ID` (-1) marks a padding row: its slot is neither read nor
    written, and its outputs are zeros.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec

Tensor = torch.Tensor
FAMILY = "rglru"


def _terms(
    x: torch.Tensor, gates: torch.Tensor, log_a_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`a`, the normalised input `u` and the reset input `x * sigmoid(gx)`, float32 `(T, L)`."""
    gx, ga = gates.float().chunk(2, dim=-1)
    log_a = log_a_scale * torch.sigmoid(ga)
    gated = x.float() * torch.sigmoid(gx)
    return torch.exp(log_a), gated * torch.sqrt(1 - torch.exp(2 * log_a)), gated


def rglru_varlen_ref(
    x: torch.Tensor,
    gates: torch.Tensor,
    log_a_scale: torch.Tensor,
    h_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The recurrence over packed sequences, each from its slot's state (or a reset).

    Args:
        x: `(T, L)` the conv outputs.
        gates: `(T, 2L)` the gate logits `[gx | ga]`.
        log_a_scale: `(L,)` float32, `-8 softplus(recurrent_param)`.
        h_states: `(S, L)` float32; each sequence's slot is read (when it has an initial
            state) and left holding the state after its last token.
        query_start_loc: `(B + 1,)` int32 cumulative token starts.
        state_indices: `(B,)` each sequence's slot (`PAD_SLOT_ID`: skipped).
        has_initial_state: `(B,)` bool; False: the first token resets the state.

    Returns:
        `(T, L)` in x's dtype (zeros for padding sequences and tokens past `qsl[B]`).
    """
    a, u, gated = _terms(x, gates, log_a_scale)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    starts = query_start_loc.tolist()
    for seq, slot in enumerate(state_indices.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        if slot == PAD_SLOT_ID or end <= begin:
            continue
        if bool(has_initial_state[seq]):
            h = a[begin] * h_states[slot].float() + u[begin]
        else:
            h = gated[begin].clone()
        out[begin] = h
        for t in range(begin + 1, end):
            h = a[t] * h + u[t]
            out[t] = h
        h_states[slot] = h.to(h_states.dtype)
    return out.to(x.dtype)


def rglru_update_ref(
    x: torch.Tensor,
    gates: torch.Tensor,
    log_a_scale: torch.Tensor,
    h_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row on top of its slot's state (decode: never a reset).

    Args:
        x: `(B, L)`; gates: `(B, 2L)`; log_a_scale: `(L,)` float32.
        h_states: `(S, L)` float32, advanced in place at `state_indices`.
        state_indices: `(B,)` each row's slot (`PAD_SLOT_ID`: skipped, output zeros).

    Returns:
        `(B, L)` in x's dtype.
    """
    a, u, _ = _terms(x, gates, log_a_scale)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    slots = state_indices.long()
    live = slots != PAD_SLOT_ID
    h = a[live] * h_states[slots[live]].float() + u[live]  # (live, L)
    h_states[slots[live]] = h.to(h_states.dtype)
    out[live] = h
    return out.to(x.dtype)


class VarlenOp(Protocol):
    def __call__(
        self, x: Tensor, gates: Tensor, log_a_scale: Tensor, h_states: Tensor,
        query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    ) -> Tensor: ...  # fmt: skip


class UpdateOp(Protocol):
    def __call__(
        self, x: Tensor, gates: Tensor, log_a_scale: Tensor, h_states: Tensor,
        state_indices: Tensor,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    FAMILY,
    {
        "varlen": OpSpec(VarlenOp, rglru_varlen_ref),
        "update": OpSpec(UpdateOp, rglru_update_ref),
    },
)
