"""The Triton `short_conv` kernels (LFM2's gated short conv) against the references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. The interpreter is slow,
so the shapes are tiny.

Tolerances: in float32 kernel and reference compute `u = B * x` alike and sum the K taps in
different orders, a few float32 ulps on values of order 1 (checked at 1e-5). Where a result is
rounded to bfloat16 both sides round their float32 values, one rounding apart at most: one
bfloat16 ulp (2^-8 relative), checked at 1e-2. States hold `u` itself: equal in float32; in
bfloat16 the interpreter truncates where the reference rounds to nearest even, one ulp apart.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.short_conv import short_conv_update_ref, short_conv_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_short_conv import short_conv_update, short_conv_varlen  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
BLOCK_T = 16  # the varlen kernel's token block
# Shorter than the history, one token, empty, longer than two token blocks; row 1 is padding.
LENS = [2, 1, 0, 2 * BLOCK_T + 5]


@dataclasses.dataclass
class SCCase:
    """One call's inputs; the update reads one token per row."""

    bcx: torch.Tensor  # (T, 3D)
    conv_states: torch.Tensor  # (S, D, K - 1)
    weight: torch.Tensor  # (D, K)
    bias: torch.Tensor | None  # (D,)
    query_start_loc: torch.Tensor  # (B + 1,) int32
    state_indices: torch.Tensor  # (B,) int32, PAD_SLOT_ID for padding rows
    has_initial_state: torch.Tensor  # (B,) bool

    def meta(self) -> tuple[torch.Tensor, ...]:
        return self.query_start_loc, self.state_indices, self.has_initial_state


def make_case(
    lens: list[int], device: torch.device, dim: int = 20, width: int = 3, bias: bool = True,
    pads: tuple[int, ...] = (1,), dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32, seed: int = 0,
) -> SCCase:  # fmt: skip
    """Random inputs for sequences of `lens` tokens; rows `pads` are padding, the others take
    distinct slots of `len(lens) + 2`, every other one with an initial state."""
    gen = torch.Generator().manual_seed(seed)
    tokens, batch = sum(lens), len(lens)
    slots = torch.randperm(batch + 2, generator=gen)[:batch].to(torch.int32)
    slots[list(pads)] = PAD_SLOT_ID
    case = SCCase(
        bcx=torch.randn(tokens, 3 * dim, generator=gen).to(dtype),
        conv_states=torch.randn(batch + 2, dim, width - 1, generator=gen).to(state_dtype),
        weight=torch.randn(dim, width, generator=gen) * 0.5,
        bias=torch.randn(dim, generator=gen) * 0.5 if bias else None,
        query_start_loc=torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        state_indices=slots, has_initial_state=torch.arange(batch) % 2 == 0,
    )  # fmt: skip
    moved = {
        f.name: getattr(case, f.name).to(device)
        for f in dataclasses.fields(case)
        if getattr(case, f.name) is not None
    }
    return dataclasses.replace(case, **moved)


def _tol(*dtypes: torch.dtype) -> dict[str, float]:
    if all(d == torch.float32 for d in dtypes):
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-2, "atol": 1e-2}


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


def _assert_states(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> None:
    """Close where the reference wrote; bit-identical where it did not (padding, free slots)."""
    written = (want != before).flatten(1).any(1)  # (S,)
    torch.testing.assert_close(got[written].float(), want[written].float(), **_tol(got.dtype))
    assert torch.equal(got[~written], before[~written])


def _check_varlen(case: SCCase) -> torch.Tensor:
    """Kernel and reference on copies of the same states: outputs (every token) and states."""
    before = case.conv_states.clone()
    want_states = before.clone()
    want = short_conv_varlen_ref(case.bcx, want_states, case.weight, case.bias, *case.meta())
    got = short_conv_varlen(case.bcx, case.conv_states, case.weight, case.bias, *case.meta())
    assert got.dtype == case.bcx.dtype and case.conv_states.dtype == before.dtype
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    _assert_states(case.conv_states, want_states, before)
    return got


def _check_update(case: SCCase) -> torch.Tensor:
    """Kernel and reference for one decode step (one token per row); returns the outputs."""
    before = case.conv_states.clone()
    want_states = before.clone()
    args = (case.weight, case.bias, case.state_indices)
    want = short_conv_update_ref(case.bcx, want_states, *args)
    got = short_conv_update(case.bcx, case.conv_states, *args)
    assert got.dtype == case.bcx.dtype and case.conv_states.dtype == before.dtype
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    _assert_states(case.conv_states, want_states, before)
    return got


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_varlen(device: torch.device, width: int, bias: bool) -> None:
    _check_varlen(make_case(LENS, device, width=width, bias=bias))


@pytest.mark.parametrize("initial", [False, True])
def test_varlen_initial_states(device: torch.device, initial: bool) -> None:
    case = make_case([BLOCK_T + 2, 1], device, pads=())
    case.has_initial_state[:] = initial
    _check_varlen(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_bfloat16(device: torch.device, dtype: torch.dtype) -> None:
    """bfloat16 states (read and written), with float32 or bfloat16 inputs."""
    _check_varlen(make_case([7, 2], device, pads=(), dtype=dtype, state_dtype=torch.bfloat16))


def test_varlen_padding_and_empty_rows(device: torch.device) -> None:
    """Padding rows first and between sequences, and an empty sequence: none touches a slot."""
    case = make_case([3, 0, 6, 2, 1], device, dim=70, pads=(0, 3))
    case.has_initial_state[:] = True
    _check_varlen(case)


def test_varlen_strided_bcx(device: torch.device) -> None:
    """bcx a column slice of a wider projection output; states a layer's view."""
    case = make_case([4, BLOCK_T + 1], device, pads=())
    wide = torch.randn(case.bcx.shape[0], case.bcx.shape[1] + 6, device=device)
    wide[:, 2:-4] = case.bcx
    case.bcx = wide[:, 2:-4]
    layers = torch.randn(3, *case.conv_states.shape, device=device)
    layers[1] = case.conv_states
    others = layers[[0, 2]].clone()
    case.conv_states = layers[1]
    _check_varlen(case)
    assert torch.equal(layers[[0, 2]], others)


@pytest.mark.parametrize("cuts", [[BLOCK_T + 5, 1, 9], [1, 2 * BLOCK_T - 1, 2]])
def test_cut_sequence_then_decode_equal_one_pass(device: torch.device, cuts: list[int]) -> None:
    """One sequence in pieces cut anywhere, then two decode steps, against one reference pass."""
    total = sum(cuts)
    case = make_case([total + 2], device, width=4, pads=(), seed=1)
    case.has_initial_state[:] = False
    want_states = case.conv_states.clone()
    want = short_conv_varlen_ref(case.bcx, want_states, case.weight, case.bias, *case.meta())
    params = (case.conv_states, case.weight, case.bias)
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        init = torch.tensor([i > 0], device=device)
        outs.append(
            short_conv_varlen(case.bcx[lo : lo + n], *params, qsl, case.state_indices, init)
        )
        lo += n
    for t in range(total, total + 2):
        outs.append(short_conv_update(case.bcx[t : t + 1], *params, case.state_indices))
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.conv_states, want_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_update(device: torch.device, width: int, bias: bool) -> None:
    _check_update(make_case([1] * 5, device, dim=70, width=width, bias=bias, pads=(0, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_bfloat16_states(device: torch.device, dtype: torch.dtype) -> None:
    _check_update(make_case([1] * 4, device, pads=(1,), dtype=dtype, state_dtype=torch.bfloat16))


def test_update_all_padding(device: torch.device) -> None:
    """Only padding rows: no slot written."""
    case = make_case([1] * 3, device, pads=(0, 1, 2))
    before = case.conv_states.clone()
    _check_update(case)
    assert torch.equal(case.conv_states, before)


@pytest.mark.cuda
@_NEEDS_CUDA
def test_update_in_cuda_graph() -> None:
    """The update launcher captures in a CUDA graph and replays with new inputs in place."""
    case = make_case([1] * 4, torch.device("cuda"), pads=(2,))
    start = case.conv_states.clone()
    args = (case.weight, case.bias, case.state_indices)
    short_conv_update(case.bcx, case.conv_states.clone(), *args)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = short_conv_update(case.bcx, case.conv_states, *args)
    case.conv_states.copy_(start)
    case.bcx.mul_(-1.0)
    graph.replay()
    want_states = start.clone()
    want = short_conv_update_ref(case.bcx, want_states, *args)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.conv_states, want_states, rtol=1e-5, atol=1e-5)
