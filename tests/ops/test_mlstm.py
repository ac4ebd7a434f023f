"""The mLSTM ops (`ops.mlstm`): the references against an independent float64 loop written from
the cell's equations (varlen prefill from zeros and from saved states, chunked prefill
continuing a state, decode, padding rows, an empty sequence), and against transformers' own
chunkwise and step functions; the C++ kernels against the same float64 loop.

Inputs: gates soft-capped at 15, input pre-activations from N(0, 4^2) and forget ones from
N(2, 3^2), so that both sides of the denominator's `max(|q . n|, exp(-m))` are taken
(asserted); keys and normalisers positive (softplus) and each head's queries of one sign (head
0's negative), so that `q . n` is a sum without cancellation. (With queries and keys of both
signs `q . n` can come arbitrarily close to zero above `exp(-m)`: float32 outputs then move by
up to 3e-2 from float64 in transformers' own token-by-token step as in the references, the
conditioning of the division, not of either implementation.) `make_case` is shared with the
Triton tests.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn import functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.mlstm import FAMILY, mlstm_update_ref, mlstm_varlen_ref

_NEEDS_CPP = pytest.mark.skipif(
    "mlstm_varlen" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)
# The references and the C++ kernels (`csrc/mlstm.cpp`: the recurrent form token by token).
IMPLS = ["ref", pytest.param("cpp", marks=_NEEDS_CPP)]


def _ops(impl: str):  # noqa: ANN202 - (varlen, update)
    if impl == "ref":
        return mlstm_varlen_ref, mlstm_update_ref
    return cpu_kernels.mlstm_varlen, cpu_kernels.mlstm_update


# (H, Dk, Dv): xLSTM's Dk = Dv / 2, equal dims, dims that are not multiples of a vector.
HEADS = [(2, 8, 16), (3, 12, 12), (1, 5, 7)]
CHUNKS = [1, 7, 16, 64]
# float32 against float64 from the same inputs: sums over up to 70 tokens in another order
# (chunked matmuls, differences of cumulative log gates); measured at most 4.3e-6 (transformers'
# float32 step function: 2.4e-6) over these cases and seeds 0-3.
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_SLOTS = 8
EPS = 1e-6
CAP = 15.0
TOKENS = ("q", "k", "v", "igate", "fgate")
STATES = ("c_states", "n_states", "m_states")


@dataclasses.dataclass
class Case:
    """One varlen batch and its states (see the glossary of `ops.mlstm`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    igate: torch.Tensor
    fgate: torch.Tensor
    c_states: torch.Tensor
    n_states: torch.Tensor
    m_states: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    def clone(self) -> Case:
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)}
        )

    def args(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def states(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.c_states, self.n_states, self.m_states

    def state_args(self) -> dict[str, torch.Tensor]:
        return dict(zip(STATES, self.states()))


def make_case(
    lens: list[int],
    heads: tuple[int, int, int],
    *,
    seed: int = 0,
    pad: tuple[int, ...] = (),
    init: list[bool] | None = None,
    device: str = "cpu",
) -> Case:
    """Sequences of `lens` tokens in distinct slots (padding rows of `pad` tokens after them),
    every other one from a saved state unless `init` says; saved states as a run leaves them
    (`m` of order 10, `C` and `n` of order 1)."""
    num_heads, dk, dv = heads
    g = torch.Generator().manual_seed(seed)
    total = sum(lens) + sum(pad)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    slots = torch.randperm(NUM_SLOTS, generator=g)[: len(lens)].tolist()
    init = init if init is not None else [i % 2 == 1 for i in range(len(lens))]
    qsl = torch.tensor([0, *torch.tensor([*lens, *pad]).cumsum(0).tolist()], dtype=torch.int32)
    sign = torch.ones(num_heads, 1)
    sign[0] = -1  # head 0's denominators are negative
    case = Case(
        q=F.softplus(randn(total, num_heads, dk)) * sign,
        k=F.softplus(randn(total, num_heads, dk)),
        v=randn(total, num_heads, dv),
        igate=CAP * torch.tanh(randn(total, num_heads) * 4 / CAP),
        fgate=CAP * torch.tanh((randn(total, num_heads) * 3 + 2) / CAP),
        c_states=randn(NUM_SLOTS, num_heads, dk, dv),
        n_states=F.softplus(randn(NUM_SLOTS, num_heads, dk)),
        m_states=randn(NUM_SLOTS, num_heads) * 4 + 8,
        query_start_loc=qsl,
        state_indices=torch.tensor(slots + [PAD_SLOT_ID] * len(pad), dtype=torch.int32),
        has_initial_state=torch.tensor(init + [True] * len(pad)),
    )
    return dataclasses.replace(case, **{k: t.to(device) for k, t in case.args().items()})


def naive(case: Case, floors: list[bool] | None = None) -> tuple[torch.Tensor, ...]:
    """The cell in float64, token by token and head by head, from the equations of
    `ops.mlstm` (a fresh sequence from zeros). Returns the outputs `(T, H, Dv)` (zeros for
    padding rows) and the states after the batch (padding rows' slots untouched); appends to
    `floors` whether each denominator took `exp(-m)`."""
    out = torch.zeros(case.v.shape, dtype=torch.float64)
    c_all, n_all, m_all = (s.double().clone() for s in case.states())
    dk = case.q.shape[-1]
    starts = case.query_start_loc.tolist()
    for b, slot in enumerate(case.state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        for h in range(case.q.shape[1]):
            if bool(case.has_initial_state[b]):
                c, n, m = c_all[slot, h].clone(), n_all[slot, h].clone(), float(m_all[slot, h])
            else:
                c, n, m = torch.zeros_like(c_all[slot, h]), torch.zeros_like(n_all[slot, h]), 0.0
            for t in range(starts[b], starts[b + 1]):
                q, k, v = (x[t, h].double() for x in (case.q, case.k, case.v))
                i, f = float(case.igate[t, h]), float(case.fgate[t, h])
                lf = -math.log1p(math.exp(-f))  # log sigmoid(f)
                m_new = max(lf + m, i)
                decay, gain = math.exp(lf + m - m_new), math.exp(i - m_new)
                c = decay * c + gain * torch.outer(k, v)
                n = decay * n + gain * k
                m = m_new
                qs = q / math.sqrt(dk)
                den = abs(float(qs @ n))
                if floors is not None:
                    floors.append(math.exp(-m) > den)
                out[t, h] = (qs @ c) / (max(den, math.exp(-m)) + EPS)
            c_all[slot, h], n_all[slot, h], m_all[slot, h] = c, n, m
    return out, c_all, n_all, m_all


def _assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, **F32_TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_varlen_equals_float64_loop(impl: str, heads: tuple[int, int, int], chunk: int) -> None:
    """Sequences of 0 to 70 tokens (shorter and longer than the chunk), from zeros and from
    saved states, with padding rows: outputs and final states; both sides of the denominator
    taken; padding rows' outputs zero."""
    case = make_case([5, 0, 70, 1, 17, 33], heads, pad=(1, 3),
                     init=[True, False, False, True, True, False])  # fmt: skip
    floors: list[bool] = []
    want = naive(case, floors)
    assert 0 < sum(floors) < len(floors)
    got = case.clone()
    out = _ops(impl)[0](**got.args(), eps=EPS, chunk_size=chunk)
    _assert_close((out, *got.states()), want)
    assert not out[-4:].any()
    empty = int(case.state_indices[1])  # the empty fresh sequence leaves a zero state
    assert not any(s[empty].any() for s in got.states())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cut", [1, 16, 29])
def test_chunked_prefill_continues_the_state(impl: str, cut: int) -> None:
    """A prompt run in two calls, the second from the state the first left (in other chunk
    sizes), equals the prompt run whole."""
    whole = make_case([45], (3, 12, 12), init=[False])
    want = naive(whole)
    slot = int(whole.state_indices[0])
    got = whole.clone()
    outs = []
    for lo, hi, init, chunk in ((0, cut, False, 64), (cut, 45, True, 7)):
        part = {name: getattr(whole, name)[lo:hi] for name in TOKENS}
        outs.append(
            _ops(impl)[0](
                **part, **got.state_args(),
                query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
                state_indices=whole.state_indices, has_initial_state=torch.tensor([init]),
                eps=EPS, chunk_size=chunk,
            )
        )  # fmt: skip
    _assert_close((torch.cat(outs), *(s[slot] for s in got.states())),
                  (want[0], *(s[slot] for s in want[1:])))  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", HEADS)
def test_update_equals_float64_loop(impl: str, heads: tuple[int, int, int]) -> None:
    """Three decode steps of four rows (one a padding row): outputs and states; the padding
    row's output is zero and no state it could name changes."""
    case = make_case([1, 1, 1], heads, pad=(1,), init=[True, True, True], seed=3)
    got = case.clone()
    want = case.clone()
    for step in range(3):
        step_case = make_case([1, 1, 1], heads, pad=(1,), init=[True] * 3, seed=10 + step)
        step_case = dataclasses.replace(
            step_case, c_states=want.c_states, n_states=want.n_states, m_states=want.m_states,
            state_indices=case.state_indices,
        )  # fmt: skip
        want_out, *want_states = naive(step_case)
        want = dataclasses.replace(want, **dict(zip(STATES, (s.float() for s in want_states))))
        inputs = {n: getattr(step_case, n) for n in TOKENS}
        out = _ops(impl)[1](**inputs, **got.state_args(), state_indices=case.state_indices, eps=EPS)
        _assert_close((out, *got.states()), (want_out, *want_states))
        assert not out[-1].any()
    untouched = [s for s in range(NUM_SLOTS) if s not in case.state_indices.tolist()]
    for g, c in zip(got.states(), case.states()):
        torch.testing.assert_close(g[untouched], c[untouched], rtol=0, atol=0)


def test_varlen_equals_transformers_chunkwise_and_steps() -> None:
    """transformers' inference path (whole chunks of 64 chunkwise, the rest token by token,
    from its zero state) on one 150-token sequence: outputs and last states."""
    xlstm = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
    case = make_case([150], (2, 8, 16), init=[False])
    step = xlstm.mlstm_recurrent_step_native
    # (B, H, L, D) and (B, H, L) as transformers' backend takes them
    q, k, v = (t.transpose(0, 1)[None] for t in (case.q, case.k, case.v))
    i, f = (t.T[None] for t in (case.igate, case.fgate))
    want_h, (want_c, want_n, want_m) = xlstm.wrap_chunkwise_arbitrary_sequence_length(
        mlstm_chunkwise_kernel=xlstm.mlstm_chunkwise_native_autograd,
        mlstm_sequence_kernel=xlstm.mlstm_recurrent_sequence_native,
        mlstm_step_kernel=step, query=q, key=k, value=v, fgate=f, igate=i, eps=EPS,
        chunk_size=64, return_last_states=True,
    )  # fmt: skip
    got = case.clone()
    out = mlstm_varlen_ref(**got.args(), eps=EPS)
    slot = int(case.state_indices[0])
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, want_h[0].transpose(0, 1), **tol)
    torch.testing.assert_close(got.c_states[slot], want_c[0], **tol)
    torch.testing.assert_close(got.n_states[slot], want_n[0], **tol)
    torch.testing.assert_close(got.m_states[slot], want_m[0, :, 0], **tol)


def test_bfloat16_inputs_and_states() -> None:
    """bfloat16 inputs and C / n states (float32 m): float32 math, within bfloat16 rounding of
    the float32 run."""
    case = make_case([5, 40], (2, 8, 16))
    low = case.clone()
    names = (*TOKENS, "c_states", "n_states")
    for name in names:
        setattr(low, name, getattr(low, name).to(torch.bfloat16))
    ref = dataclasses.replace(low.clone(), **{n: getattr(low, n).float() for n in names})
    out = mlstm_varlen_ref(**low.args())
    want = mlstm_varlen_ref(**ref.args())
    assert out.dtype == torch.bfloat16 and low.c_states.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(low.c_states.float(), ref.c_states, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(low.m_states, ref.m_states, rtol=0, atol=0)


def test_ref_backend_runs_the_references() -> None:
    ops = family_ops(FAMILY, "ref")
    assert ops.varlen is mlstm_varlen_ref and ops.update is mlstm_update_ref
