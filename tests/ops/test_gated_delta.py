"""The Gated DeltaNet ops: the references against a token-by-token float64 recurrence, and the
C++ kernels (`vllm_mamba.ops.cpu_kernels`) against the references."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.gated_delta import (
    FAMILY,
    gated_delta_update_ref,
    gated_delta_varlen_ref,
    rms_norm_gated_ref,
)

needs_cpp = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension vllm_mamba._C_<level> is not built (pip install -e .)",
)

HEADS = [(2, 2, 16, 24), (2, 4, 16, 24), (1, 4, 32, 16)]  # (Hk, Hv, Dk, Dv): ratios 1, 2, 4
CHUNKS = [8, 16, 64]
# Both sides compute in float32 from the same inputs, in different orders (the chunked solve
# against its blocked substitution): a few float32 ulps of outputs of order 1, amplified by the
# chunk's triangular solve and its products over up to 64 tokens.
F32_TOL = {"rtol": 1e-4, "atol": 1e-5}
# bfloat16 outputs and states are rounded once from float32 values that differ by the float32
# tolerance above; where those straddle a rounding boundary they land one bfloat16 ulp apart
# (at most 2^-7 relative), never more.
BF16_TOL = {"rtol": 2**-7, "atol": 1e-4}


@dataclasses.dataclass
class GDNCase:
    """One varlen batch: q, k `(T, Hk, Dk)`, v `(T, Hv, Dv)`, a, b `(T, Hv)`, states
    `(S, Hv, Dk, Dv)`, and the metadata of B sequences."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ssm_states: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    def clone(self) -> GDNCase:
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)}
        )


def make_case(
    lens: list[int],
    heads: tuple[int, int, int, int],
    *,
    seed: int = 0,
    pad: tuple[int, ...] = (),
    init: list[bool] | None = None,
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
    extra_tokens: int = 0,
) -> GDNCase:
    """Random inputs for sequences of `lens` tokens (padding rows at indices `pad`), each with
    its own slot among `len(lens) + 2` (two never used), plus `extra_tokens` after the last."""
    hk, hv, dk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens) + extra_tokens

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    num_slots = len(lens) + 2
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)]
    for row in pad:
        slots[row] = PAD_SLOT_ID
    if init is None:
        init = (torch.rand(len(lens), generator=gen) < 0.6).tolist()
    return GDNCase(
        q=randn(tokens, hk, dk).to(dtype),
        k=randn(tokens, hk, dk).to(dtype),
        v=randn(tokens, hv, dv).to(dtype),
        a=randn(tokens, hv).to(dtype),
        b=randn(tokens, hv, std=2.0).to(dtype),
        A_log=torch.rand(hv, generator=gen) * 2.0 - 1.0,
        dt_bias=randn(hv, std=0.5),
        ssm_states=randn(num_slots, hv, dk, dv, std=0.3).to(state_dtype),
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).int(),
        state_indices=slots.int(),
        has_initial_state=torch.tensor(init, dtype=torch.bool),
    )


def run_varlen(fn, c: GDNCase, beta_scale: float, chunk_size: int) -> torch.Tensor:
    return fn(
        c.q, c.k, c.v, c.a, c.b, c.A_log, c.dt_bias, beta_scale, c.ssm_states,
        c.query_start_loc, c.state_indices, c.has_initial_state, chunk_size,
    )  # fmt: skip


def run_update(fn, c: GDNCase, beta_scale: float) -> torch.Tensor:
    return fn(
        c.q, c.k, c.v, c.a, c.b, c.A_log, c.dt_bias, beta_scale, c.ssm_states, c.state_indices
    )


def recurrence(c: GDNCase, beta_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token in float64, from the module docstring's definition.

    Returns:
        `(T, Hv, Dv)` outputs and the `(S, Hv, Dk, Dv)` states after the batch.
    """
    hv = c.v.shape[1]
    rep = hv // c.q.shape[1]
    states = c.ssm_states.double()
    out = torch.zeros(c.v.shape, dtype=torch.float64)
    starts = c.query_start_loc.tolist()
    for i, slot in enumerate(c.state_indices.tolist()):
        if slot == PAD_SLOT_ID or starts[i] == starts[i + 1]:
            continue
        state = states[slot].clone() if c.has_initial_state[i] else torch.zeros_like(states[0])
        for t in range(starts[i], starts[i + 1]):
            q = c.q[t].double().repeat_interleave(rep, 0)  # (Hv, Dk)
            k = c.k[t].double().repeat_interleave(rep, 0)  # (Hv, Dk)
            q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / math.sqrt(q.shape[-1])
            k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
            g = -c.A_log.double().exp() * F.softplus(c.a[t].double() + c.dt_bias.double())
            beta = beta_scale * torch.sigmoid(c.b[t].double())  # (Hv,)
            state = state * g.exp()[:, None, None]  # (Hv, Dk, Dv)
            u = beta[:, None] * (c.v[t].double() - torch.einsum("hkv,hk->hv", state, k))
            state = state + k[:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, q)
        states[slot] = state
    return out, states


def chunk_lens(chunk: int) -> list[int]:
    """Sequences shorter than, equal to and longer than a chunk (not a multiple), a single
    token, and a padding row's tokens (index 2)."""
    return [chunk // 2 + 1, chunk, 3, 2 * chunk + 3, 1]


# ---- the reference against the recurrence ----


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_varlen_ref_matches_recurrence(heads, chunk, beta_scale):
    case = make_case(chunk_lens(chunk), heads, seed=chunk, pad=(2,), extra_tokens=2)
    want_out, want_states = recurrence(case, beta_scale)
    out = run_varlen(gated_delta_varlen_ref, case, beta_scale, chunk)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(case.ssm_states.double(), want_states, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("init", [False, True])
def test_varlen_ref_initial_states(init):
    case = make_case([7, 20], HEADS[1], seed=3, init=[init, init])
    want_out, want_states = recurrence(case, 1.0)
    out = run_varlen(gated_delta_varlen_ref, case, 1.0, 8)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(case.ssm_states.double(), want_states, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_update_ref_matches_recurrence(heads, beta_scale):
    case = make_case([1] * 5, heads, seed=11, pad=(3,), init=[True] * 5)
    want_out, want_states = recurrence(case, beta_scale)
    out = run_update(gated_delta_update_ref, case, beta_scale)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(case.ssm_states.double(), want_states, rtol=1e-5, atol=1e-6)


def test_norm_gate_ref_definition():
    x, z = torch.randn(5, 3, 32), torch.randn(5, 3, 32)
    weight = torch.randn(32)
    want = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z)
    torch.testing.assert_close(rms_norm_gated_ref(x, z, weight, 1e-6), want)


# ---- the C++ kernels against the references ----


def check_varlen(case: GDNCase, beta_scale: float, chunk: int, tol: dict) -> None:
    """Runs the kernel and the reference on copies of `case`; outputs and states agree, the
    unused slots are untouched."""
    ref_case, cpp_case = case.clone(), case.clone()
    want = run_varlen(gated_delta_varlen_ref, ref_case, beta_scale, chunk)
    got = run_varlen(cpu_kernels.gated_delta_varlen, cpp_case, beta_scale, chunk)
    assert got.dtype == case.v.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(cpp_case.ssm_states.float(), ref_case.ssm_states.float(), **tol)
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    for slot in set(range(case.ssm_states.shape[0])) - used:
        assert torch.equal(cpp_case.ssm_states[slot], case.ssm_states[slot])


@needs_cpp
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_varlen_cpp_matches_ref(heads, chunk, beta_scale):
    case = make_case(chunk_lens(chunk), heads, seed=chunk + 1, pad=(2,), extra_tokens=3)
    check_varlen(case, beta_scale, chunk, F32_TOL)


@needs_cpp
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("chunk", [16, 64])
def test_varlen_cpp_bfloat16(dtype, state_dtype, chunk):
    case = make_case(
        chunk_lens(chunk), HEADS[1], seed=5, pad=(2,), dtype=dtype, state_dtype=state_dtype
    )
    check_varlen(case, 1.0, chunk, BF16_TOL)


@needs_cpp
@pytest.mark.parametrize("init", [False, True])
def test_varlen_cpp_initial_states_and_empty_sequences(init):
    case = make_case([9, 0, 30, 0], HEADS[2], seed=7, init=[init] * 4)
    check_varlen(case, 2.0, 16, F32_TOL)


@needs_cpp
def test_varlen_cpp_empty_batch():
    case = make_case([], HEADS[0])
    check_varlen(case, 1.0, 64, F32_TOL)


def split_projection(case: GDNCase, transposed_qk: bool) -> GDNCase:
    """The case's q, k, v, a, b as views of one `(T, width)` projection (a free token stride),
    or q and k also with their head and token dims swapped in memory."""
    parts = [case.q, case.k, case.v, case.a, case.b]
    tokens = case.v.shape[0]
    proj = torch.cat([p.reshape(tokens, -1) for p in parts], dim=1)  # (T, width)
    views, offset = [], 0
    for p in parts:
        width = p[0].numel()
        views.append(proj[:, offset : offset + width].view(p.shape))
        offset += width
    if transposed_qk:
        views[0] = case.q.transpose(0, 1).contiguous().transpose(0, 1)  # (T, Hk, Dk)
        views[1] = case.k.transpose(0, 1).contiguous().transpose(0, 1)
    return dataclasses.replace(case, **dict(zip(["q", "k", "v", "a", "b"], views, strict=True)))


@needs_cpp
@pytest.mark.parametrize("transposed_qk", [False, True])
def test_cpp_non_contiguous_inputs(transposed_qk):
    case = split_projection(make_case([5, 40], HEADS[1], seed=9), transposed_qk)
    assert not case.q.is_contiguous() and not case.a.is_contiguous()
    check_varlen(case, 1.0, 16, F32_TOL)
    rows = split_projection(make_case([1] * 6, HEADS[1], seed=9, init=[True] * 6), transposed_qk)
    check_update(rows, 1.0, F32_TOL)


def check_update(case: GDNCase, beta_scale: float, tol: dict) -> None:
    ref_case, cpp_case = case.clone(), case.clone()
    want = run_update(gated_delta_update_ref, ref_case, beta_scale)
    got = run_update(cpu_kernels.gated_delta_update, cpp_case, beta_scale)
    assert got.dtype == case.v.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(cpp_case.ssm_states.float(), ref_case.ssm_states.float(), **tol)
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    for slot in set(range(case.ssm_states.shape[0])) - used:
        assert torch.equal(cpp_case.ssm_states[slot], case.ssm_states[slot])


@needs_cpp
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32,) * 2, (torch.bfloat16, torch.float32), (torch.bfloat16,) * 2],
)
def test_update_cpp_matches_ref(heads, beta_scale, dtype, state_dtype):
    case = make_case(
        [1] * 7, heads, seed=13, pad=(0, 4), init=[True] * 7, dtype=dtype, state_dtype=state_dtype
    )
    check_update(case, beta_scale, F32_TOL if dtype == state_dtype == torch.float32 else BF16_TOL)


@needs_cpp
def test_update_cpp_empty_batch():
    check_update(make_case([], HEADS[0]), 1.0, F32_TOL)


@pytest.mark.parametrize("backend", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("heads", HEADS)
def test_update_equals_varlen_on_one_token_sequences(backend, heads):
    """A decode step is a one-token prefill from the slot's state: both forms agree."""
    ops = family_ops(FAMILY, backend)
    case = make_case([1] * 6, heads, seed=17, pad=(1,), init=[True] * 6)
    varlen_case, update_case = case.clone(), case.clone()
    want = run_varlen(ops.varlen, varlen_case, 2.0, 64)
    got = run_update(ops.update, update_case, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(update_case.ssm_states, varlen_case.ssm_states, rtol=1e-5, atol=1e-6)


@needs_cpp
def test_cpp_backend_registers_the_family():
    ops = family_ops(FAMILY, "cpp")
    assert ops.varlen is cpu_kernels.gated_delta_varlen
    assert ops.update is cpu_kernels.gated_delta_update
    assert ops.norm_gate is cpu_kernels.rms_norm_gated


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_norm_gate_cpp_matches_ref(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(21)
    proj = torch.randn(9, 2, 3, 48, generator=gen).to(dtype)  # x and z split from one tensor
    x, z = proj[:, 0], proj[:, 1]  # (9, 3, 48), non-contiguous
    weight = (1.0 + 0.3 * torch.randn(48, generator=gen)).to(weight_dtype)
    want = rms_norm_gated_ref(x, z, weight, 1e-6)
    got = cpu_kernels.rms_norm_gated(x, z, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    # float32: exp and rsqrt a few ulps from torch's. bfloat16: the normalised x, the weight
    # product and the output are each rounded, and a float32 difference of a few ulps can flip
    # each rounding by one bfloat16 ulp (2^-8 to 2^-7 relative).
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 0}
    torch.testing.assert_close(got, want, **tol)
    empty = torch.empty(0, 3, 48, dtype=dtype)
    assert cpu_kernels.rms_norm_gated(empty, empty, weight, 1e-6).shape == empty.shape
