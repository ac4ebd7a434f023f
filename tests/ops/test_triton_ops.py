"""The Triton kernels against the pure-PyTorch references, on the CPU and on a GPU.

On the CPU the kernels run in the Triton interpreter, in the child pytest process that
`test_triton_interpreter` starts for every Triton test module (see there why).
The GPU tests carry the `cuda` marker and skip without a CUDA device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.ops.cases import VarlenCase, make_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.causal_conv1d import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
)
from vllm_mamba.ops.selective_scan import selective_scan_varlen_ref, selective_state_update_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops import triton_ops  # noqa: E402
from vllm_mamba.ops.dispatch import get_mamba_ops  # noqa: E402
from vllm_mamba.ops.triton_conv1d import causal_conv1d_update, causal_conv1d_varlen  # noqa: E402
from vllm_mamba.ops.triton_selective_scan import (  # noqa: E402
    selective_scan_varlen,
    selective_state_update,
)

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Several sequences, one longer than a token tile (16), one shorter than the conv history.
LENS = [[5], [1, 7, 3, 12], [2, 1, 19]]


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


def _on(case: VarlenCase, device: torch.device) -> VarlenCase:
    """The case with every tensor moved to `device`."""
    moved = {f.name: getattr(case, f.name).to(device) for f in dataclasses.fields(case)}
    return VarlenCase(**moved)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _assert_states(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, case) -> None:
    """Close on the used slots; bit-identical elsewhere (padding rows touch no slot)."""
    used = sorted(set(case.state_indices.tolist()) - {PAD_SLOT_ID})
    untouched = [s for s in range(before.shape[0]) if s not in used]
    torch.testing.assert_close(got[used].float(), want[used].float(), **_tol(got.dtype))
    assert torch.equal(got[untouched], before[untouched])


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d_varlen(device: torch.device, lens: list[int], width: int, dtype) -> None:
    case = _on(make_case(lens, dim=72, width=width, pad_rows=2, dtype=dtype), device)
    before = case.conv_states.clone()
    want_states = case.conv_states.clone()
    args = (case.query_start_loc, case.state_indices, case.has_initial_state)
    want = causal_conv1d_varlen_ref(case.x, case.conv_w, case.conv_b, want_states, *args)
    got = causal_conv1d_varlen(case.x, case.conv_w, case.conv_b, case.conv_states, *args)
    assert got.dtype == dtype
    real = slice(0, int(case.query_start_loc[-3]))  # tokens of the non-padding sequences
    torch.testing.assert_close(got[real].float(), want[real].float(), **_tol(dtype))
    _assert_states(case.conv_states, want_states, before, case)


@pytest.mark.parametrize("width", [1, 3])
def test_conv1d_varlen_no_bias_no_activation(device: torch.device, width: int) -> None:
    case = _on(make_case([3, 6], dim=40, width=width), device)
    want_states = case.conv_states.clone()
    args = (case.query_start_loc, case.state_indices, case.has_initial_state, False)
    want = causal_conv1d_varlen_ref(case.x, case.conv_w, None, want_states, *args)
    got = causal_conv1d_varlen(case.x, case.conv_w, None, case.conv_states, *args)
    torch.testing.assert_close(got[:9], want[:9], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.conv_states, want_states)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d_update(device: torch.device, width: int, dtype) -> None:
    case = _on(make_case([1] * 5, dim=72, width=width, pad_rows=3, dtype=dtype), device)
    before = case.conv_states.clone()
    want_states = case.conv_states.clone()
    want = causal_conv1d_update_ref(
        case.x, want_states, case.conv_w, case.conv_b, case.state_indices
    )
    got = causal_conv1d_update(
        case.x, case.conv_states, case.conv_w, case.conv_b, case.state_indices
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got[:5].float(), want[:5].float(), **_tol(dtype))
    _assert_states(case.conv_states, want_states, before, case)


def _scan_args(case: VarlenCase, full: bool) -> tuple:
    """(u, dt, A, B_, C, D_skip, z, dt_bias, dt_softplus), optional parts dropped if not full."""
    if full:
        return (case.x, case.dt, case.A, case.B_, case.C, case.D_skip, case.z, case.dt_bias, True)
    return (case.x, case.dt.abs(), case.A, case.B_, case.C, None, None, None, False)


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_varlen(device: torch.device, lens: list[int], dtype, state_dtype) -> None:
    case = _on(make_case(lens, dim=40, pad_rows=2, dtype=dtype), device)
    case.ssm_states = case.ssm_states.to(state_dtype)
    before = case.ssm_states.clone()
    want_states = case.ssm_states.clone()
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state)
    want = selective_scan_varlen_ref(*_scan_args(case, True), want_states, *meta)
    got = selective_scan_varlen(*_scan_args(case, True), case.ssm_states, *meta)
    assert got.dtype == dtype and case.ssm_states.dtype == state_dtype
    real = slice(0, int(case.query_start_loc[-3]))
    tol = _tol(dtype) if dtype != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got[real].float(), want[real].float(), **tol)
    _assert_states(case.ssm_states, want_states, before, case)


def test_selective_scan_varlen_without_optional_inputs(device: torch.device) -> None:
    case = _on(make_case([4, 9], dim=72), device)
    want_states = case.ssm_states.clone()
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state)
    want = selective_scan_varlen_ref(*_scan_args(case, False), want_states, *meta)
    got = selective_scan_varlen(*_scan_args(case, False), case.ssm_states, *meta)
    torch.testing.assert_close(got[:13], want[:13], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("full", [True, False])
def test_selective_state_update(device: torch.device, dtype, state_dtype, full: bool) -> None:
    case = _on(make_case([1] * 5, dim=72, pad_rows=3, dtype=dtype), device)
    case.ssm_states = case.ssm_states.to(state_dtype)
    before = case.ssm_states.clone()
    want_states = case.ssm_states.clone()
    u, dt, A, B_, C, D_skip, z, dt_bias, softplus = _scan_args(case, full)
    rest = (A, B_, C, D_skip, z, dt_bias, softplus, case.state_indices)
    want = selective_state_update_ref(want_states, u, dt, *rest)
    got = selective_state_update(case.ssm_states, u, dt, *rest)
    assert got.dtype == dtype
    tol = _tol(dtype) if dtype != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got[:5].float(), want[:5].float(), **tol)
    _assert_states(case.ssm_states, want_states, before, case)


def test_dispatch_selects_triton(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MAMBA_OPS", "triton")
    assert triton_ops.available()
    assert get_mamba_ops(device).name == "triton"


@pytest.mark.cuda
@_NEEDS_CUDA
@pytest.mark.skipif(IN_INTERPRETER, reason="kernels are interpreted in this process")
def test_decode_ops_under_cuda_graph() -> None:
    """Both decode ops captured in one CUDA graph, replayed, match the references."""
    case = _on(make_case([1] * 6, dim=72, pad_rows=2), torch.device("cuda"))
    conv_want, ssm_want = case.conv_states.clone(), case.ssm_states.clone()
    rest = (case.A, case.B_, case.C, case.D_skip, case.z, case.dt_bias, True, case.state_indices)

    def step(conv_states: torch.Tensor, ssm_states: torch.Tensor, conv_op, ssm_op):
        xc = conv_op(case.x, conv_states, case.conv_w, case.conv_b, case.state_indices)
        return ssm_op(ssm_states, xc, case.dt, *rest)

    want = step(conv_want, ssm_want, causal_conv1d_update_ref, selective_state_update_ref)
    conv_states, ssm_states = case.conv_states.clone(), case.ssm_states.clone()
    step(conv_states.clone(), ssm_states.clone(), causal_conv1d_update, selective_state_update)
    torch.cuda.synchronize()  # kernels compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(conv_states, ssm_states, causal_conv1d_update, selective_state_update)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got[:6], want[:6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_states, conv_want)
    torch.testing.assert_close(ssm_states, ssm_want, rtol=1e-4, atol=1e-5)
