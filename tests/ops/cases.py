"""Random varlen inputs for the Mamba ops and a naive per-token loop to check them against.

Shared by the tests of every implementation (reference, C++, Triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID


@dataclass
class VarlenCase:
    """One packed batch with its per-slot states.

    Shapes: x, dt, z `(T, D)`; B_, C `(T, N)`; A `(D, N)`; conv_w `(D, K)`;
    conv_states `(S, D, K - 1)`; ssm_states `(S, D, N)`.
    """

    x: torch.Tensor
    dt: torch.Tensor
    z: torch.Tensor
    B_: torch.Tensor
    C: torch.Tensor
    A: torch.Tensor
    D_skip: torch.Tensor
    dt_bias: torch.Tensor
    conv_w: torch.Tensor
    conv_b: torch.Tensor
    conv_states: torch.Tensor
    ssm_states: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


def make_case(
    lens: list[int],
    dim: int = 24,
    nstate: int = 8,
    width: int = 4,
    num_slots: int = 10,
    pad_rows: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> VarlenCase:
    """Builds a packed batch of `lens` sequences plus `pad_rows` padding sequences of length 1.

    Sequences take distinct random slots; odd-numbered ones start from a saved state.
    """
    g = torch.Generator().manual_seed(seed)
    lens = list(lens) + [1] * pad_rows
    total = sum(lens)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    slots = torch.randperm(num_slots, generator=g)[: len(lens)]
    slots[len(lens) - pad_rows :] = PAD_SLOT_ID
    return VarlenCase(
        x=rnd(total, dim),
        dt=rnd(total, dim, scale=0.5),
        z=rnd(total, dim),
        B_=rnd(total, nstate),
        C=rnd(total, nstate),
        A=-torch.exp(torch.randn(dim, nstate, generator=g) * 0.5),
        D_skip=torch.randn(dim, generator=g),
        dt_bias=torch.randn(dim, generator=g) * 0.5 - 1.0,
        conv_w=rnd(dim, width, scale=0.5),
        conv_b=rnd(dim, scale=0.5),
        conv_states=rnd(num_slots, dim, width - 1),
        ssm_states=torch.randn(num_slots, dim, nstate, generator=g),
        query_start_loc=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
        state_indices=slots.to(torch.int32),
        has_initial_state=torch.arange(len(lens)) % 2 == 1,
    )


def naive_conv(case: VarlenCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence, per-token causal conv with SiLU; returns (out, new conv_states)."""
    out = torch.zeros_like(case.x, dtype=torch.float32)
    states = case.conv_states.clone().float()
    width = case.conv_w.shape[1]
    qsl = case.query_start_loc.tolist()
    for b, slot in enumerate(case.state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        hist = states[slot].clone() if case.has_initial_state[b] else states[slot] * 0
        for t in range(qsl[b], qsl[b + 1]):
            window = torch.cat([hist, case.x[t].float()[:, None]], dim=1)  # (D, K)
            acc = (window * case.conv_w.float()).sum(1) + case.conv_b.float()
            out[t] = F.silu(acc)
            hist = window[:, 1:] if width > 1 else hist
        states[slot] = hist
    return out, states


def naive_scan(case: VarlenCase, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence, per-token selective scan; returns (out, new ssm_states)."""
    out = torch.zeros_like(u, dtype=torch.float32)
    states = case.ssm_states.clone().float()
    qsl = case.query_start_loc.tolist()
    A = case.A.float()
    for b, slot in enumerate(case.state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        h = states[slot].clone() if case.has_initial_state[b] else torch.zeros_like(states[slot])
        for t in range(qsl[b], qsl[b + 1]):
            d = F.softplus(case.dt[t].float() + case.dt_bias)  # (D,)
            h = (
                torch.exp(d[:, None] * A) * h
                + d[:, None] * case.B_[t].float() * u[t].float()[:, None]
            )
            y = h @ case.C[t].float() + case.D_skip * u[t].float()
            out[t] = y * F.silu(case.z[t].float())
        states[slot] = h
    return out, states
