"""The Triton RWKV-7 and RWKV-4 wkv kernels against the `rwkv7` and `rwkv4` references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. The interpreter is slow,
so the shapes are tiny.

Inputs follow the models: RWKV-7's log decay `w = -exp(-0.5) sigmoid(.)`, `a = -kk` with `kk`
L2-normalised and `b = kk * sigmoid(.)`, so the state stays of order 1; RWKV-4's
`w = -exp(time_decay)`.

Tolerances: in float32 kernel and reference differ only in the order of float32 sums, about
1e-6 on values of order 1, checked at 1e-4. Where a result is rounded to bfloat16 (bfloat16
inputs, outputs or states) both sides round their float32 values, one rounding apart at most:
one bfloat16 ulp (2^-8 relative), checked at 1e-2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.rwkv4 import wkv4_update_ref, wkv4_varlen_ref
from vllm_mamba.ops.rwkv7 import wkv7_update_ref, wkv7_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_rwkv import (  # noqa: E402
    wkv4_update,
    wkv4_varlen,
    wkv7_update,
    wkv7_varlen,
)

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
# RWKV-7 (H, Dk, Dv): powers of two; Dk != Dv, neither a power of two, Dv over one value block
# (16 rows); Dk > Dv.
SHAPES7 = [(2, 8, 8), (1, 12, 20), (2, 16, 4)]
# RWKV-4 C: not a power of two; over one channel block (128).
CHANNELS4 = [20, 150]
# One token, a few, an empty sequence's neighbour; the third row is padding.
LENS = [5, 1, 3, 7]


def _tol(*dtypes: torch.dtype) -> dict[str, float]:
    if all(d == torch.float32 for d in dtypes):
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 1e-2, "atol": 1e-2}


def _batch_meta(
    lens: list[int], pads: tuple[int, ...], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(query_start_loc, state_indices, has_initial_state)`: rows `pads` are padding, the
    others take distinct slots of `len(lens) + 2`, every other one with an initial state."""
    batch = len(lens)
    slots = torch.randperm(batch + 2, generator=gen)[:batch].to(torch.int32)
    slots[list(pads)] = PAD_SLOT_ID
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return qsl, slots, torch.arange(batch) % 2 == 0


@dataclasses.dataclass
class WKV7Case:
    """The inputs of one RWKV-7 varlen (or update) call."""

    r: torch.Tensor  # (T, H, Dk)
    w: torch.Tensor  # (T, H, Dk) float32 log decay
    k: torch.Tensor  # (T, H, Dk)
    v: torch.Tensor  # (T, H, Dv)
    a: torch.Tensor  # (T, H, Dk)
    b: torch.Tensor  # (T, H, Dk)
    states: torch.Tensor  # (S, H, Dv, Dk)
    query_start_loc: torch.Tensor  # (B + 1,) int32
    state_indices: torch.Tensor  # (B,) int32, PAD_SLOT_ID for padding rows
    has_initial_state: torch.Tensor  # (B,) bool

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.r, self.w, self.k, self.v, self.a, self.b

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        return tuple(x[lo:hi] for x in self.inputs())


def make7(
    lens: list[int], device: torch.device, shape: tuple[int, int, int] = SHAPES7[1],
    pads: tuple[int, ...] = (2,), dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32, seed: int = 0,
) -> WKV7Case:  # fmt: skip
    """Random RWKV-7 inputs for sequences of `lens` tokens (see `_batch_meta` for the rows)."""
    heads, key_dim, value_dim = shape
    gen = torch.Generator().manual_seed(seed)
    tokens, batch = sum(lens), len(lens)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    kk = torch.nn.functional.normalize(randn(tokens, heads, key_dim), dim=-1)
    case = WKV7Case(
        r=randn(tokens, heads, key_dim).to(dtype),
        w=-math.exp(-0.5) * torch.sigmoid(randn(tokens, heads, key_dim)),
        k=randn(tokens, heads, key_dim).to(dtype),
        v=randn(tokens, heads, value_dim).to(dtype),
        a=(-kk).to(dtype),
        b=(kk * torch.sigmoid(randn(tokens, heads, key_dim))).to(dtype),
        states=(randn(batch + 2, heads, value_dim, key_dim) * 0.5).to(state_dtype),
        query_start_loc=torch.empty(0), state_indices=torch.empty(0),
        has_initial_state=torch.empty(0),
    )  # fmt: skip
    case.query_start_loc, case.state_indices, case.has_initial_state = _batch_meta(lens, pads, gen)
    moved = {f.name: getattr(case, f.name).to(device) for f in dataclasses.fields(case)}
    return WKV7Case(**moved)


@dataclasses.dataclass
class WKV4Case:
    """The inputs of one RWKV-4 varlen (or update) call."""

    w: torch.Tensor  # (C,) float32 -exp(time_decay)
    u: torch.Tensor  # (C,) time_first
    k: torch.Tensor  # (T, C)
    v: torch.Tensor  # (T, C)
    num: torch.Tensor  # (S, C) float32
    den: torch.Tensor  # (S, C) float32
    max: torch.Tensor  # (S, C) float32
    query_start_loc: torch.Tensor  # (B + 1,) int32
    state_indices: torch.Tensor  # (B,) int32
    has_initial_state: torch.Tensor  # (B,) bool

    def states(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.num, self.den, self.max


def make4(
    lens: list[int], device: torch.device, channels: int = CHANNELS4[0],
    pads: tuple[int, ...] = (2,), dtype: torch.dtype = torch.float32, k_scale: float = 1.0,
    seed: int = 0,
) -> WKV4Case:  # fmt: skip
    """Random RWKV-4 inputs; saved states are those of a few earlier tokens (den > 0)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, batch = sum(lens), len(lens)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    slots = batch + 2
    case = WKV4Case(
        w=-torch.exp(randn(channels)), u=randn(channels),
        k=(randn(tokens, channels) * k_scale).to(dtype), v=randn(tokens, channels).to(dtype),
        num=randn(slots, channels), den=torch.rand(slots, channels, generator=gen) + 0.5,
        max=randn(slots, channels) * k_scale,
        query_start_loc=torch.empty(0), state_indices=torch.empty(0),
        has_initial_state=torch.empty(0),
    )  # fmt: skip
    case.query_start_loc, case.state_indices, case.has_initial_state = _batch_meta(lens, pads, gen)
    moved = {f.name: getattr(case, f.name).to(device) for f in dataclasses.fields(case)}
    return WKV4Case(**moved)


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


def _assert_states(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> None:
    """Close where the reference wrote; bit-identical where it did not (padding, free slots)."""
    written = (want != before).flatten(1).any(1)  # (S,)
    torch.testing.assert_close(got[written].float(), want[written].float(), **_tol(got.dtype))
    assert torch.equal(got[~written], before[~written])


# ----------------------------------------------------------------------------------- RWKV-7


def _check7(case: WKV7Case) -> torch.Tensor:
    """Varlen kernel and reference on copies of the same states; returns the outputs."""
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state)
    before = case.states.clone()
    want_states = before.clone()
    want = wkv7_varlen_ref(*case.inputs(), want_states, *meta)
    got = wkv7_varlen(*case.inputs(), case.states, *meta)
    assert got.dtype == case.r.dtype and got.shape == case.v.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype, before.dtype))
    _assert_states(case.states, want_states, before)
    return got


def _check7_update(case: WKV7Case) -> torch.Tensor:
    """Update kernel and reference (one token per row); returns the outputs."""
    before = case.states.clone()
    want_states = before.clone()
    want = wkv7_update_ref(*case.inputs(), want_states, case.state_indices)
    got = wkv7_update(*case.inputs(), case.states, case.state_indices)
    assert got.dtype == case.r.dtype and got.shape == case.v.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype, before.dtype))
    _assert_states(case.states, want_states, before)
    return got


@pytest.mark.parametrize("shape", SHAPES7)
def test_wkv7_varlen(device: torch.device, shape: tuple[int, int, int]) -> None:
    _check7(make7(LENS, device, shape))


@pytest.mark.parametrize("initial", [False, True])
def test_wkv7_varlen_initial_states(device: torch.device, initial: bool) -> None:
    case = make7([6, 3], device, pads=())
    case.has_initial_state[:] = initial
    _check7(case)


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
     (torch.bfloat16, torch.bfloat16)],
)  # fmt: skip
def test_wkv7_varlen_bfloat16(
    device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    """bfloat16 inputs (w stays float32) and/or bfloat16 states, read and written."""
    _check7(make7([4, 5], device, pads=(), dtype=dtype, state_dtype=state_dtype))


def test_wkv7_varlen_padding_and_empty_rows(device: torch.device) -> None:
    """Padding rows first and between sequences run from a zero state and touch no slot;
    empty sequences write their slot (zeros, or their initial state) as the reference."""
    case = make7([3, 0, 4, 2, 0], device, pads=(0, 3))
    case.has_initial_state[:] = torch.tensor([True, False, True, True, True])
    got = _check7(case)
    lo, hi = case.query_start_loc[3:5].tolist()  # the padding row's tokens
    alone = wkv7_varlen_ref(
        *case.rows(lo, hi), torch.zeros_like(case.states[:1]),
        torch.tensor([0, hi - lo], dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.bool,
        device=device),
    )  # fmt: skip
    torch.testing.assert_close(got[lo:hi], alone, **_tol(torch.float32))
    assert not case.states[case.state_indices[1]].any()  # the empty fresh sequence's slot


def test_wkv7_varlen_strided_inputs(device: torch.device) -> None:
    """r, w, k, v, a, b split from one projection (as a mixer does); states a layer's view."""
    case = make7([4, 3], device, (2, 8, 12), pads=())
    parts = case.inputs()
    packed = torch.cat([t.flatten(1) for t in parts], dim=1)  # (T, sum of widths)
    split = packed.split([t[0].numel() for t in parts], dim=1)
    case.r, case.w, case.k, case.v, case.a, case.b = (
        s.view_as(t) for s, t in zip(split, parts)
    )  # fmt: skip
    layers = torch.randn(3, *case.states.shape, device=device)
    layers[1] = case.states
    others = layers[[0, 2]].clone()
    case.states = layers[1]
    _check7(case)
    assert torch.equal(layers[[0, 2]], others)


@pytest.mark.parametrize("cuts", [[5, 3], [1, 6]])
def test_wkv7_cut_prefill_then_decode_equal_one_pass(device: torch.device, cuts) -> None:
    """One sequence cut at an unaligned token, continued, then two decode steps, against one
    reference pass."""
    total = sum(cuts)
    case = make7([total + 2], device, (2, 12, 20), pads=(), seed=1)
    case.has_initial_state[:] = False
    want_states = case.states.clone()
    want = wkv7_varlen_ref(
        *case.inputs(), want_states, case.query_start_loc, case.state_indices,
        case.has_initial_state,
    )  # fmt: skip
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        init = torch.tensor([i > 0], device=device)
        outs.append(wkv7_varlen(*case.rows(lo, lo + n), case.states, qsl, case.state_indices, init))
        lo += n
    for t in range(total, total + 2):
        outs.append(wkv7_update(*case.rows(t, t + 1), case.states, case.state_indices))
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case.states, want_states, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES7)
def test_wkv7_update(device: torch.device, shape: tuple[int, int, int]) -> None:
    _check7_update(make7([1] * 5, device, shape, pads=(0, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wkv7_update_bfloat16_states(device: torch.device, dtype: torch.dtype) -> None:
    _check7_update(make7([1] * 4, device, pads=(1,), dtype=dtype, state_dtype=torch.bfloat16))


def test_wkv7_update_all_padding(device: torch.device) -> None:
    """Only padding rows: the outputs of a zero state (v_i (k . r)), no slot written."""
    case = make7([1] * 3, device, pads=(0, 1, 2))
    before = case.states.clone()
    out = _check7_update(case)
    want = case.v * (case.k * case.r).sum(-1, keepdim=True)  # (B, H, Dv)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(case.states, before)


# ----------------------------------------------------------------------------------- RWKV-4


def _check4(case: WKV4Case) -> torch.Tensor:
    """Varlen kernel and reference on copies of the same states; returns the outputs."""
    meta = (case.query_start_loc, case.state_indices, case.has_initial_state)
    before = [s.clone() for s in case.states()]
    want_states = [s.clone() for s in before]
    want = wkv4_varlen_ref(case.w, case.u, case.k, case.v, *want_states, *meta)
    got = wkv4_varlen(case.w, case.u, case.k, case.v, *case.states(), *meta)
    assert got.dtype == case.v.dtype and got.shape == case.v.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    for g, w, b in zip(case.states(), want_states, before):
        _assert_states(g, w, b)
    return got


def _check4_update(case: WKV4Case) -> torch.Tensor:
    """Update kernel and reference (one token per row); returns the outputs."""
    before = [s.clone() for s in case.states()]
    want_states = [s.clone() for s in before]
    want = wkv4_update_ref(case.w, case.u, case.k, case.v, *want_states, case.state_indices)
    got = wkv4_update(case.w, case.u, case.k, case.v, *case.states(), case.state_indices)
    assert got.dtype == case.v.dtype and got.shape == case.v.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    for g, w, b in zip(case.states(), want_states, before):
        _assert_states(g, w, b)
    return got


@pytest.mark.parametrize("channels", CHANNELS4)
def test_wkv4_varlen(device: torch.device, channels: int) -> None:
    _check4(make4(LENS, device, channels))


@pytest.mark.parametrize("initial", [False, True])
def test_wkv4_varlen_initial_states(device: torch.device, initial: bool) -> None:
    case = make4([6, 3], device, pads=())
    case.has_initial_state[:] = initial
    _check4(case)


def test_wkv4_varlen_large_k(device: torch.device) -> None:
    """k of hundreds (exp(k) overflows float32 unstabilised): finite, same result."""
    _check4(make4([6, 4], device, pads=(), k_scale=100.0))


def test_wkv4_varlen_bfloat16(device: torch.device) -> None:
    """bfloat16 k and v (w, u and the states stay float32), output in bfloat16."""
    _check4(make4([4, 5], device, pads=(), dtype=torch.bfloat16))


def test_wkv4_varlen_padding_and_empty_rows(device: torch.device) -> None:
    """Padding rows touch no slot; an empty fresh sequence writes `(0, 0, MAX_INIT)`."""
    case = make4([3, 0, 4, 2], device, pads=(0, 3))
    case.has_initial_state[:] = torch.tensor([True, False, True, True])
    _check4(case)
    slot = case.state_indices[1]
    assert not case.num[slot].any() and not case.den[slot].any()
    assert (case.max[slot] == -1e38).all()


@pytest.mark.parametrize("cuts", [[5, 3], [1, 6]])
def test_wkv4_cut_prefill_then_decode_equal_one_pass(device: torch.device, cuts) -> None:
    """One sequence cut at an unaligned token, continued, then two decode steps, against one
    reference pass."""
    total = sum(cuts)
    case = make4([total + 2], device, 150, pads=(), k_scale=10.0, seed=1)
    case.has_initial_state[:] = False
    want_states = [s.clone() for s in case.states()]
    want = wkv4_varlen_ref(
        case.w, case.u, case.k, case.v, *want_states, case.query_start_loc,
        case.state_indices, case.has_initial_state,
    )  # fmt: skip
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        init = torch.tensor([i > 0], device=device)
        kv = (case.k[lo : lo + n], case.v[lo : lo + n])
        outs.append(wkv4_varlen(case.w, case.u, *kv, *case.states(), qsl, case.state_indices, init))
        lo += n
    for t in range(total, total + 2):
        kv = (case.k[t : t + 1], case.v[t : t + 1])
        outs.append(wkv4_update(case.w, case.u, *kv, *case.states(), case.state_indices))
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-4, atol=1e-4)
    for got, ref in zip(case.states(), want_states):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("channels", CHANNELS4)
def test_wkv4_update(device: torch.device, channels: int) -> None:
    _check4_update(make4([1] * 5, device, channels, pads=(0, 3), k_scale=30.0))


def test_wkv4_update_all_padding(device: torch.device) -> None:
    """Only padding rows: a fresh state's output is v itself; no slot written."""
    case = make4([1] * 3, device, pads=(0, 1, 2))
    out = _check4_update(case)
    torch.testing.assert_close(out, case.v, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- registration


@pytest.mark.cuda
@_NEEDS_CUDA
def test_update_in_cuda_graph() -> None:
    """Both update launchers capture in a CUDA graph and replay with new inputs in place."""
    device = torch.device("cuda")
    case7 = make7([1] * 4, device, pads=(2,))
    case4 = make4([1] * 4, device, pads=(2,))
    start7, start4 = case7.states.clone(), [s.clone() for s in case4.states()]
    wkv7_update(*case7.inputs(), case7.states.clone(), case7.state_indices)  # warm
    wkv4_update(case4.w, case4.u, case4.k, case4.v,
                *(s.clone() for s in start4), case4.state_indices)  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out7 = wkv7_update(*case7.inputs(), case7.states, case7.state_indices)
        out4 = wkv4_update(case4.w, case4.u, case4.k, case4.v, *case4.states(),
                           case4.state_indices)  # fmt: skip
    case7.states.copy_(start7)
    for s, s0 in zip(case4.states(), start4):
        s.copy_(s0)
    case7.v.mul_(-1.0)
    case4.v.mul_(-1.0)
    graph.replay()
    want_states7 = start7.clone()
    want7 = wkv7_update_ref(*case7.inputs(), want_states7, case7.state_indices)
    torch.testing.assert_close(out7, want7, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(case7.states, want_states7, rtol=1e-4, atol=1e-4)
    want4 = wkv4_update_ref(case4.w, case4.u, case4.k, case4.v, *start4, case4.state_indices)
    torch.testing.assert_close(out4, want4, rtol=1e-4, atol=1e-4)
    for got, ref in zip(case4.states(), start4):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
