"""The `short_conv` ops (LFM2's gated short conv): the references against a naive per-sequence
loop (the conv by `F.conv1d` over the zero- or state-padded history), and the C++ kernels
(`vllm_mamba.ops.cpu_kernels`) against the references.

Tolerances: in float32 both sides compute `u = B * x` exactly alike and sum the K taps in
different orders, a few float32 ulps on values of order 1 (checked at 1e-5). A bfloat16 output
is rounded once from float32 values that differ by that much, so the two land at most one
bfloat16 ulp apart (2^-7 relative at most). States are `u` itself, computed identically on both
sides, so they match exactly in either dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.short_conv import FAMILY, short_conv_update_ref, short_conv_varlen_ref

needs_cpp = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension vllm_mamba._C_<level> is not built (pip install -e .)",
)

F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 2**-7, "atol": 1e-4}
# Channels: one AVX-512 vector, not a multiple of 16 (vector tails), more than one task's chunk
# (128) with a tail.
DIMS = [16, 40, 150]
WIDTHS = [2, 3, 4]
# Shorter than the history, one token, empty, and longer than the C++ kernel's 64-token tile
# and the Triton kernel's 16-token block.
LENS = [2, 1, 0, 9, 70]


@dataclasses.dataclass
class SCCase:
    """One call's inputs: `bcx (T, 3D)`, `conv_states (S, D, K - 1)`, `weight (D, K)`,
    `bias (D,)` or None, and the metadata of B sequences (or decode rows)."""

    bcx: torch.Tensor
    conv_states: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    def clone(self) -> SCCase:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).clone()
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None
            },
        )

    def varlen_args(self) -> tuple:
        return (
            self.bcx, self.conv_states, self.weight, self.bias, self.query_start_loc,
            self.state_indices, self.has_initial_state,
        )  # fmt: skip

    def update_args(self) -> tuple:
        return self.bcx, self.conv_states, self.weight, self.bias, self.state_indices


def make_case(
    lens: list[int],
    dim: int = 40,
    width: int = 3,
    *,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
    pad: tuple[int, ...] = (),
    init: bool | None = None,
    seed: int = 0,
) -> SCCase:
    """Random inputs for sequences of `lens` tokens (rows `pad` are padding), each with its own
    slot among `len(lens) + 2` (two never used); `init` None: every other sequence has an
    initial state."""
    gen = torch.Generator().manual_seed(seed)
    tokens, batch = sum(lens), len(lens)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    slots[list(pad)] = PAD_SLOT_ID
    has_init = torch.arange(batch) % 2 == 0 if init is None else torch.full((batch,), init)
    return SCCase(
        bcx=torch.randn(tokens, 3 * dim, generator=gen).to(dtype),
        conv_states=torch.randn(batch + 2, dim, width - 1, generator=gen).to(state_dtype),
        weight=torch.randn(dim, width, generator=gen) * 0.5,
        bias=torch.randn(dim, generator=gen) * 0.5 if bias else None,
        query_start_loc=torch.tensor([0, *lens]).cumsum(0).to(torch.int32),
        state_indices=slots.to(torch.int32),
        has_initial_state=has_init,
    )


def naive(case: SCCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence by sequence: `C * conv1d([history | B * x])`; returns outputs and new states."""
    states = case.conv_states.clone()
    dim, width = case.weight.shape
    qsl = case.query_start_loc.tolist()
    outs = []
    for i, slot in enumerate(case.state_indices.tolist()):
        b, c, x = case.bcx[qsl[i] : qsl[i + 1]].float().chunk(3, dim=-1)  # (L, D) each
        u = (b * x).T  # (D, L)
        if slot != PAD_SLOT_ID and bool(case.has_initial_state[i]):
            hist = states[slot].float()
        else:
            hist = torch.zeros(dim, width - 1)
        padded = torch.cat([hist, u], dim=1)  # (D, K - 1 + L)
        bias = case.bias.float() if case.bias is not None else None
        y = torch.zeros(dim, 0)  # (D, L): an empty sequence only moves its history
        if u.shape[1]:
            w = case.weight.float()[:, None, :]  # (D, 1, K)
            y = F.conv1d(padded[None], w, bias, groups=dim)[0]
        outs.append((c * y.T).to(case.bcx.dtype))
        if slot != PAD_SLOT_ID:
            states[slot] = padded[:, padded.shape[1] - (width - 1) :].to(states.dtype)
    return torch.cat(outs), states


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return F32_TOL if dtype == torch.float32 else BF16_TOL


def _assert_states(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> None:
    """Equal where the reference wrote; bit-identical where it did not (padding, free slots)."""
    written = (want != before).flatten(1).any(1)  # (S,)
    torch.testing.assert_close(got[written], want[written], rtol=0, atol=0)
    assert torch.equal(got[~written], before[~written])


# --- the references ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("init", [None, False, True])
def test_varlen_ref_matches_naive(width: int, bias: bool, init: bool | None) -> None:
    case = make_case(LENS, width=width, bias=bias, pad=(3,), init=init)
    want, want_states = naive(case)
    got = short_conv_varlen_ref(*case.varlen_args())
    torch.testing.assert_close(got, want, **F32_TOL)
    torch.testing.assert_close(case.conv_states, want_states, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_ref_bfloat16(dtype: torch.dtype) -> None:
    """bfloat16 states, float32 or bfloat16 inputs: one rounding of each side's result."""
    case = make_case(LENS, dtype=dtype, state_dtype=torch.bfloat16, pad=(1,))
    want, want_states = naive(case)
    got = short_conv_varlen_ref(*case.varlen_args())
    assert got.dtype == dtype and case.conv_states.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    torch.testing.assert_close(case.conv_states, want_states, rtol=0, atol=0)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bias", [False, True])
def test_update_ref_matches_naive(width: int, bias: bool) -> None:
    """One token per row is a varlen batch of one-token sequences, all with their history."""
    case = make_case([1] * 5, width=width, bias=bias, pad=(0, 3), init=True)
    want, want_states = naive(case)
    got = short_conv_update_ref(*case.update_args())
    valid = case.state_indices != PAD_SLOT_ID
    torch.testing.assert_close(got[valid], want[valid], **F32_TOL)
    torch.testing.assert_close(case.conv_states, want_states, rtol=0, atol=0)


def test_update_ref_padding_uses_zero_history() -> None:
    case = make_case([1] * 3, pad=(1,), init=True)
    before = case.conv_states.clone()
    got = short_conv_update_ref(*case.update_args())
    case.has_initial_state[1] = False
    case.conv_states = before
    want, _ = naive(case)
    torch.testing.assert_close(got[1], want[1], **F32_TOL)


def test_family_registered() -> None:
    ops = family_ops(FAMILY, "ref")
    assert ops.update is short_conv_update_ref and ops.varlen is short_conv_varlen_ref


# --- the C++ kernels --------------------------------------------------------------------------


def _check_varlen(case: SCCase) -> torch.Tensor:
    """Kernel and reference on copies of the same states: outputs (every token) and states."""
    before = case.conv_states.clone()
    ref_case = case.clone()
    want = short_conv_varlen_ref(*ref_case.varlen_args())
    got = cpu_kernels.short_conv_varlen(*case.varlen_args())
    assert got.dtype == case.bcx.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    _assert_states(case.conv_states, ref_case.conv_states, before)
    return got


def _check_update(case: SCCase) -> torch.Tensor:
    before = case.conv_states.clone()
    ref_case = case.clone()
    want = short_conv_update_ref(*ref_case.update_args())
    got = cpu_kernels.short_conv_update(*case.update_args())
    assert got.dtype == case.bcx.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    _assert_states(case.conv_states, ref_case.conv_states, before)
    return got


@needs_cpp
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_varlen(dim: int, width: int, bias: bool, dtype: torch.dtype) -> None:
    _check_varlen(make_case(LENS, dim, width, bias=bias, dtype=dtype, state_dtype=dtype, pad=(3,)))


@needs_cpp
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cpp_varlen_initial_states(init: bool, state_dtype: torch.dtype) -> None:
    _check_varlen(make_case(LENS, 40, 4, state_dtype=state_dtype, init=init))


@needs_cpp
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_update(dim: int, width: int, bias: bool, dtype: torch.dtype) -> None:
    _check_update(
        make_case([1] * 6, dim, width, bias=bias, dtype=dtype, state_dtype=dtype, pad=(0, 4))
    )


@needs_cpp
def test_cpp_update_mixed_dtypes() -> None:
    """bfloat16 activations over float32 states, and the other way round."""
    _check_update(make_case([1] * 4, dtype=torch.bfloat16, state_dtype=torch.float32))
    _check_update(make_case([1] * 4, dtype=torch.float32, state_dtype=torch.bfloat16))


@needs_cpp
def test_cpp_padding_rows_touch_no_slot() -> None:
    """Padding rows first, between and last, and an empty sequence: other slots untouched."""
    case = make_case([3, 0, 6, 2, 9], pad=(0, 3, 4), init=True)
    before = case.conv_states.clone()
    _check_varlen(case)
    valid = case.state_indices[case.state_indices != PAD_SLOT_ID].long()
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[valid] = False
    assert torch.equal(case.conv_states[others], before[others])
    upd = make_case([1] * 3, pad=(0, 1, 2))
    before = upd.conv_states.clone()
    _check_update(upd)
    assert torch.equal(upd.conv_states, before)


@needs_cpp
def test_cpp_strided_bcx() -> None:
    """bcx a column slice of a wider tensor (a free row stride), read in place."""
    case = make_case([5, 70], 24, 3)
    wide = torch.randn(case.bcx.shape[0], case.bcx.shape[1] + 7)
    wide[:, 3 : 3 + case.bcx.shape[1]] = case.bcx
    case.bcx = wide[:, 3 : 3 + case.bcx.shape[1]]
    _check_varlen(case)
    rows = make_case([1] * 3, 24, 3)
    wide = torch.randn(3, rows.bcx.shape[1] + 5)
    wide[:, :-5] = rows.bcx
    rows.bcx = wide[:, :-5]
    _check_update(rows)


@needs_cpp
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuts", [[1, 69, 3], [2, 5, 64, 1], [66, 7]])
def test_cpp_cut_sequence_equals_one_call(width: int, dtype: torch.dtype, cuts: list[int]) -> None:
    """One sequence in pieces cut anywhere (then two decode steps) against one reference call:
    the float32 history carries u exactly across the cuts."""
    total = sum(cuts)
    case = make_case([total + 2], 40, width, dtype=dtype, init=False, seed=1)
    want_case = case.clone()
    want = short_conv_varlen_ref(*want_case.varlen_args())
    outs, lo = [], 0
    for i, n in enumerate(cuts):
        qsl = torch.tensor([0, n], dtype=torch.int32)
        init = torch.tensor([i > 0])
        part = case.bcx[lo : lo + n]
        outs.append(
            cpu_kernels.short_conv_varlen(
                part, case.conv_states, case.weight, case.bias, qsl, case.state_indices, init
            )
        )
        lo += n
    for t in range(total, total + 2):
        outs.append(
            cpu_kernels.short_conv_update(
                case.bcx[t : t + 1], case.conv_states, case.weight, case.bias, case.state_indices
            )
        )
    torch.testing.assert_close(torch.cat(outs).float(), want.float(), **_tol(dtype))
    torch.testing.assert_close(case.conv_states, want_case.conv_states, **F32_TOL)


@needs_cpp
def test_cpp_registered_for_cpp_backend() -> None:
    ops = family_ops(FAMILY, "cpp")
    assert ops.update is cpu_kernels.short_conv_update
    assert ops.varlen is cpu_kernels.short_conv_varlen
