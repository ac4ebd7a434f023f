"""The Triton SSD kernels against `ssd_chunk_scan_varlen_ref` / `ssd_state_update_ref`.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from tests.ops.test_ssd import NO_LIMIT, SSDCase, make_ssd_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.ssd import ssd_chunk_scan_varlen_ref, ssd_state_update_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.dispatch import get_mamba_ops  # noqa: E402
from vllm_mamba.ops.triton_ssd import _BLOCK_Q as Q  # noqa: E402
from vllm_mamba.ops.triton_ssd import ssd_chunk_scan_varlen, ssd_state_update  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
LOW_DTYPES = [torch.bfloat16, torch.float16]
# Sequences shorter and longer than the chunk sizes (the reference's and the kernel's `Q`).
LENS = [[5], [1, 7, 3, 12], [2, 1, 9, 17], [Q + 1, 2 * Q, Q - 1, 2 * Q + 6]]
# (heads, groups, head_dim, state size): one group, two, one per head; a head dim over the
# kernels' blocks (16 and 32); state sizes under and over 16, not powers of two.
SHAPES = [(4, 1, 3, 5), (4, 2, 40, 16), (4, 4, 16, 20), (6, 3, 5, 7)]


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


def _case(
    lens: list[int], device: torch.device, dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32, shape: tuple[int, int, int, int] = (4, 2, 3, 5),
    pad_rows: int = 2,
) -> SSDCase:  # fmt: skip
    """`make_ssd_case` on `device`, with x, dt, B_, C in `dtype` and the states in `state_dtype`."""
    heads, groups, head_dim, nstate = shape
    case = make_ssd_case(lens, heads, head_dim, groups, nstate, pad_rows=pad_rows)
    low = {"x", "dt", "B_", "C"}
    moved = {
        f.name: getattr(case, f.name).to(device, dtype if f.name in low else None)
        for f in dataclasses.fields(case)
    }
    moved["ssm_states"] = moved["ssm_states"].to(state_dtype)
    return SSDCase(**moved)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _assert_states(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, case) -> None:
    """Close on the used slots; bit-identical elsewhere (padding rows touch no slot)."""
    used = sorted(set(case.state_indices.tolist()) - {PAD_SLOT_ID})
    untouched = [s for s in range(before.shape[0]) if s not in used]
    torch.testing.assert_close(got[used].float(), want[used].float(), **_tol(got.dtype))
    assert torch.equal(got[untouched], before[untouched])


def _check_scan(case: SSDCase, chunk_size: int = 4, dt_limit=NO_LIMIT, full: bool = True) -> None:
    """Kernel and reference on copies of the same states: outputs (every token) and states."""
    dt = case.dt if full else case.dt.abs()
    opt = (case.D_skip, case.dt_bias) if full else (None, None)
    args = (case.x, dt, case.A, case.B_, case.C, *opt, full, dt_limit)
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state, chunk_size)
    before = case.ssm_states.clone()
    want_states = case.ssm_states.clone()
    want = ssd_chunk_scan_varlen_ref(*args, want_states, *meta)
    got = ssd_chunk_scan_varlen(*args, case.ssm_states, *meta)
    assert got.dtype == case.x.dtype and case.ssm_states.dtype == before.dtype
    torch.testing.assert_close(got.float(), want.float(), **_tol(case.x.dtype))
    _assert_states(case.ssm_states, want_states, before, case)


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_chunk_scan(device: torch.device, lens: list[int], chunk_size: int) -> None:
    _check_scan(_case(lens, device), chunk_size)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunk_scan_shapes(device: torch.device, shape: tuple[int, int, int, int]) -> None:
    _check_scan(_case([3, 6, 1], device, shape=shape), 4)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_chunk_scan_low_precision(device: torch.device, dtype, state_dtype) -> None:
    _check_scan(_case([1, 7, 3, 12], device, dtype, state_dtype, shape=(4, 2, 40, 16)), 8)


def test_chunk_scan_bfloat16_states(device: torch.device) -> None:
    _check_scan(_case([6, 9], device, state_dtype=torch.bfloat16), 4)


def test_chunk_scan_clamps_dt_to_limit(device: torch.device) -> None:
    _check_scan(_case([9, 4], device, shape=(4, 1, 3, 5)), 4, dt_limit=(0.2, 0.4))


def test_chunk_scan_without_optional_inputs(device: torch.device) -> None:
    """No D, no dt bias, no softplus, and no clamping of dt under the default limit."""
    _check_scan(_case([4, 9], device), 4, full=False)


def test_chunk_scan_strong_decay(device: torch.device) -> None:
    """Decays that underflow inside a chunk: no inf or nan, still the reference's result."""
    case = _case([2 * Q + 6, Q + 3], device)
    case.A = case.A * 30.0
    _check_scan(case, 16)


def test_chunk_scan_negative_dt_unclamped_without_softplus(device: torch.device) -> None:
    case = _case([5, 3], device)
    args = (case.x, case.dt, case.A, case.B_, case.C, None, None, False, NO_LIMIT)
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state, 4)
    want = ssd_chunk_scan_varlen_ref(*args, case.ssm_states.clone(), *meta)
    got = ssd_chunk_scan_varlen(*args, case.ssm_states, *meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_chunk_scan_padding_row_between_sequences(device: torch.device) -> None:
    case = _case([4, 2, 5, 3], device, pad_rows=1)
    case.state_indices[1] = PAD_SLOT_ID
    case.has_initial_state[:] = True
    _check_scan(case, 4)


def test_chunk_scan_strided_inputs(device: torch.device) -> None:
    """x, B_, C, dt split from one projection (as the mixer does); states a layer's view."""
    case = _case([3, 10], device, shape=(4, 2, 6, 5))
    tokens, heads, head_dim = case.x.shape
    gn = case.B_.shape[1] * case.B_.shape[2]
    packed = torch.cat(
        [case.x.flatten(1), case.B_.flatten(1), case.C.flatten(1), case.dt], dim=1
    )  # (T, H*P + 2*G*N + H)
    x, B_, C, dt = packed.split([heads * head_dim, gn, gn, heads], dim=1)
    case.x, case.dt = x.view(tokens, heads, head_dim), dt
    case.B_, case.C = B_.view_as(case.B_), C.view_as(case.C)
    layers = torch.randn(3, *case.ssm_states.shape, device=device)
    layers[1] = case.ssm_states
    others = layers[[0, 2]].clone()
    case.ssm_states = layers[1]
    _check_scan(case, 8)
    assert torch.equal(layers[[0, 2]], others)


@pytest.mark.parametrize(
    "cuts", [[2 * Q + 9], [5, 2 * Q + 4], [Q + 1, Q - 1, 9], [9, 1, 2 * Q - 1]]
)
def test_chunked_prefill_then_decode_equal_one_pass(device: torch.device, cuts) -> None:
    """One sequence in pieces that straddle chunk boundaries, then one decode step."""
    total = sum(cuts)
    case = _case([total + 1], device, pad_rows=0)
    want_states = case.ssm_states.clone()
    args = (case.A, case.B_, case.C, case.D_skip, case.dt_bias, True)
    whole = (case.x, case.dt, *args, NO_LIMIT, want_states, case.query_start_loc)
    no_init = torch.tensor([False], device=device)
    want = ssd_chunk_scan_varlen_ref(*whole, case.state_indices, no_init, 4)
    slot, outs, lo = case.state_indices, [], 0
    for i, n in enumerate(cuts):
        part = [t[lo : lo + n] for t in (case.x, case.dt, case.B_, case.C)]
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        init = torch.tensor([i > 0], device=device)
        y = ssd_chunk_scan_varlen(
            part[0], part[1], case.A, part[2], part[3], case.D_skip, case.dt_bias, True,
            NO_LIMIT, case.ssm_states, qsl, slot, init, 4,
        )  # fmt: skip
        outs.append(y)
        lo += n
    last = [t[total:] for t in (case.x, case.dt, case.B_, case.C)]
    y = ssd_state_update(
        case.ssm_states, last[0], last[1], case.A, last[2], last[3], case.D_skip,
        case.dt_bias, True, slot,
    )  # fmt: skip
    outs.append(y)
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-4)


def _check_update(case: SSDCase, full: bool = True) -> torch.Tensor:
    """Kernel and reference for one decode step; returns the kernel's outputs."""
    real = (case.state_indices != PAD_SLOT_ID).nonzero().flatten()
    dt = case.dt if full else case.dt.abs()
    opt = (case.D_skip, case.dt_bias) if full else (None, None)
    args = (case.x, dt, case.A, case.B_, case.C, *opt, full, case.state_indices)
    before = case.ssm_states.clone()
    want_states = case.ssm_states.clone()
    want = ssd_state_update_ref(want_states, *args)
    got = ssd_state_update(case.ssm_states, *args)
    assert got.dtype == case.x.dtype and case.ssm_states.dtype == before.dtype
    torch.testing.assert_close(got[real].float(), want[real].float(), **_tol(case.x.dtype))
    _assert_states(case.ssm_states, want_states, before, case)
    return got


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("full", [True, False])
def test_state_update(device: torch.device, shape: tuple[int, int, int, int], full: bool) -> None:
    _check_update(_case([1] * 5, device, shape=shape, pad_rows=3), full)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_DTYPES])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_update_dtypes(device: torch.device, dtype, state_dtype) -> None:
    _check_update(_case([1] * 4, device, dtype, state_dtype, shape=(4, 2, 40, 16)))


def test_state_update_padding_beside_slot_zero(device: torch.device) -> None:
    """Padding rows (also first in the batch) write nothing, even beside a real row of slot 0."""
    case = _case([1] * 3, device, pad_rows=2)
    case.state_indices[:] = torch.tensor([PAD_SLOT_ID, 0, 4, PAD_SLOT_ID, 2])
    _check_update(case)
    before = case.ssm_states.clone()
    case.state_indices[:] = PAD_SLOT_ID
    out = _check_update(case)
    assert out.shape == case.x.shape and torch.equal(case.ssm_states, before)


@pytest.mark.parametrize(
    "kernel, ref",
    [(ssd_chunk_scan_varlen, ssd_chunk_scan_varlen_ref), (ssd_state_update, ssd_state_update_ref)],
)
def test_signatures_match_references(kernel, ref) -> None:
    """The layers call the ops with keyword arguments, so the names must match the refs'."""
    assert inspect.signature(kernel).parameters.keys() == inspect.signature(ref).parameters.keys()


def test_dispatch_triton_uses_ssd_kernels(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_OPS", "triton")
    ops = get_mamba_ops(device)
    assert ops.ssd_chunk_scan_varlen is ssd_chunk_scan_varlen
    assert ops.ssd_state_update is ssd_state_update


@pytest.mark.cuda
@_NEEDS_CUDA
@pytest.mark.skipif(IN_INTERPRETER, reason="kernels are interpreted in this process")
def test_ssd_ops_under_cuda_graph() -> None:
    """A decode step and a prefill scan captured in one CUDA graph, replayed, match the refs."""
    device = torch.device("cuda")
    dec = _case([1] * 6, device, shape=(4, 2, 40, 16))
    pre = _case([3, 9, 5], device, shape=(4, 2, 40, 16))
    dec_args = (dec.x, dec.dt, dec.A, dec.B_, dec.C, dec.D_skip, dec.dt_bias, True)
    pre_args = (pre.x, pre.dt, pre.A, pre.B_, pre.C, pre.D_skip, pre.dt_bias, True, (0.0, 0.5))
    meta = (pre.query_start_loc, pre.state_indices, pre.has_initial_state, 8)

    def step(dec_states, pre_states, update, scan):
        y_dec = update(dec_states, *dec_args, dec.state_indices)
        return y_dec, scan(*pre_args, pre_states, *meta)

    want_dec, want_pre = dec.ssm_states.clone(), pre.ssm_states.clone()
    want = step(want_dec, want_pre, ssd_state_update_ref, ssd_chunk_scan_varlen_ref)
    step(dec.ssm_states.clone(), pre.ssm_states.clone(), ssd_state_update, ssd_chunk_scan_varlen)
    torch.cuda.synchronize()  # kernels compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(dec.ssm_states, pre.ssm_states, ssd_state_update, ssd_chunk_scan_varlen)
    graph.replay()
    torch.cuda.synchronize()
    real = dec.state_indices != PAD_SLOT_ID
    torch.testing.assert_close(got[0][real], want[0][real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dec.ssm_states, want_dec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pre.ssm_states, want_pre, rtol=1e-4, atol=1e-4)
