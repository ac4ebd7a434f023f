"""The Kimi Delta Attention ops: the references against a token-by-token float64 recurrence and
against transformers' own Kimi Linear functions, and the C++ kernels
(`vllm_mamba.ops.cpu_kernels`, `csrc/kda.cpp`) against the references; both with Kimi's
softplus gate (`lower_bound` 0) and with the bounded safe gate (`lower_bound` -5, Ling-3.0 /
GLM-5-Next), whose reference is checked against transformers' formula written out here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.kda import (
    FAMILY,
    kda_gates_ref,
    kda_norm_gate_ref,
    kda_update_ref,
    kda_varlen_recurrent_ref,
    kda_varlen_ref,
)

needs_cpp = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension vllm_mamba._C_<level> is not built (pip install -e .)",
)

# (Hk, Hv, Dk, Dv): one and two value heads per key head, Dk == Dv of 16, 32 and 64, Dk != Dv,
# and head dims that are not multiples of a vector (the kernels' tails).
HEADS = [(2, 2, 16, 16), (2, 4, 32, 32), (1, 2, 64, 64), (2, 2, 32, 48), (1, 2, 20, 12)]
CHUNKS = [1, 8, 16, 64]
# Both sides compute in float32 from the same inputs, in different orders (the chunked solve,
# the kernels' exp within a few ulps of torch's): a few float32 ulps of outputs of order 1,
# amplified by the chunk's triangular solve and its products over up to 64 tokens.
F32_TOL = {"rtol": 1e-4, "atol": 2e-5}
# The gates: Kimi's softplus gate, and the safe gate with the releases' `kda_lower_bound`.
LOWER_BOUNDS = [0.0, -5.0]
SAFE = LOWER_BOUNDS[1]
# bfloat16 outputs and states are rounded once from float32 values that differ by the float32
# tolerance above; where those straddle a rounding boundary they land one bfloat16 ulp apart
# (at most 2^-7 relative), never more.
BF16_TOL = {"rtol": 2**-7, "atol": 1e-4}


@dataclasses.dataclass
class KDACase:
    """One varlen batch: q, k `(T, Hk, Dk)`, v `(T, Hv, Dv)`, a `(T, Hv * Dk)`, b `(T, Hv)`,
    A_log `(Hv,)`, dt_bias `(Hv * Dk,)`, states `(S, Hv, Dk, Dv)`, and the metadata of B
    sequences."""

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

    def clone(self) -> KDACase:
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)}
        )

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias


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
    strong_decay: bool = False,
) -> KDACase:
    """Random inputs for sequences of `lens` tokens (padding rows at indices `pad`), each with
    its own slot among `len(lens) + 2` (two never used), plus `extra_tokens` after the last.
    `strong_decay`: A_log up to 4 and large gate inputs, so that some channels' log decay is
    hundreds per token (their exp underflows; any exp of minus that would overflow)."""
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
    if strong_decay:
        A_log = torch.rand(hv, generator=gen) * 4.0
        a = randn(tokens, hv * dk, std=15.0) + 5.0  # up to past the softplus threshold of 20
    else:
        A_log = torch.rand(hv, generator=gen) * 2.0 - 1.0
        a = randn(tokens, hv * dk)
    return KDACase(
        q=randn(tokens, hk, dk).to(dtype),
        k=randn(tokens, hk, dk).to(dtype),
        v=randn(tokens, hv, dv).to(dtype),
        a=a.to(dtype),
        b=randn(tokens, hv, std=2.0).to(dtype),
        A_log=A_log,
        dt_bias=randn(hv * dk, std=0.5),
        ssm_states=randn(num_slots, hv, dk, dv, std=0.3).to(state_dtype),
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).int(),
        state_indices=slots.int(),
        has_initial_state=torch.tensor(init, dtype=torch.bool),
    )


def run_varlen(fn, c: KDACase, chunk_size: int, lower_bound: float = 0.0) -> torch.Tensor:
    return fn(
        *c.inputs(), c.ssm_states, c.query_start_loc, c.state_indices, c.has_initial_state,
        chunk_size, lower_bound=lower_bound,
    )  # fmt: skip


def run_update(fn, c: KDACase, lower_bound: float = 0.0) -> torch.Tensor:
    return fn(*c.inputs(), c.ssm_states, c.state_indices, lower_bound=lower_bound)


def recurrence(c: KDACase, lower_bound: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token in float64, from the module docstring's definition (the softplus
    gate for `lower_bound` 0, the safe gate below).

    Returns:
        `(T, Hv, Dv)` outputs and the `(S, Hv, Dk, Dv)` states after the batch.
    """
    hv = c.v.shape[1]
    dk = c.q.shape[2]
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
            q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / math.sqrt(dk)
            k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
            x = (c.a[t].double() + c.dt_bias.double()).view(hv, dk)
            rate = c.A_log.double().exp()[:, None]  # (Hv, 1)
            if lower_bound < 0:
                g = lower_bound * torch.sigmoid(rate * x)  # (Hv, Dk)
            else:
                g = -rate * F.softplus(x)  # (Hv, Dk)
            beta = torch.sigmoid(c.b[t].double())  # (Hv,)
            state = state * g.exp()[:, :, None]  # (Hv, Dk, Dv)
            u = beta[:, None] * (c.v[t].double() - torch.einsum("hkv,hk->hv", state, k))
            state = state + k[:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, q)
        states[slot] = state
    return out, states


def chunk_lens(chunk: int) -> list[int]:
    """Sequences shorter than, equal to and longer than a chunk (not a multiple), a single
    token, and a padding row's tokens (index 2)."""
    return [chunk // 2 + 1, chunk, 3, 2 * chunk + 3, 1]


# ---- the references against the recurrence and against transformers ----


@pytest.mark.parametrize("heads", HEADS[:3])
@pytest.mark.parametrize("chunk", CHUNKS)
# The safe gate's strong decays only saturate it at the bound (the C++ tests check those).
@pytest.mark.parametrize("strong_decay,lower_bound", [(False, 0.0), (True, 0.0), (False, SAFE)])
def test_varlen_refs_match_recurrence(heads, chunk, strong_decay, lower_bound):
    case = make_case(
        chunk_lens(chunk), heads, seed=chunk, pad=(2,), extra_tokens=2, strong_decay=strong_decay
    )
    want_out, want_states = recurrence(case, lower_bound)
    for fn in (kda_varlen_ref, kda_varlen_recurrent_ref):
        c = case.clone()
        out = run_varlen(fn, c, chunk, lower_bound)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c.ssm_states.double(), want_states, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_ref_matches_recurrent_ref(chunk):
    case = make_case([70, 33], HEADS[3], seed=2, init=[True, False])
    chunked, recurrent = case.clone(), case.clone()
    want = run_varlen(kda_varlen_recurrent_ref, recurrent, 0)
    got = run_varlen(kda_varlen_ref, chunked, chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.ssm_states, recurrent.ssm_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", HEADS[:3])
@pytest.mark.parametrize("lower_bound", LOWER_BOUNDS)
def test_update_ref_matches_recurrence(heads, lower_bound):
    case = make_case([1] * 5, heads, seed=11, pad=(3,), init=[True] * 5)
    want_out, want_states = recurrence(case, lower_bound)
    out = run_update(kda_update_ref, case, lower_bound)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(case.ssm_states.double(), want_states, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strong_decay", [False, True])
def test_safe_gate_ref_matches_transformers_formula(strong_decay):
    """`kda_gates_ref(..., lower_bound=-5)` is transformers' safe gate, computed in float32 as
    transformers does (from bfloat16 projections too); the default is the softplus gate."""
    tokens, heads, dk, lower_bound = 7, 3, 16, -5.0
    case = make_case([tokens], (heads, heads, dk, dk), seed=23, strong_decay=strong_decay)
    for a in (case.a, case.a.bfloat16()):
        g, beta = kda_gates_ref(a, case.b, case.A_log, case.dt_bias, lower_bound=lower_bound)
        # transformers: f_proj(x).float().view(T, H, Dk) + dt_bias.view(H, Dk), then
        # lower_bound * sigmoid(A_log.exp().view(H, 1) * gate_input)
        gate_input = a.float().view(tokens, heads, dk) + case.dt_bias.view(heads, dk)
        want = lower_bound * torch.sigmoid(case.A_log.exp().view(heads, 1) * gate_input)
        assert g.dtype == torch.float32 and g.shape == (tokens, heads, dk)
        assert torch.equal(g, want)
        assert (g >= lower_bound).all() and (g <= 0).all()
        torch.testing.assert_close(beta, torch.sigmoid(case.b.float()))
    softplus = -case.A_log.exp().view(heads, 1) * F.softplus(
        case.a.view(tokens, heads, dk) + case.dt_bias.view(heads, dk)
    )
    torch.testing.assert_close(kda_gates_ref(case.a, case.b, case.A_log, case.dt_bias)[0], softplus)


@pytest.mark.parametrize("backend", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("lower_bound", [0.5, float("nan")])
def test_positive_lower_bound_is_refused(backend, lower_bound):
    ops = family_ops(FAMILY, backend)
    case = make_case([2, 1], HEADS[0], seed=1)
    with pytest.raises(ValueError, match="lower_bound"):
        run_varlen(ops.varlen, case.clone(), 16, lower_bound)
    with pytest.raises(ValueError, match="lower_bound"):
        run_update(ops.update, make_case([1], HEADS[0]), lower_bound)
    if backend == "ref":
        with pytest.raises(ValueError, match="lower_bound"):
            kda_gates_ref(case.a, case.b, case.A_log, case.dt_bias, lower_bound)


def test_refs_match_transformers_kimi_linear():
    """The gates (transformers' forget gate module), the rule (its recurrent and chunked
    functions, one sequence from a given state) and the output norm (its gated RMSNorm)."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    heads, head_dim, hidden, length = 3, 16, 24, 37
    config = KimiLinearConfig(
        hidden_size=hidden,
        linear_attn_config={"head_dim": head_dim, "num_heads": heads, "kda_layers": [1]},
    )
    gen = torch.Generator().manual_seed(4)
    gate = kimi.KimiLinearForgetGate(config)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        gate.A_log.mul_(1.5)
    x = torch.randn(1, length, hidden, generator=gen)
    with torch.no_grad():
        want_g = gate(x)[0]  # (L, H, Dk)
        a = gate.f_b_proj(gate.f_a_proj(x))[0]  # (L, H * Dk)
    b = torch.randn(length, heads, generator=gen)
    g, beta = kda_gates_ref(a, b, gate.A_log.detach().reshape(-1), gate.dt_bias.detach())
    torch.testing.assert_close(g, want_g)
    torch.testing.assert_close(beta, torch.sigmoid(b))

    q, k, v = (torch.randn(length, heads, head_dim, generator=gen) for _ in range(3))
    init = torch.randn(heads, head_dim, head_dim, generator=gen) * 0.3
    states = init[None].clone()  # one slot
    qsl = torch.tensor([0, length], dtype=torch.int32)
    out = kda_varlen_ref(
        q, k, v, a, b, gate.A_log.detach().reshape(-1), gate.dt_bias.detach(), states, qsl,
        torch.tensor([0], dtype=torch.int32), torch.tensor([True]), 16,
    )  # fmt: skip
    args = (q[None], k[None], v[None], want_g[None], beta[None])
    want_r, state_r = kimi.recurrent_kimi_delta_attention(
        *args, initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    want_c, state_c = kimi.chunk_kimi_delta_attention(
        *args, chunk_size=16, initial_state=init[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    for want_out, want_state in ((want_r, state_r), (want_c, state_c)):
        torch.testing.assert_close(out, want_out[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[0], want_state[0], rtol=1e-4, atol=1e-5)

    norm = kimi.KimiLinearRMSNormGated(head_dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(head_dim, generator=gen))
    z = torch.randn(length, heads, head_dim, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        o = out.to(dtype)
        with torch.no_grad():
            want = norm(o, z.to(dtype))
        torch.testing.assert_close(kda_norm_gate_ref(o, z.to(dtype), norm.weight, 1e-5), want)


# ---- the C++ kernels against the references ----


def check_varlen(case: KDACase, chunk: int, tol: dict, lower_bound: float = 0.0) -> None:
    """Runs the kernel and the reference on copies of `case`; outputs and states agree, the
    unused slots are untouched."""
    ref_case, cpp_case = case.clone(), case.clone()
    want = run_varlen(kda_varlen_ref, ref_case, chunk, lower_bound)
    got = run_varlen(cpu_kernels.kda_varlen, cpp_case, chunk, lower_bound)
    assert got.dtype == case.q.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(cpp_case.ssm_states.float(), ref_case.ssm_states.float(), **tol)
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    for slot in set(range(case.ssm_states.shape[0])) - used:
        assert torch.equal(cpp_case.ssm_states[slot], case.ssm_states[slot])


@needs_cpp
@pytest.mark.parametrize("heads", HEADS)
# The gate is the same code at every chunk size: the safe gate at three of them.
@pytest.mark.parametrize(
    "chunk,lower_bound",
    [(c, 0.0) for c in CHUNKS + [12, 32]] + [(c, SAFE) for c in (1, 12, 64)],
)
def test_varlen_cpp_matches_ref(heads, chunk, lower_bound):
    case = make_case(chunk_lens(chunk), heads, seed=chunk + 1, pad=(2,), extra_tokens=3)
    check_varlen(case, chunk, F32_TOL, lower_bound)


@needs_cpp
@pytest.mark.parametrize("heads", HEADS[:4])
@pytest.mark.parametrize(
    "chunk,lower_bound", [(c, 0.0) for c in (8, 12, 16, 64)] + [(c, SAFE) for c in (12, 64)]
)
def test_varlen_cpp_strong_decay(heads, chunk, lower_bound):
    """Log decays of hundreds per token in some channels (the softplus gate; the safe gate's
    saturate at the bound): every exp is of a non-positive number, nothing overflows."""
    case = make_case(chunk_lens(chunk), heads, seed=3, pad=(2,), strong_decay=True)
    check_varlen(case, chunk, F32_TOL, lower_bound)


@needs_cpp
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("chunk", [12, 16, 64])
def test_varlen_cpp_bfloat16(dtype, state_dtype, chunk):
    case = make_case(
        chunk_lens(chunk), HEADS[1], seed=5, pad=(2,), dtype=dtype, state_dtype=state_dtype
    )
    check_varlen(case, chunk, BF16_TOL, LOWER_BOUNDS[chunk // 4 % 2])  # both gates


@needs_cpp
@pytest.mark.parametrize("init", [False, True])
def test_varlen_cpp_initial_states_and_empty_sequences(init):
    case = make_case([9, 0, 30, 0], HEADS[3], seed=7, init=[init] * 4)
    check_varlen(case, 16, F32_TOL)


@needs_cpp
def test_varlen_cpp_padding_rows_first_and_between():
    case = make_case([3, 5, 6, 2, 19], HEADS[0], seed=8, pad=(0, 3), init=[True] * 5)
    check_varlen(case, 16, F32_TOL)


@needs_cpp
def test_varlen_cpp_empty_batch():
    case = make_case([], HEADS[0])
    check_varlen(case, 16, F32_TOL)


@needs_cpp
@pytest.mark.parametrize("cuts", [[1, 40], [17, 5, 19], [16, 16, 9], [3, 1, 1, 36]])
@pytest.mark.parametrize("chunk", [8, 12, 16])
def test_cpp_cut_sequence_equals_one_pass(cuts, chunk):
    """A sequence split at arbitrary positions (each piece from the previous one's saved state),
    then two decode steps, equals one call over the whole sequence (the softplus gate for some
    cuts, the safe gate for the others)."""
    total = sum(cuts)
    lower_bound = LOWER_BOUNDS[len(cuts) % 2]
    case = make_case([total + 2], HEADS[3], seed=6, init=[False])
    whole = case.clone()
    want = run_varlen(cpu_kernels.kda_varlen, whole, chunk, lower_bound)
    ref = case.clone()
    want_ref = run_varlen(kda_varlen_ref, ref, chunk, lower_bound)
    torch.testing.assert_close(want, want_ref, **F32_TOL)
    params = (case.A_log, case.dt_bias, case.ssm_states)
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        part = [t[lo : lo + n] for t in case.inputs()[:5]]
        qsl = torch.tensor([0, n], dtype=torch.int32)
        init = torch.tensor([i > 0])
        outs.append(
            cpu_kernels.kda_varlen(
                *part, *params, qsl, case.state_indices, init, chunk, lower_bound=lower_bound
            )
        )
        lo += n
    for t in range(total, total + 2):
        step = [x[t : t + 1] for x in case.inputs()[:5]]
        outs.append(cpu_kernels.kda_update(*step, *params, case.state_indices, lower_bound))
    torch.testing.assert_close(torch.cat(outs), want, **F32_TOL)
    torch.testing.assert_close(case.ssm_states, whole.ssm_states, **F32_TOL)


def split_projection(case: KDACase, transposed_qk: bool) -> KDACase:
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
    check_varlen(case, 16, F32_TOL)
    rows = split_projection(make_case([1] * 6, HEADS[1], seed=9, init=[True] * 6), transposed_qk)
    check_update(rows, F32_TOL)


def check_update(case: KDACase, tol: dict, lower_bound: float = 0.0) -> None:
    ref_case, cpp_case = case.clone(), case.clone()
    want = run_update(kda_update_ref, ref_case, lower_bound)
    got = run_update(cpu_kernels.kda_update, cpp_case, lower_bound)
    assert got.dtype == case.q.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(cpp_case.ssm_states.float(), ref_case.ssm_states.float(), **tol)
    used = set(case.state_indices.tolist()) - {PAD_SLOT_ID}
    for slot in set(range(case.ssm_states.shape[0])) - used:
        assert torch.equal(cpp_case.ssm_states[slot], case.ssm_states[slot])


@needs_cpp
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32,) * 2, (torch.bfloat16, torch.float32), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("lower_bound", LOWER_BOUNDS)
def test_update_cpp_matches_ref(heads, dtype, state_dtype, strong_decay, lower_bound):
    case = make_case(
        [1] * 7, heads, seed=13, pad=(0, 4), init=[True] * 7, dtype=dtype,
        state_dtype=state_dtype, strong_decay=strong_decay,
    )  # fmt: skip
    tol = F32_TOL if dtype == state_dtype == torch.float32 else BF16_TOL
    check_update(case, tol, lower_bound)


@needs_cpp
def test_update_cpp_empty_batch():
    check_update(make_case([], HEADS[0]), F32_TOL)


@pytest.mark.parametrize("backend", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lower_bound", LOWER_BOUNDS)
def test_update_equals_varlen_on_one_token_sequences(backend, heads, lower_bound):
    """A decode step is a one-token prefill from the slot's state: both forms agree."""
    ops = family_ops(FAMILY, backend)
    case = make_case([1] * 6, heads, seed=17, pad=(1,), init=[True] * 6)
    varlen_case, update_case = case.clone(), case.clone()
    want = ops.varlen(
        q=case.q, k=case.k, v=case.v, a=case.a, b=case.b, A_log=case.A_log,
        dt_bias=case.dt_bias, ssm_states=varlen_case.ssm_states,
        query_start_loc=case.query_start_loc, state_indices=case.state_indices,
        has_initial_state=case.has_initial_state, chunk_size=16, lower_bound=lower_bound,
    )  # fmt: skip
    got = ops.update(
        q=case.q, k=case.k, v=case.v, a=case.a, b=case.b, A_log=case.A_log,
        dt_bias=case.dt_bias, ssm_states=update_case.ssm_states, state_indices=case.state_indices,
        lower_bound=lower_bound,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(update_case.ssm_states, varlen_case.ssm_states, rtol=1e-5, atol=1e-6)


@needs_cpp
def test_cpp_backend_registers_the_family():
    ops = family_ops(FAMILY, "cpp")
    assert ops.varlen is cpu_kernels.kda_varlen
    assert ops.update is cpu_kernels.kda_update
    assert ops.norm_gate is cpu_kernels.kda_norm_gate
    ref = family_ops(FAMILY, "ref")
    assert ref.varlen is kda_varlen_ref and ref.update is kda_update_ref
    assert ref.norm_gate is kda_norm_gate_ref


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_norm_gate_cpp_matches_ref(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(21)
    proj = torch.randn(9, 2, 3, 40, generator=gen).to(dtype)  # o and gate split from one tensor
    o, gate = proj[:, 0], proj[:, 1] * 4.0  # (9, 3, 40), non-contiguous
    weight = (1.0 + 0.3 * torch.randn(40, generator=gen)).to(weight_dtype)
    want = kda_norm_gate_ref(o, gate, weight, 1e-6)
    got = cpu_kernels.kda_norm_gate(o, gate, weight, 1e-6)
    assert got.dtype == dtype and got.shape == o.shape
    # float32: exp and rsqrt a few ulps from torch's. bfloat16: one rounding of float32 values
    # a few ulps apart, at most one bfloat16 ulp (2^-8 to 2^-7 relative).
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0}
    torch.testing.assert_close(got, want, **tol)
    empty = torch.empty(0, 3, 40, dtype=dtype)
    assert cpu_kernels.kda_norm_gate(empty, empty, weight, 1e-6).shape == empty.shape
