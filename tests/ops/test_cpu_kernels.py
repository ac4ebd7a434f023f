"""The C++ CPU kernels (`vllm_mamba.ops.cpu_kernels`) against the pure-PyTorch references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.ops.cases import VarlenCase, make_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.causal_conv1d import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
)
from vllm_mamba.ops.dispatch import get_mamba_ops
from vllm_mamba.ops.selective_scan import selective_scan_varlen_ref, selective_state_update_ref

if not cpu_kernels.available():
    pytest.skip(
        "C++ extension vllm_mamba._C_<level> is not built (pip install --no-build-isolation -e .)",
        allow_module_level=True,
    )

LENS = [[5], [1, 7, 3, 12], [2, 1, 9, 40]]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2}}


def _clone(case: VarlenCase) -> VarlenCase:
    return dataclasses.replace(
        case, **{f.name: getattr(case, f.name).clone() for f in dataclasses.fields(case)}
    )


def _untouched_slots(case: VarlenCase) -> list[int]:
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    return [s for s in range(case.conv_states.shape[0]) if s not in used]


def _valid_tokens(case: VarlenCase) -> torch.Tensor:
    """(T,) mask of the tokens of non-padding sequences."""
    lens = case.query_start_loc.diff().long()
    return torch.repeat_interleave(case.state_indices != PAD_SLOT_ID, lens)


def _conv(fn, case: VarlenCase, activation: bool = True, bias: bool = True) -> torch.Tensor:
    return fn(
        case.x, case.conv_w, case.conv_b if bias else None, case.conv_states,
        case.query_start_loc, case.state_indices, case.has_initial_state, activation,
    )  # fmt: skip


def _scan(fn, case: VarlenCase, optional: bool = True, softplus: bool = True) -> torch.Tensor:
    D_skip, z, dt_bias = (case.D_skip, case.z, case.dt_bias) if optional else (None, None, None)
    return fn(
        case.x, case.dt, case.A, case.B_, case.C, D_skip, z, dt_bias, softplus,
        case.ssm_states, case.query_start_loc, case.state_indices, case.has_initial_state,
    )  # fmt: skip


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize("dim", [37, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_varlen_matches_ref(lens: list[int], width: int, dim: int, dtype) -> None:
    want = make_case(lens, dim=dim, width=width, pad_rows=2, dtype=dtype)
    got, before = _clone(want), want.conv_states.clone()
    out_want = _conv(causal_conv1d_varlen_ref, want)
    out_got = _conv(cpu_kernels.causal_conv1d_varlen, got)
    valid = _valid_tokens(want)
    assert out_got.dtype == dtype
    torch.testing.assert_close(out_got[valid], out_want[valid], **TOL[dtype])
    torch.testing.assert_close(got.conv_states, want.conv_states, rtol=0, atol=0)
    untouched = _untouched_slots(want)
    assert torch.equal(got.conv_states[untouched], before[untouched])


def test_conv_varlen_reads_rows_of_a_wider_tensor_in_place() -> None:
    """x as the leading channels of a wider projection output (token stride > D) gives the
    contiguous x's outputs and states bit for bit."""
    want = make_case([3, 20, 9], dim=300, width=4, pad_rows=1)
    got = _clone(want)
    wide = torch.cat([want.x, torch.randn(want.x.shape[0], 40)], dim=1)
    got = dataclasses.replace(got, x=wide[:, : want.x.shape[1]])
    assert got.x.stride(0) == 340
    out_want = _conv(cpu_kernels.causal_conv1d_varlen, want)
    out_got = _conv(cpu_kernels.causal_conv1d_varlen, got)
    assert torch.equal(out_got, out_want)
    assert torch.equal(got.conv_states, want.conv_states)


@pytest.mark.parametrize("activation", [True, False])
def test_conv_varlen_without_bias_or_activation(activation: bool) -> None:
    want = make_case([3, 6], dim=37, width=3)
    got = _clone(want)
    out_want = _conv(causal_conv1d_varlen_ref, want, activation, bias=False)
    out_got = _conv(cpu_kernels.causal_conv1d_varlen, got, activation, bias=False)
    valid = _valid_tokens(want)
    torch.testing.assert_close(out_got[valid], out_want[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.conv_states, want.conv_states, rtol=0, atol=0)


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("dim", [37, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_scan_varlen_matches_ref(lens: list[int], dim: int, dtype, state_dtype) -> None:
    want = make_case(lens, dim=dim, nstate=16, pad_rows=2, dtype=dtype)
    want.ssm_states = want.ssm_states.to(state_dtype)
    got, before = _clone(want), want.ssm_states.clone()
    out_want = _scan(selective_scan_varlen_ref, want)
    out_got = _scan(cpu_kernels.selective_scan_varlen, got)
    valid = _valid_tokens(want)
    assert out_got.dtype == dtype and got.ssm_states.dtype == state_dtype
    torch.testing.assert_close(out_got[valid], out_want[valid], **TOL[dtype])
    torch.testing.assert_close(got.ssm_states, want.ssm_states, **TOL[state_dtype])
    untouched = _untouched_slots(want)
    assert torch.equal(got.ssm_states[untouched], before[untouched])


@pytest.mark.parametrize("softplus", [True, False])
def test_scan_varlen_without_optional_inputs(softplus: bool) -> None:
    want = make_case([4, 9], dim=37, nstate=5)
    want.dt = want.dt.abs()  # positive time steps when softplus is off
    got = _clone(want)
    out_want = _scan(selective_scan_varlen_ref, want, optional=False, softplus=softplus)
    out_got = _scan(cpu_kernels.selective_scan_varlen, got, optional=False, softplus=softplus)
    valid = _valid_tokens(want)
    torch.testing.assert_close(out_got[valid], out_want[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.ssm_states, want.ssm_states, rtol=1e-5, atol=1e-5)


def _decode(conv_fn, scan_fn, case: VarlenCase) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: conv update, then selective state update on its output."""
    conv = conv_fn(case.x, case.conv_states, case.conv_w, case.conv_b, case.state_indices)
    y = scan_fn(
        case.ssm_states, conv, case.dt, case.A, case.B_, case.C, case.D_skip, case.z,
        case.dt_bias, True, case.state_indices,
    )  # fmt: skip
    return conv, y


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_updates_match_ref(width: int, dtype) -> None:
    want = make_case([1] * 6, dim=37, nstate=16, width=width, pad_rows=3, dtype=dtype)
    got = _clone(want)
    conv_before, ssm_before = want.conv_states.clone(), want.ssm_states.clone()
    conv_want, y_want = _decode(causal_conv1d_update_ref, selective_state_update_ref, want)
    conv_got, y_got = _decode(
        cpu_kernels.causal_conv1d_update, cpu_kernels.selective_state_update, got
    )
    rows = want.state_indices != PAD_SLOT_ID
    torch.testing.assert_close(conv_got[rows], conv_want[rows], **TOL[dtype])
    torch.testing.assert_close(y_got[rows], y_want[rows], **TOL[dtype])
    torch.testing.assert_close(got.conv_states, want.conv_states, rtol=0, atol=0)
    torch.testing.assert_close(got.ssm_states, want.ssm_states, rtol=1e-5, atol=1e-5)
    untouched = _untouched_slots(want)
    assert torch.equal(got.conv_states[untouched], conv_before[untouched])
    assert torch.equal(got.ssm_states[untouched], ssm_before[untouched])


@pytest.mark.parametrize("pieces", [2, 5])
def test_chunks_with_carried_state_match_one_ref_pass(pieces: int) -> None:
    """Conv + scan of one 50-token sequence in chunks equals the reference in one pass."""
    case = make_case([50], dim=37, nstate=16, width=4, pad_rows=0)
    case.has_initial_state[:] = False
    want = _clone(case)
    slot = case.state_indices
    xc = causal_conv1d_varlen_ref(
        want.x, want.conv_w, want.conv_b, want.conv_states, want.query_start_loc, slot,
        want.has_initial_state,
    )  # fmt: skip
    whole = selective_scan_varlen_ref(
        xc, want.dt, want.A, want.B_, want.C, want.D_skip, want.z, want.dt_bias, True,
        want.ssm_states, want.query_start_loc, slot, want.has_initial_state,
    )  # fmt: skip
    bounds = torch.linspace(0, 50, pieces + 1).round().long().tolist()
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        q = torch.tensor([0, hi - lo], dtype=torch.int32)
        init = torch.tensor([lo > 0])
        xp = cpu_kernels.causal_conv1d_varlen(
            case.x[lo:hi], case.conv_w, case.conv_b, case.conv_states, q, slot, init
        )
        parts.append(
            cpu_kernels.selective_scan_varlen(
                xp,
                case.dt[lo:hi],
                case.A,
                case.B_[lo:hi],
                case.C[lo:hi],
                case.D_skip,
                case.z[lo:hi],
                case.dt_bias,
                True,
                case.ssm_states,
                q,
                slot,
                init,
            )  # fmt: skip
        )
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.ssm_states, want.ssm_states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.conv_states, want.conv_states, rtol=1e-6, atol=1e-6)


def test_non_contiguous_inputs() -> None:
    """(T, D) views with a row stride wider than D, as split off a projection, are accepted."""
    want = make_case([3, 8], dim=37, nstate=16)
    got = _clone(want)
    wide = torch.randn(want.x.shape[0], 2 * 37 + 3)
    got.x, got.z = wide[:, :37], wide[:, 40:77]
    want.x, want.z = got.x.contiguous(), got.z.contiguous()
    bc = torch.randn(want.x.shape[0], 40)
    got.B_, got.C = bc[:, 3:19], bc[:, 20:36]
    want.B_, want.C = got.B_.contiguous(), got.C.contiguous()
    assert not got.x.is_contiguous() and not got.B_.is_contiguous()
    valid = _valid_tokens(want)
    torch.testing.assert_close(
        _conv(cpu_kernels.causal_conv1d_varlen, got)[valid],
        _conv(causal_conv1d_varlen_ref, want)[valid],
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        _scan(cpu_kernels.selective_scan_varlen, got)[valid],
        _scan(selective_scan_varlen_ref, want)[valid],
        rtol=1e-5,
        atol=1e-5,
    )


def test_dispatch_picks_cpp_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    assert get_mamba_ops("cpu").name == "cpp"
