"""The lightning-attention ops: the references against a token-by-token float64 loop written from
the recurrence (varlen prefill with and without initial states, chunked prefill continuing a
state, decode, padding rows), and the SSD route of a backend with its own SSD kernels
(`lightning_ops`: the C++ kernels, `csrc/ssd.cpp`) against the references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.lightning_attention import (
    FAMILY,
    lightning_ops,
    lightning_update_ref,
    lightning_varlen_ref,
)
from vllm_mamba.ops.table import bind_ops

needs_cpp = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension vllm_mamba._C_<level> is not built (pip install -e .)",
)

# (H, Dk, Dv): MiniMax's equal dims, unequal ones, dims that are not multiples of a vector.
HEADS = [(2, 16, 16), (3, 8, 24), (4, 5, 7)]
CHUNKS = [1, 5, 16, 64]
# float32 against float64 from the same inputs: outputs of order 10 summed over up to 70
# decayed tokens, in different orders (chunked matmuls, the kernels' own exp).
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_SLOTS = 8


@dataclasses.dataclass
class Case:
    """One varlen batch: q, k `(T, H, Dk)`, v `(T, H, Dv)`, slope `(H,)`, states
    `(S, H, Dv, Dk)` and the metadata of B sequences (padding rows included)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slope: torch.Tensor
    ssm_states: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    def clone(self) -> Case:
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)}
        )

    def varlen_args(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def make_case(
    lens: list[int],
    heads: tuple[int, int, int],
    *,
    seed: int = 0,
    pad: tuple[int, ...] = (),
    init: list[bool] | None = None,
) -> Case:
    """Sequences of `lens` tokens in distinct slots (padding rows of `pad` tokens after them),
    every other one from a saved state unless `init` says; silu-like positive q, k, v as the
    layer's, slopes from strong (2.0) to weak (0.004) decay."""
    num_heads, dk, dv = heads
    g = torch.Generator().manual_seed(seed)
    all_lens = list(lens) + list(pad)
    total = sum(all_lens)

    def act(*shape: int) -> torch.Tensor:
        return torch.nn.functional.silu(torch.randn(*shape, generator=g))

    slots = torch.randperm(NUM_SLOTS, generator=g)[: len(lens)].tolist()
    init = init if init is not None else [i % 2 == 1 for i in range(len(lens))]
    qsl = torch.tensor([0, *torch.tensor(all_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        q=act(total, num_heads, dk),
        k=act(total, num_heads, dk),
        v=torch.randn(total, num_heads, dv, generator=g),
        slope=torch.logspace(1, -8, num_heads, base=2.0),
        ssm_states=torch.randn(NUM_SLOTS, num_heads, dv, dk, generator=g),
        query_start_loc=qsl,
        state_indices=torch.tensor(slots + [PAD_SLOT_ID] * len(pad), dtype=torch.int32),
        has_initial_state=torch.tensor(init + [True] * len(pad)),
    )


def naive(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in float64, token by token and head by head, each state `S (Dk, Dv)`:
    `S = exp(-s) S + k^T v`, `o = q S`. Returns the outputs `(T, H, Dv)` (zeros for padding
    rows) and the states after the batch `(S, H, Dv, Dk)` (padding rows' slots untouched)."""
    out = torch.zeros(case.v.shape, dtype=torch.float64)
    states = case.ssm_states.double().clone()
    starts = case.query_start_loc.tolist()
    for i, slot in enumerate(case.state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        for h in range(case.q.shape[1]):
            decay = torch.exp(-case.slope[h].double())
            s = states[slot, h].T.clone() if case.has_initial_state[i] else None
            if s is None:
                s = torch.zeros(case.k.shape[-1], case.v.shape[-1], dtype=torch.float64)
            for t in range(starts[i], starts[i + 1]):
                q, k, v = (x[t, h].double() for x in (case.q, case.k, case.v))
                s = decay * s + torch.outer(k, v)
                out[t, h] = q @ s
            states[slot, h] = s.T
    return out, states


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, **F32_TOL)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_varlen_ref_equals_float64_loop(heads: tuple[int, int, int], chunk: int) -> None:
    """Sequences of 1 to 70 tokens (shorter and longer than the chunk), from zeros and from
    saved states, with padding rows: outputs and final states; padding rows' outputs zero."""
    case = make_case([5, 1, 70, 17, 33], heads, pad=(1, 3))
    want_out, want_states = naive(case)
    got = case.clone()
    out = lightning_varlen_ref(**got.varlen_args(), chunk_size=chunk)
    _assert_close(out, want_out)
    _assert_close(got.ssm_states, want_states)
    assert not out[-4:].any()


def test_empty_fresh_sequence_leaves_a_zero_state() -> None:
    """A chunk of no tokens and no saved state zeroes its slot; with a saved state, keeps it."""
    case = make_case([0, 4, 0], (2, 16, 16), init=[False, True, True])
    want_out, want_states = naive(case)
    got = case.clone()
    _assert_close(lightning_varlen_ref(**got.varlen_args()), want_out)
    _assert_close(got.ssm_states, want_states)
    assert not got.ssm_states[case.state_indices[0]].any()


@pytest.mark.parametrize("cut", [1, 16, 29])
def test_chunked_prefill_continues_the_state(cut: int) -> None:
    """A prompt run in two calls, the second from the state the first left, equals the prompt
    run whole."""
    whole = make_case([45], (3, 8, 24), init=[False])
    want_out, want_states = naive(whole)
    first = dataclasses.replace(
        whole.clone(), query_start_loc=torch.tensor([0, cut], dtype=torch.int32)
    )
    slot = int(whole.state_indices[0])
    out1 = lightning_varlen_ref(**{**first.varlen_args(), "q": whole.q[:cut],
                                   "k": whole.k[:cut], "v": whole.v[:cut]})  # fmt: skip
    second = dataclasses.replace(
        first,
        q=whole.q[cut:], k=whole.k[cut:], v=whole.v[cut:],
        query_start_loc=torch.tensor([0, 45 - cut], dtype=torch.int32),
        has_initial_state=torch.tensor([True]),
    )  # fmt: skip
    out2 = lightning_varlen_ref(**second.varlen_args(), chunk_size=7)
    _assert_close(torch.cat([out1, out2]), want_out)
    _assert_close(second.ssm_states[slot], want_states[slot])


@pytest.mark.parametrize("heads", HEADS)
def test_update_ref_equals_float64_loop(heads: tuple[int, int, int]) -> None:
    """Three decode steps of four rows (one a padding row): outputs and states; the padding
    row's output is zero and no state it could name changes."""
    case = make_case([1, 1, 1], heads, pad=(1,), init=[True, True, True], seed=3)
    states = case.ssm_states.clone()
    want_states = case.ssm_states.double().clone()
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        q, k, v = (torch.randn(x.shape, generator=g) for x in (case.q, case.k, case.v))
        step_case = dataclasses.replace(case, q=q, k=k, v=v, ssm_states=want_states.float())
        want_out, want_states = naive(step_case)
        out = lightning_update_ref(q, k, v, case.slope, states, case.state_indices)
        _assert_close(out, want_out)
        _assert_close(states, want_states)
        assert not out[-1].any()
    untouched = [s for s in range(NUM_SLOTS) if s not in case.state_indices.tolist()]
    torch.testing.assert_close(states[untouched], case.ssm_states[untouched], rtol=0, atol=0)


def test_ref_backend_runs_the_references() -> None:
    ops = lightning_ops(bind_ops("ref"))
    assert ops.varlen is lightning_varlen_ref and ops.update is lightning_update_ref
    assert family_ops(FAMILY, "ref").varlen is lightning_varlen_ref


@needs_cpp
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cpp_ssd_route_equals_references(
    heads: tuple[int, int, int], state_dtype: torch.dtype
) -> None:
    """The C++ backend (no lightning kernel of its own) runs the ops as SSD scans: the same
    outputs and states as the references, prefill then decode with a padding row."""
    ops = lightning_ops(bind_ops("cpp"))
    assert ops.varlen.args == (cpu_kernels.ssd_chunk_scan_varlen,)  # type: ignore[attr-defined]
    case = make_case([5, 1, 70, 17], heads, pad=(2,))
    case.ssm_states = case.ssm_states.to(state_dtype)
    ref, got = case.clone(), case.clone()
    tol = F32_TOL if state_dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-3}
    real = int(case.query_start_loc[4])  # the padding rows' outputs are unspecified
    want = lightning_varlen_ref(**ref.varlen_args())[:real]
    torch.testing.assert_close(ops.varlen(**got.varlen_args())[:real], want, **F32_TOL)
    torch.testing.assert_close(got.ssm_states.float(), ref.ssm_states.float(), **tol)
    rows = torch.tensor([*case.state_indices[:4].tolist(), PAD_SLOT_ID], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(5, *x.shape[1:], generator=g) for x in (case.q, case.k, case.v))
    want = lightning_update_ref(q, k, v, case.slope, ref.ssm_states, rows)
    out = ops.update(q=q, k=k, v=v, slope=case.slope, ssm_states=got.ssm_states, state_indices=rows)
    torch.testing.assert_close(out[:4], want[:4], **tol)
    torch.testing.assert_close(got.ssm_states.float(), ref.ssm_states.float(), **tol)
