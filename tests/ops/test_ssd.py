"""Mamba2's SSD references against a naive per-token, per-head loop."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.ssd import ssd_chunk_scan_varlen_ref, ssd_state_update_ref

NO_LIMIT = (0.0, float("inf"))


@dataclass
class SSDCase:
    """Packed inputs: x `(T, H, P)`, dt `(T, H)`, B_/C `(T, G, N)`, states `(S, H, P, N)`."""

    x: torch.Tensor
    dt: torch.Tensor
    B_: torch.Tensor
    C: torch.Tensor
    A: torch.Tensor
    D_skip: torch.Tensor
    dt_bias: torch.Tensor
    ssm_states: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


def make_ssd_case(
    lens: list[int], heads: int = 4, head_dim: int = 3, groups: int = 2, nstate: int = 5,
    num_slots: int = 10, pad_rows: int = 1, seed: int = 0,
) -> SSDCase:  # fmt: skip
    """`lens` sequences plus `pad_rows` one-token padding rows; odd ones start from a state."""
    g = torch.Generator().manual_seed(seed)
    lens = list(lens) + [1] * pad_rows
    total = sum(lens)
    slots = torch.randperm(num_slots, generator=g)[: len(lens)]
    slots[len(lens) - pad_rows :] = PAD_SLOT_ID
    return SSDCase(
        x=torch.randn(total, heads, head_dim, generator=g),
        dt=torch.randn(total, heads, generator=g) * 0.5,
        B_=torch.randn(total, groups, nstate, generator=g),
        C=torch.randn(total, groups, nstate, generator=g),
        A=-torch.exp(torch.randn(heads, generator=g) * 0.5),
        D_skip=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g) * 0.5 - 1.0,
        ssm_states=torch.randn(num_slots, heads, head_dim, nstate, generator=g),
        query_start_loc=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
        state_indices=slots.to(torch.int32),
        has_initial_state=torch.arange(len(lens)) % 2 == 1,
    )


def naive_ssd(case: SSDCase, dt_limit=NO_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, head by head; returns outputs `(T, H, P)` and the expected states."""
    heads, groups = case.x.shape[1], case.B_.shape[1]
    states = case.ssm_states.clone()
    y = torch.zeros_like(case.x)
    qsl = case.query_start_loc.tolist()
    for b, slot in enumerate(case.state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        h_state = states[slot].clone() if case.has_initial_state[b] else torch.zeros_like(states[0])
        for t in range(qsl[b], qsl[b + 1]):
            dt = F.softplus(case.dt[t] + case.dt_bias).clamp(*dt_limit)  # (H,)
            for h in range(heads):
                grp = h // (heads // groups)
                decay = torch.exp(dt[h] * case.A[h])
                h_state[h] = decay * h_state[h] + dt[h] * torch.outer(case.x[t, h], case.B_[t, grp])
                y[t, h] = h_state[h] @ case.C[t, grp] + case.D_skip[h] * case.x[t, h]
        states[slot] = h_state
    return y, states


def run_scan(case: SSDCase, chunk_size: int, dt_limit=NO_LIMIT) -> torch.Tensor:
    return ssd_chunk_scan_varlen_ref(
        case.x, case.dt, case.A, case.B_, case.C, case.D_skip, case.dt_bias, True, dt_limit,
        case.ssm_states, case.query_start_loc, case.state_indices, case.has_initial_state,
        chunk_size,
    )  # fmt: skip


def _untouched_slots(case: SSDCase) -> list[int]:
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    return [s for s in range(case.ssm_states.shape[0]) if s not in used]


@pytest.mark.parametrize("lens", [[5], [1, 7, 3, 12], [2, 1, 9, 17]])
@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_chunk_scan_matches_naive(lens: list[int], chunk_size: int) -> None:
    case = make_ssd_case(lens)
    want, want_states = naive_ssd(case)
    before = case.ssm_states.clone()
    out = run_scan(case, chunk_size)
    real = slice(0, int(case.query_start_loc[-2]))
    torch.testing.assert_close(out[real], want[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-4)
    untouched = _untouched_slots(case)
    assert torch.equal(case.ssm_states[untouched], before[untouched])


def test_chunk_scan_clamps_dt_to_limit() -> None:
    case = make_ssd_case([9, 4], groups=1)
    limit = (0.2, 0.4)
    want, want_states = naive_ssd(case, limit)
    out = run_scan(case, 4, limit)
    torch.testing.assert_close(out[:13], want[:13], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want[:13], naive_ssd(make_ssd_case([9, 4], groups=1))[0][:13])


def test_state_update_matches_naive() -> None:
    case = make_ssd_case([1, 1, 1, 1], pad_rows=2)
    case.has_initial_state[:] = True
    want, want_states = naive_ssd(case)
    before = case.ssm_states.clone()
    y = ssd_state_update_ref(
        case.ssm_states, case.x, case.dt, case.A, case.B_, case.C, case.D_skip, case.dt_bias,
        True, case.state_indices,
    )  # fmt: skip
    torch.testing.assert_close(y[:4], want[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-5, atol=1e-5)
    untouched = _untouched_slots(case)
    assert torch.equal(case.ssm_states[untouched], before[untouched])


@pytest.mark.parametrize("cuts", [[21], [5, 16], [3, 7, 11], [9, 1, 11]])
def test_split_scan_and_decode_equal_one_pass(cuts: list[int]) -> None:
    """One 22-token sequence: pieces that straddle chunk boundaries, then one decode step."""
    case = make_ssd_case([22], pad_rows=0)
    case.has_initial_state[:] = False
    want, want_states = naive_ssd(case)
    slot = case.state_indices
    states = case.ssm_states.clone()
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        outs.append(
            ssd_chunk_scan_varlen_ref(
                case.x[lo : lo + n],
                case.dt[lo : lo + n],
                case.A,
                case.B_[lo : lo + n],
                case.C[lo : lo + n],
                case.D_skip,
                case.dt_bias,
                True,
                NO_LIMIT,
                states,
                torch.tensor([0, n], dtype=torch.int32),
                slot,
                torch.tensor([i > 0]),
                4,
            )  # fmt: skip
        )
        lo += n
    outs.append(
        ssd_state_update_ref(
            states,
            case.x[21:],
            case.dt[21:],
            case.A,
            case.B_[21:],
            case.C[21:],
            case.D_skip,
            case.dt_bias,
            True,
            slot,
        )  # fmt: skip
    )
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-4)


def test_state_update_padding_rows_leave_slots_alone() -> None:
    """Padding rows write nothing, also beside a real row of slot 0, and in an all-padding batch."""
    case = make_ssd_case([1, 1, 1], pad_rows=2)
    case.has_initial_state[:] = True
    case.state_indices[:3] = torch.tensor([0, 4, 2], dtype=torch.int32)
    want, want_states = naive_ssd(case)
    args = (case.x, case.dt, case.A, case.B_, case.C, case.D_skip, case.dt_bias, True)
    y = ssd_state_update_ref(case.ssm_states, *args, case.state_indices)
    torch.testing.assert_close(y[:3], want[:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-5, atol=1e-5)
    before = case.ssm_states.clone()
    all_pad = torch.full((5,), PAD_SLOT_ID, dtype=torch.int32)
    ssd_state_update_ref(case.ssm_states, *args, all_pad)
    assert torch.equal(case.ssm_states, before)
