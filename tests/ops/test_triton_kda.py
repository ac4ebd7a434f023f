"""The Triton Kimi Delta Attention kernels against the `kda` references, with Kimi's softplus
gate (`lower_bound` 0) and the bounded safe gate (`lower_bound` -5).

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. The interpreter is slow,
so the shapes are tiny.

Tolerances: with float32 states, inputs and outputs, kernel (the recurrent form) and reference
(the chunked form) differ only in the order of float32 sums, about 1e-6 on values of order 1,
checked at 1e-4. Where a result is rounded to bfloat16 (bfloat16 states or inputs) both sides
round their float32 values, and one rounding apart is one bfloat16 ulp (2^-8 relative),
checked at 1e-2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.kda import kda_norm_gate_ref, kda_update_ref, kda_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_kda import kda_norm_gate, kda_update, kda_varlen  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
CHUNK = 16  # the reference's chunk (the kernel runs token by token)
# (Hk, Hv, Dk, Dv): one and two value heads per key head, Dk != Dv, and head dims that are not
# powers of two (masked lanes of the kernels' blocks).
SHAPES = [(2, 2, 16, 32), (1, 2, 32, 16), (1, 2, 8, 20)]
# Shorter than a chunk, one token, longer than two chunks; the third row is padding.
LENS = [5, 1, 4, 2 * CHUNK + 7]
LOWER_BOUNDS = [0.0, -5.0]  # Kimi's softplus gate, the safe gate


@dataclasses.dataclass
class KDACase:
    """The inputs of one varlen (or update) call; the update reads the first token per row."""

    q: torch.Tensor  # (T, Hk, Dk)
    k: torch.Tensor  # (T, Hk, Dk)
    v: torch.Tensor  # (T, Hv, Dv)
    a: torch.Tensor  # (T, Hv * Dk)
    b: torch.Tensor  # (T, Hv)
    A_log: torch.Tensor  # (Hv,)
    dt_bias: torch.Tensor  # (Hv * Dk,)
    ssm_states: torch.Tensor  # (S, Hv, Dk, Dv)
    query_start_loc: torch.Tensor  # (B + 1,) int32
    state_indices: torch.Tensor  # (B,) int32, PAD_SLOT_ID for padding rows
    has_initial_state: torch.Tensor  # (B,) bool

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias


def make_case(
    lens: list[int], device: torch.device, shape: tuple[int, int, int, int] = SHAPES[1],
    pads: tuple[int, ...] = (2,), dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32, seed: int = 0,
) -> KDACase:  # fmt: skip
    """Random inputs for sequences of `lens` tokens; rows `pads` are padding, the others take
    distinct slots of `len(lens) + 2`, every other one with an initial state."""
    num_k, num_v, key_dim, value_dim = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * scale

    tokens, batch = sum(lens), len(lens)
    slots = torch.randperm(batch + 2, generator=gen)[:batch].to(torch.int32)
    slots[list(pads)] = PAD_SLOT_ID
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    case = KDACase(
        q=randn(tokens, num_k, key_dim).to(dtype), k=randn(tokens, num_k, key_dim).to(dtype),
        v=randn(tokens, num_v, value_dim).to(dtype),
        a=randn(tokens, num_v * key_dim).to(dtype), b=randn(tokens, num_v).to(dtype),
        A_log=randn(num_v, scale=0.5), dt_bias=randn(num_v * key_dim, scale=0.5),
        ssm_states=randn(batch + 2, num_v, key_dim, value_dim, scale=0.5).to(state_dtype),
        query_start_loc=qsl, state_indices=slots,
        has_initial_state=torch.arange(batch) % 2 == 0,
    )  # fmt: skip
    moved = {f.name: getattr(case, f.name).to(device) for f in dataclasses.fields(case)}
    return KDACase(**moved)


def _tol(*dtypes: torch.dtype) -> dict[str, float]:
    if all(d == torch.float32 for d in dtypes):
        return {"rtol": 1e-4, "atol": 1e-4}
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


def _check_varlen(case: KDACase, lower_bound: float = 0.0) -> None:
    """Kernel and reference on copies of the same states: outputs (every token) and states."""
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state, CHUNK)
    before = case.ssm_states.clone()
    want_states = before.clone()
    want = kda_varlen_ref(*case.inputs(), want_states, *meta, lower_bound=lower_bound)
    got = kda_varlen(*case.inputs(), case.ssm_states, *meta, lower_bound=lower_bound)
    assert got.dtype == case.q.dtype and case.ssm_states.dtype == before.dtype
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype, before.dtype))
    _assert_states(case.ssm_states, want_states, before)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lower_bound", LOWER_BOUNDS)
def test_varlen(device: torch.device, shape: tuple[int, int, int, int], lower_bound: float) -> None:
    _check_varlen(make_case(LENS, device, shape), lower_bound)


@pytest.mark.parametrize("initial", [False, True])
def test_varlen_initial_states(device: torch.device, initial: bool) -> None:
    case = make_case([CHUNK + 2, 6], device, pads=())
    case.has_initial_state[:] = initial
    _check_varlen(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_bfloat16(device: torch.device, dtype: torch.dtype) -> None:
    """bfloat16 states (read and written), with float32 or bfloat16 inputs."""
    _check_varlen(make_case([7, CHUNK + 5], device, pads=(), dtype=dtype, state_dtype=dtype))


def test_varlen_padding_and_empty_rows(device: torch.device) -> None:
    """Padding rows first and between sequences, and an empty sequence: none touches a slot."""
    case = make_case([3, 0, 6, 2, 9], device, pads=(0, 3))
    case.has_initial_state[:] = True
    _check_varlen(case)


# The safe gate's sigmoid of a large negative input: exp overflows to inf (in the interpreter's
# numpy, which warns) and the sigmoid is 0, as torch's.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("lower_bound", LOWER_BOUNDS)
def test_varlen_strong_decay(device: torch.device, lower_bound: float) -> None:
    """Log decays of hundreds per token in some channels (the safe gate's saturate at the
    bound): no inf or nan, same result."""
    case = make_case([4, 2 * CHUNK + 3], device, pads=())
    case.A_log += 4.0
    case.a.mul_(15.0).add_(5.0)
    _check_varlen(case, lower_bound)


def test_varlen_strided_inputs(device: torch.device) -> None:
    """q, k, v, a, b split from one projection (as a mixer does); states a layer's view."""
    case = make_case([4, CHUNK + 1], device, (1, 2, 8, 20), pads=())
    parts = (case.q, case.k, case.v, case.a, case.b)
    packed = torch.cat([t.flatten(1) for t in parts], dim=1)  # (T, sum of widths)
    split = packed.split([t[0].numel() for t in parts], dim=1)
    case.q, case.k, case.v = (s.view_as(t) for s, t in zip(split[:3], parts[:3]))
    case.a, case.b = split[3], split[4]
    layers = torch.randn(3, *case.ssm_states.shape, device=device)
    layers[1] = case.ssm_states
    others = layers[[0, 2]].clone()
    case.ssm_states = layers[1]
    _check_varlen(case)
    assert torch.equal(layers[[0, 2]], others)


@pytest.mark.parametrize(
    "cuts,lower_bound", [([CHUNK + 5, 2, 9], 0.0), ([1, 2 * CHUNK - 1, 4], -5.0)]
)
def test_chunked_prefill_then_decode_equal_one_pass(
    device: torch.device, cuts, lower_bound: float
) -> None:
    """One sequence in pieces cut anywhere, then two decode steps, against one reference pass."""
    total = sum(cuts)
    case = make_case([total + 2], device, (1, 2, 16, 32), pads=(), seed=1)
    case.has_initial_state[:] = False
    want_states = case.ssm_states.clone()
    want = kda_varlen_ref(
        *case.inputs(), want_states, case.query_start_loc, case.state_indices,
        case.has_initial_state, CHUNK, lower_bound,
    )  # fmt: skip
    params = (case.A_log, case.dt_bias, case.ssm_states)
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        part = [t[lo : lo + n] for t in case.inputs()[:5]]
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        init = torch.tensor([i > 0], device=device)
        outs.append(kda_varlen(*part, *params, qsl, case.state_indices, init, CHUNK, lower_bound))
        lo += n
    for t in range(total, total + 2):
        step = [x[t : t + 1] for x in case.inputs()[:5]]
        outs.append(kda_update(*step, *params, case.state_indices, lower_bound))
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-4)


def _check_update(case: KDACase, lower_bound: float = 0.0) -> torch.Tensor:
    """Kernel and reference for one decode step (one token per row); returns the outputs."""
    before = case.ssm_states.clone()
    want_states = before.clone()
    want = kda_update_ref(*case.inputs(), want_states, case.state_indices, lower_bound)
    got = kda_update(*case.inputs(), case.ssm_states, case.state_indices, lower_bound)
    assert got.dtype == case.q.dtype and case.ssm_states.dtype == before.dtype
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype, before.dtype))
    _assert_states(case.ssm_states, want_states, before)
    return got


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lower_bound", LOWER_BOUNDS)
def test_update(device: torch.device, shape: tuple[int, int, int, int], lower_bound: float) -> None:
    _check_update(make_case([1] * 5, device, shape, pads=(0, 3)), lower_bound)


def test_positive_lower_bound_is_refused(device: torch.device) -> None:
    case = make_case([2, 1], device, pads=())
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state, CHUNK)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_varlen(*case.inputs(), case.ssm_states, *meta, lower_bound=0.5)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_update(*case.inputs(), case.ssm_states, case.state_indices, lower_bound=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_bfloat16_states(device: torch.device, dtype: torch.dtype) -> None:
    _check_update(make_case([1] * 4, device, pads=(1,), dtype=dtype, state_dtype=torch.bfloat16))


def test_update_all_padding(device: torch.device) -> None:
    """Only padding rows: zeros out, no slot written."""
    case = make_case([1] * 3, device, pads=(0, 1, 2))
    before = case.ssm_states.clone()
    out = _check_update(case)
    assert not out.any() and torch.equal(case.ssm_states, before)


@pytest.mark.cuda
@_NEEDS_CUDA
def test_update_in_cuda_graph() -> None:
    """The update launcher captures in a CUDA graph and replays with new inputs in place."""
    case = make_case([1] * 4, torch.device("cuda"), pads=(2,))
    start = case.ssm_states.clone()
    kda_update(*case.inputs(), case.ssm_states.clone(), case.state_indices)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_update(*case.inputs(), case.ssm_states, case.state_indices)
    case.ssm_states.copy_(start)
    case.v.mul_(-1.0)
    graph.replay()
    want_states = start.clone()
    want = kda_update_ref(*case.inputs(), want_states, case.state_indices)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.ssm_states, want_states, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
     (torch.bfloat16, torch.bfloat16)],
)  # fmt: skip
def test_norm_gate(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """`(T, Hv, Dv)` with Dv not a power of two, and a strided gate (split from a projection)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 20, generator=gen).to(device, dtype)
    z = torch.randn(5, 3, 40, generator=gen).to(device, dtype)[..., ::2]
    weight = torch.randn(20, generator=gen).to(device, weight_dtype)
    got = kda_norm_gate(x, z, weight, 1e-6)
    want = kda_norm_gate_ref(x, z, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
