"""The pure-PyTorch op references against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import make_case, naive_conv, naive_scan
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.causal_conv1d import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
)
from vllm_mamba.ops.selective_scan import selective_scan_varlen_ref, selective_state_update_ref

LENS = [[5], [1, 7, 3, 12], [2, 1, 9]]


def _untouched_slots(case) -> list[int]:
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    return [s for s in range(case.conv_states.shape[0]) if s not in used]


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("width", [2, 4])
def test_conv_varlen_matches_naive(lens: list[int], width: int) -> None:
    case = make_case(lens, width=width)
    want, want_states = naive_conv(case)
    before = case.conv_states.clone()
    out = causal_conv1d_varlen_ref(
        case.x,
        case.conv_w,
        case.conv_b,
        case.conv_states,
        case.query_start_loc,
        case.state_indices,
        case.has_initial_state,
    )
    valid_tokens = slice(0, int(case.query_start_loc[-2]))
    torch.testing.assert_close(out[valid_tokens], want[valid_tokens], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.conv_states, want_states, rtol=1e-6, atol=1e-6)
    untouched = _untouched_slots(case)
    assert torch.equal(case.conv_states[untouched], before[untouched])


@pytest.mark.parametrize("lens", LENS)
def test_scan_varlen_matches_naive(lens: list[int]) -> None:
    case = make_case(lens)
    want, want_states = naive_scan(case, case.x)
    before = case.ssm_states.clone()
    out = selective_scan_varlen_ref(
        case.x,
        case.dt,
        case.A,
        case.B_,
        case.C,
        case.D_skip,
        case.z,
        case.dt_bias,
        True,
        case.ssm_states,
        case.query_start_loc,
        case.state_indices,
        case.has_initial_state,
    )
    valid_tokens = slice(0, int(case.query_start_loc[-2]))
    torch.testing.assert_close(out[valid_tokens], want[valid_tokens], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-5)
    untouched = _untouched_slots(case)
    assert torch.equal(case.ssm_states[untouched], before[untouched])


def test_decode_updates_match_naive() -> None:
    case = make_case([1, 1, 1, 1], pad_rows=2)
    case.has_initial_state[:] = True
    want_conv, want_conv_states = naive_conv(case)
    want_scan, want_ssm_states = naive_scan(case, case.x)
    conv_before, ssm_before = case.conv_states.clone(), case.ssm_states.clone()
    conv = causal_conv1d_update_ref(
        case.x, case.conv_states, case.conv_w, case.conv_b, case.state_indices
    )
    y = selective_state_update_ref(
        case.ssm_states,
        case.x,
        case.dt,
        case.A,
        case.B_,
        case.C,
        case.D_skip,
        case.z,
        case.dt_bias,
        True,
        case.state_indices,
    )
    torch.testing.assert_close(conv[:4], want_conv[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[:4], want_scan[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.conv_states, want_conv_states)
    torch.testing.assert_close(case.ssm_states, want_ssm_states)
    untouched = _untouched_slots(case)
    assert torch.equal(case.conv_states[untouched], conv_before[untouched])
    assert torch.equal(case.ssm_states[untouched], ssm_before[untouched])


@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_split_scan_equals_one_pass(pieces: int) -> None:
    """Conv + scan over one 21-token sequence, whole or in pieces with the state carried."""
    case = make_case([21], pad_rows=0)
    case.has_initial_state[:] = False
    slot = case.state_indices[:1]
    whole_conv_states, whole_ssm_states = case.conv_states.clone(), case.ssm_states.clone()
    qsl = torch.tensor([0, 21], dtype=torch.int32)
    no_init = torch.tensor([False])

    def run(lo: int, hi: int, conv_states, ssm_states, init) -> torch.Tensor:
        q = torch.tensor([0, hi - lo], dtype=torch.int32)
        xc = causal_conv1d_varlen_ref(
            case.x[lo:hi], case.conv_w, case.conv_b, conv_states, q, slot, init
        )
        return selective_scan_varlen_ref(
            xc,
            case.dt[lo:hi],
            case.A,
            case.B_[lo:hi],
            case.C[lo:hi],
            case.D_skip,
            case.z[lo:hi],
            case.dt_bias,
            True,
            ssm_states,
            q,
            slot,
            init,
        )

    assert qsl[-1] == 21
    whole = run(0, 21, whole_conv_states, whole_ssm_states, no_init)
    bounds = torch.linspace(0, 21, pieces + 1).round().long().tolist()
    parts = [
        run(lo, hi, case.conv_states, case.ssm_states, torch.tensor([lo > 0]))
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(case.ssm_states, whole_ssm_states, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(case.conv_states, whole_conv_states)
