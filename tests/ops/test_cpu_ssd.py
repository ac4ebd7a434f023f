"""The C++ SSD kernels (Mamba2's varlen scan and decode update) against their `_ref` twins."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.ops.test_ssd import NO_LIMIT, SSDCase, make_ssd_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.ssd import ssd_chunk_scan_varlen_ref, ssd_state_update_ref

if not cpu_kernels.available():
    pytest.skip(
        "C++ extension vllm_mamba._C_<level> is not built (pip install --no-build-isolation -e .)",
        allow_module_level=True,
    )

TIGHT = {"rtol": 1e-4, "atol": 1e-4}
TOL = {torch.float32: TIGHT, torch.bfloat16: {"rtol": 2e-2, "atol": 3e-2}}


def _clone(case: SSDCase) -> SSDCase:
    return dataclasses.replace(
        case, **{f.name: getattr(case, f.name).clone() for f in dataclasses.fields(case)}
    )


def _cast(case: SSDCase, dtype: torch.dtype) -> SSDCase:
    """Activations in `dtype` (the state stays float32, as the model keeps it)."""
    return dataclasses.replace(
        case, x=case.x.to(dtype), dt=case.dt.to(dtype), B_=case.B_.to(dtype), C=case.C.to(dtype)
    )


def _scan(fn, case: SSDCase, chunk_size: int, dt_limit=NO_LIMIT, skip: bool = True):
    return fn(
        x=case.x, dt=case.dt, A=case.A, B_=case.B_, C=case.C,
        D_skip=case.D_skip if skip else None, dt_bias=case.dt_bias if skip else None,
        dt_softplus=True, dt_limit=dt_limit, ssm_states=case.ssm_states,
        query_start_loc=case.query_start_loc, state_indices=case.state_indices,
        has_initial_state=case.has_initial_state, chunk_size=chunk_size,
    )  # fmt: skip


def _real_tokens(case: SSDCase) -> torch.Tensor:
    lens = case.query_start_loc.diff().long()
    return torch.repeat_interleave(case.state_indices != PAD_SLOT_ID, lens)


def _check_scan(want: SSDCase, chunk_size: int, dtype=torch.float32, **kw) -> None:
    got, before = _clone(want), want.ssm_states.clone()
    out_want = _scan(ssd_chunk_scan_varlen_ref, want, chunk_size, **kw)
    out_got = _scan(cpu_kernels.ssd_chunk_scan_varlen, got, chunk_size, **kw)
    real = _real_tokens(want)
    assert out_got.dtype == want.x.dtype
    torch.testing.assert_close(out_got[real], out_want[real], **TOL[dtype])
    torch.testing.assert_close(got.ssm_states, want.ssm_states, **TOL[dtype])
    used = set(want.state_indices.tolist()) - {PAD_SLOT_ID}
    untouched = [s for s in range(want.ssm_states.shape[0]) if s not in used]
    assert torch.equal(got.ssm_states[untouched], before[untouched])


@pytest.mark.parametrize("lens", [[5], [1, 7, 3, 12], [2, 1, 9, 40]])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 256])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_scan_matches_ref(lens: list[int], chunk_size: int, groups: int) -> None:
    _check_scan(make_ssd_case(lens, heads=4, groups=groups, pad_rows=2), chunk_size)


@pytest.mark.parametrize("head_dim", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("nstate", [5, 16, 128])
def test_scan_head_dims_and_state_sizes(head_dim: int, nstate: int) -> None:
    case = make_ssd_case([6, 19], heads=3, head_dim=head_dim, groups=1, nstate=nstate)
    _check_scan(case, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_activation_dtypes(dtype: torch.dtype) -> None:
    _check_scan(_cast(make_ssd_case([3, 11, 30], heads=4, groups=2), dtype), 8, dtype)


def test_scan_clamps_dt_and_runs_without_optional_inputs() -> None:
    case = make_ssd_case([9, 4], groups=1)
    _check_scan(case, 4, dt_limit=(0.2, 0.4))
    _check_scan(make_ssd_case([9, 4], groups=1), 4, skip=False)


def test_scan_bfloat16_state() -> None:
    case = make_ssd_case([7, 13], groups=2)
    case.ssm_states = case.ssm_states.bfloat16()
    got = _clone(case)
    out_want = _scan(ssd_chunk_scan_varlen_ref, case, 4)
    out_got = _scan(cpu_kernels.ssd_chunk_scan_varlen, got, 4)
    real = _real_tokens(case)
    torch.testing.assert_close(out_got[real], out_want[real], **TOL[torch.bfloat16])
    torch.testing.assert_close(got.ssm_states, case.ssm_states, **TOL[torch.bfloat16])


def test_scan_reads_strided_views() -> None:
    """x, B, C and dt split off one projection (a free token stride) are read in place."""
    want = make_ssd_case([5, 8], heads=4, head_dim=3, groups=2, nstate=5)
    got = _clone(want)
    t = want.x.shape[0]
    wide = torch.randn(t, 12 + 20 + 4 + 7)
    x, b, c, dt, _ = wide.split([12, 10, 10, 4, 7], dim=-1)
    got.x, got.B_, got.C, got.dt = x.view(t, 4, 3), b.view(t, 2, 5), c.view(t, 2, 5), dt
    want.x, want.B_, want.C, want.dt = (v.contiguous() for v in (got.x, got.B_, got.C, got.dt))
    assert not got.x.is_contiguous()
    out_want = _scan(ssd_chunk_scan_varlen_ref, want, 4)
    out_got = _scan(cpu_kernels.ssd_chunk_scan_varlen, got, 4)
    real = _real_tokens(want)
    torch.testing.assert_close(out_got[real], out_want[real], **TIGHT)
    torch.testing.assert_close(got.ssm_states, want.ssm_states, **TIGHT)


@pytest.mark.parametrize("cuts", [[21], [5, 16], [3, 7, 11], [9, 1, 11]])
def test_chunked_prefill_at_any_cut_then_decode(cuts: list[int]) -> None:
    """Pieces cut anywhere (not at chunk multiples), then a decode: equal to one ref pass."""
    case = make_ssd_case([22], heads=4, groups=2, pad_rows=0)
    case.has_initial_state[:] = False
    want = _clone(case)
    whole = _scan(ssd_chunk_scan_varlen_ref, want, 4)
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        piece = dataclasses.replace(
            case, x=case.x[lo : lo + n], dt=case.dt[lo : lo + n], B_=case.B_[lo : lo + n],
            C=case.C[lo : lo + n], query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            has_initial_state=torch.tensor([i > 0]),
        )  # fmt: skip
        outs.append(_scan(cpu_kernels.ssd_chunk_scan_varlen, piece, 4))
        lo += n
    outs.append(
        cpu_kernels.ssd_state_update(
            case.ssm_states,
            case.x[21:],
            case.dt[21:],
            case.A,
            case.B_[21:],
            case.C[21:],
            case.D_skip,
            case.dt_bias,
            True,
            case.state_indices,
        )  # fmt: skip
    )
    torch.testing.assert_close(torch.cat(outs), whole, **TIGHT)
    torch.testing.assert_close(case.ssm_states, want.ssm_states, **TIGHT)


def _update(fn, case: SSDCase, skip: bool = True) -> torch.Tensor:
    return fn(
        ssm_states=case.ssm_states, x=case.x, dt=case.dt, A=case.A, B_=case.B_, C=case.C,
        D_skip=case.D_skip if skip else None, dt_bias=case.dt_bias if skip else None,
        dt_softplus=True, state_indices=case.state_indices,
    )  # fmt: skip


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_update_matches_ref(groups: int, head_dim: int, dtype: torch.dtype) -> None:
    want = _cast(make_ssd_case([1] * 6, heads=4, head_dim=head_dim, groups=groups, nstate=16,
                               pad_rows=3), dtype)  # fmt: skip
    want.state_indices[:6] = torch.tensor([0, 3, 5, 1, 9, 6], dtype=torch.int32)  # slot 0 too
    got, before = _clone(want), want.ssm_states.clone()
    y_want = _update(ssd_state_update_ref, want)
    y_got = _update(cpu_kernels.ssd_state_update, got)
    rows = want.state_indices != PAD_SLOT_ID
    torch.testing.assert_close(y_got[rows], y_want[rows], **TOL[dtype])
    torch.testing.assert_close(got.ssm_states, want.ssm_states, **TIGHT)
    used = set(want.state_indices.tolist()) - {PAD_SLOT_ID}
    untouched = [s for s in range(want.ssm_states.shape[0]) if s not in used]
    assert torch.equal(got.ssm_states[untouched], before[untouched])


def test_state_update_without_optional_inputs_and_all_padding() -> None:
    want = make_ssd_case([1] * 4, pad_rows=0)
    got = _clone(want)
    y_want = _update(ssd_state_update_ref, want, skip=False)
    torch.testing.assert_close(_update(cpu_kernels.ssd_state_update, got, skip=False), y_want)
    torch.testing.assert_close(got.ssm_states, want.ssm_states, **TIGHT)
    before = got.ssm_states.clone()
    got.state_indices[:] = PAD_SLOT_ID
    _update(cpu_kernels.ssd_state_update, got)
    assert torch.equal(got.ssm_states, before)


def test_cpp_table_runs_the_ssd_kernels() -> None:
    ops = cpu_kernels.make_ops()
    assert ops.ssd_chunk_scan_varlen is cpu_kernels.ssd_chunk_scan_varlen
    assert ops.ssd_state_update is cpu_kernels.ssd_state_update
