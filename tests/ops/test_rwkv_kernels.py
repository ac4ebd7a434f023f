"""The C++ RWKV wkv kernels (`csrc/rwkv.cpp`, `vllm_mamba.ops.cpu_kernels`) against their
references: `rwkv7` (`wkv7_varlen_ref`, `wkv7_update_ref`) and `rwkv4` (`wkv4_varlen_ref`,
`wkv4_update_ref`).

Tolerances. float32: both sides read the same float32 values and compute the same recurrence,
in different orders (the kernel's dot products are vector partial sums, its updates fused
multiply-adds, its exp `math.h`'s exp_f32 within a few ulps of torch's); outputs of order 10
and states of order 1 agree to a few float32 ulps per token, and the rule does not amplify
them (the state's decay and the removal `I + a b^T` have norms <= 1 with the models' a, b), so
1e-5 relative (and 1e-5 absolute near zero) holds with a wide margin (measured: about 1e-6).
bfloat16: the inputs widen exactly, so the float32 results differ as above, and each output or
stored state is rounded once from them: values that straddle a rounding boundary land one
bfloat16 ulp apart (2^-7 relative at most), never more. A bfloat16 state is rounded at the end
of each call on both sides alike, so continuations read the same values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels, rwkv4, rwkv7
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.rwkv4 import MAX_INIT, wkv4_update_ref, wkv4_varlen_ref
from vllm_mamba.ops.rwkv7 import (
    fused_update_ref,
    shift_mix_ref,
    wkv7_update_ref,
    wkv7_varlen_ref,
)

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension vllm_mamba._C_<level> is not built (pip install -e .)",
)

F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 2**-7, "atol": 1e-4}
# (H, Dk, Dv): the released head size 64; one vector and less; Dk != Dv and sizes that are not
# a multiple of 16 (vector tails); 128; and 264 (more vectors per row than the kernel unrolls:
# its generic loop).
HEADS = [(2, 64, 64), (3, 16, 16), (2, 24, 40), (1, 48, 32), (1, 128, 128), (1, 264, 8)]
# One token, empty (with a slot), longer, and a padding row with tokens (index 4).
LENS = [5, 1, 0, 17, 3]
PAD = (4,)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return BF16_TOL if dtype == torch.bfloat16 else F32_TOL


def _meta(
    lens: list[int], pad: tuple[int, ...], init: bool | None, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`query_start_loc`, `state_indices` (distinct slots among B + 2, rows `pad` padding),
    `has_initial_state` (None: every other sequence) and the slot count."""
    batch = len(lens)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    slots[list(pad)] = PAD_SLOT_ID
    has_init = torch.arange(batch) % 2 == 0 if init is None else torch.full((batch,), init)
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return qsl, slots.to(torch.int32), has_init, batch + 2


# --- RWKV-7 -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Case7:
    """r, w, k, a, b `(T, H, Dk)`, v `(T, H, Dv)`, states `(S, H, Dv, Dk)` and the metadata."""

    r: torch.Tensor
    w: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    states: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.r, self.w, self.k, self.v, self.a, self.b


def make7(
    lens: list[int],
    heads: tuple[int, int, int] = (2, 64, 64),
    *,
    dtype: torch.dtype = torch.float32,
    w_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    pad: tuple[int, ...] = PAD,
    init: bool | None = None,
    decay_scale: float = 1.0,
    seed: int = 0,
) -> Case7:
    """Inputs as an RWKV-7 layer makes them: w = -exp(-0.5) sigmoid(.) (times `decay_scale`),
    a = -kk and b = kk * sigmoid(.) with kk L2-normalised, so the rule is a contraction."""
    gen = torch.Generator().manual_seed(seed)
    h, dk, dv = heads
    tokens = sum(lens)
    qsl, slots, has_init, num_slots = _meta(lens, pad, init, gen)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    kk = F.normalize(randn(tokens, h, dk), dim=-1)
    w = -0.6065 * torch.sigmoid(randn(tokens, h, dk)) * decay_scale
    return Case7(
        r=randn(tokens, h, dk).to(dtype),
        w=w.to(w_dtype or dtype),
        k=(randn(tokens, h, dk) * 0.5).to(dtype),
        v=randn(tokens, h, dv).to(dtype),
        a=(-kk).to(dtype),
        b=(kk * torch.sigmoid(randn(tokens, h, dk))).to(dtype),
        states=randn(num_slots, h, dv, dk).to(state_dtype),
        query_start_loc=qsl,
        state_indices=slots,
        has_initial_state=has_init,
    )


def check7_varlen(c: Case7) -> torch.Tensor:
    """Kernel and reference on copies of the states: outputs of every token, and states."""
    want_states = c.states.clone()
    want = wkv7_varlen_ref(
        *c.inputs(), want_states, c.query_start_loc, c.state_indices, c.has_initial_state
    )
    got = cpu_kernels.rwkv7_varlen(
        *c.inputs(), c.states, c.query_start_loc, c.state_indices, c.has_initial_state
    )
    assert got.dtype == c.r.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    torch.testing.assert_close(c.states.float(), want_states.float(), **_tol(c.states.dtype))
    return got


def check7_update(c: Case7) -> torch.Tensor:
    want_states = c.states.clone()
    want = wkv7_update_ref(*c.inputs(), want_states, c.state_indices)
    got = cpu_kernels.rwkv7_update(*c.inputs(), c.states, c.state_indices)
    assert got.dtype == c.r.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    torch.testing.assert_close(c.states.float(), want_states.float(), **_tol(c.states.dtype))
    return got


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_varlen(heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    check7_varlen(make7(LENS, heads, dtype=dtype, state_dtype=dtype))


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_varlen_initial_states(init: bool, state_dtype: torch.dtype) -> None:
    """Without initial states the slots start from zeros (an empty sequence zeroes its slot);
    with them, from the saved state; padding slots are never touched."""
    c = make7(LENS, (2, 24, 40), state_dtype=state_dtype, init=init)
    before = c.states.clone()
    check7_varlen(c)
    used = torch.zeros(before.shape[0], dtype=torch.bool)
    used[c.state_indices[c.state_indices != PAD_SLOT_ID].long()] = True
    assert torch.equal(c.states[~used], before[~used])
    empty = c.state_indices[2].item()  # LENS[2] == 0
    if init:
        assert torch.equal(c.states[empty], before[empty])
    else:
        assert not c.states[empty].any()


def test_rwkv7_mixed_dtypes() -> None:
    """float32 w with bfloat16 r, k, v, a, b (the layer keeps the decay in float32), over
    float32 and bfloat16 states; bfloat16 activations over float32 states."""
    check7_varlen(make7(LENS, dtype=torch.bfloat16, w_dtype=torch.float32))
    c = make7(
        [1] * 4, dtype=torch.bfloat16, w_dtype=torch.float32, state_dtype=torch.bfloat16, pad=(1,)
    )
    check7_update(c)
    check7_varlen(make7(LENS, (1, 48, 32), dtype=torch.bfloat16, state_dtype=torch.float32))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_update(heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Padding rows first and in the middle (outputs of a zero state, as the reference's);
    their slots, and every unused one, are untouched."""
    c = make7([1] * 5, heads, dtype=dtype, state_dtype=dtype, pad=(0, 3))
    before = c.states.clone()
    check7_update(c)
    used = torch.zeros(before.shape[0], dtype=torch.bool)
    used[c.state_indices[c.state_indices != PAD_SLOT_ID].long()] = True
    assert torch.equal(c.states[~used], before[~used])


def test_rwkv7_update_equals_varlen_of_one_token_sequences() -> None:
    c = make7([1] * 6, (2, 40, 24), pad=(2,), init=True)
    d = dataclasses.replace(c, states=c.states.clone())
    got = cpu_kernels.rwkv7_update(*c.inputs(), c.states, c.state_indices)
    want = cpu_kernels.rwkv7_varlen(
        *d.inputs(), d.states, d.query_start_loc, d.state_indices, d.has_initial_state
    )
    assert torch.equal(got, want) and torch.equal(c.states, d.states)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_prefill_cut_and_continued(state_dtype: torch.dtype) -> None:
    """A 70-token prefill cut at token 13 and continued, then two decode steps, equals one
    call (float32 states: bit for bit, the state read back exactly) and matches the reference
    doing the same cuts (bfloat16 states are rounded at the cut on both sides)."""
    c = make7([72], (2, 24, 40), state_dtype=state_dtype, pad=(), init=False, seed=3)
    one = dataclasses.replace(c, states=c.states.clone())
    ref = dataclasses.replace(c, states=c.states.clone())
    want_one = cpu_kernels.rwkv7_varlen(
        *(x[:70] for x in one.inputs()), one.states, torch.tensor([0, 70]), c.state_indices,
        torch.tensor([False]),
    )  # fmt: skip
    outs, refs = [], []
    for lo, hi, init in ((0, 13, False), (13, 70, True)):
        args = (torch.tensor([0, hi - lo]), c.state_indices, torch.tensor([init]))
        outs.append(cpu_kernels.rwkv7_varlen(*(x[lo:hi] for x in c.inputs()), c.states, *args))
        refs.append(wkv7_varlen_ref(*(x[lo:hi] for x in c.inputs()), ref.states, *args))
    if state_dtype == torch.float32:
        assert torch.equal(torch.cat(outs), want_one) and torch.equal(c.states, one.states)
    for t in (70, 71):
        row = [x[t : t + 1] for x in c.inputs()]
        outs.append(cpu_kernels.rwkv7_update(*row, c.states, c.state_indices))
        refs.append(wkv7_update_ref(*row, ref.states, c.state_indices))
    # Rounded at a cut, a bfloat16 state entry whose float32 values straddle a rounding
    # boundary is one bfloat16 ulp (2^-8 of entries of order 1-3) apart on the two sides; the
    # outputs after it differ by that times |r| (order 1), decaying.
    out_tol = F32_TOL if state_dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-6}
    torch.testing.assert_close(torch.cat(outs), torch.cat(refs), **out_tol)
    torch.testing.assert_close(c.states.float(), ref.states.float(), **_tol(state_dtype))


def test_rwkv7_strong_decay() -> None:
    """w down to -400 (exp(w) underflows to zero in float32): only the last tokens count."""
    c = make7(LENS, (2, 32, 32), decay_scale=0.0)
    c.w = -torch.exp(torch.empty(c.w.shape).uniform_(-1.0, 6.0))
    check7_varlen(c)
    u = make7([1] * 4, (2, 32, 32), pad=(1,), init=True)
    u.w = -torch.exp(torch.empty(u.w.shape).uniform_(2.0, 6.0))
    check7_update(u)


@pytest.mark.parametrize("threads", [1, 4])
def test_rwkv7_threads_and_row_blocks(threads: int) -> None:
    """One long sequence and one head: with more threads than (sequence, head) pairs the value
    rows are split into blocks (exact, rows are independent); the result does not depend on
    the thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c = make7([40], (1, 64, 64), pad=(), init=True, seed=5)
        check7_varlen(c)
    finally:
        torch.set_num_threads(saved)


def test_rwkv7_strided_inputs() -> None:
    """r a slice of a wider tensor (a free token stride, read in place), v transposed (copied)."""
    c = make7(LENS, (2, 24, 40))
    wide = torch.randn(c.r.shape[0], c.r.shape[1], c.r.shape[2] + 5)
    wide[..., 2 : 2 + c.r.shape[2]] = c.r
    c.r = wide[..., 2 : 2 + c.r.shape[2]]
    c.v = c.v.transpose(1, 2).contiguous().transpose(1, 2)
    check7_varlen(c)


def test_rwkv7_non_contiguous_states_is_an_error() -> None:
    c = make7([2], (1, 16, 16), pad=(), init=True)
    states = c.states.transpose(2, 3)
    with pytest.raises(RuntimeError, match="states must be contiguous"):
        cpu_kernels.rwkv7_update(*(x[:1] for x in c.inputs()), states, c.state_indices)


@pytest.mark.parametrize("lens", [[1000], [9, 8, 7, 30]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_long_sequences_transposed(lens: list[int], dtype: torch.dtype) -> None:
    """Sequences of at least 8 tokens run on the transposed state (axpys along the value rows):
    a long one, and lengths around the switch, with and without initial states."""
    check7_varlen(make7(lens, (2, 64, 64), dtype=dtype, state_dtype=dtype, pad=(), init=None))
    check7_varlen(make7([20, 3, 12], (1, 264, 40), dtype=dtype, pad=(1,), init=True, seed=1))


# --- RWKV-7 decode glue: shift_mix and fused_update ---------------------------------------------
#
# Tolerances. fused_update does its math in float32 and rounds the intermediates that the
# reference's tensor ops round to a bfloat16 model dtype (the rate, kk, the k_a update, b, the
# v_first lerp, the rule's output). float32 inputs: F32_TOL as the rule's tests. bfloat16: the
# kernel's float32 sums (the kk norm, the rule's dot products, the group norm's moments) are
# in other orders than torch's, so a rounded intermediate can land one bfloat16 ulp away; the
# group norm scales such an ulp of the rule's output by the head's 1 / std, so the outputs
# (order 1-3) agree to a few bfloat16 ulps (GLUE_BF16_TOL), the states to one.
GLUE_BF16_TOL = {"rtol": 2**-5, "atol": 2**-5}
# (NH, Dk, Dv): the released head size; one vector; a non-multiple of 16; Dv != Dk.
GLUE_HEADS = [(2, 64, 64), (1, 16, 16), (3, 24, 24), (2, 24, 40)]


def make_glue(
    rows: int,
    heads: tuple[int, int, int],
    *,
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    first_layer: bool,
    pad: tuple[int, ...],
    seed: int = 0,
) -> dict:
    """fused_update's arguments as an RWKV-7 layer passes them: w, a and v_gate strided views
    of one wider projection output; parameters in the model dtype."""
    gen = torch.Generator().manual_seed(seed)
    nh, dk, dv = heads
    c, cv = nh * dk, nh * dv

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    lora = randn(rows, 2 * c + cv + 3, scale=2.0)  # w_raw | a_raw | v_gate side by side
    slots = torch.randperm(rows + 3, generator=gen)[:rows]
    slots[list(pad)] = PAD_SLOT_ID
    return {
        "r": randn(rows, c),
        "w": lora[:, 1 : 1 + c],
        "k": randn(rows, c),
        "v": randn(rows, cv),
        "a": lora[:, 1 + c : 1 + 2 * c],
        "g": randn(rows, cv),
        "v_first": None if first_layer else randn(rows, cv),
        "v_gate": None if first_layer else lora[:, 2 + 2 * c : 2 + 2 * c + cv],
        "k_k": randn(c, scale=0.5) + 1,
        "k_a": randn(c, scale=0.5) + 1,
        "r_k": randn(nh, dk, scale=0.5),
        "gn_weight": randn(cv, scale=0.2) + 1,
        "gn_bias": randn(cv, scale=0.1),
        "gn_eps": 64e-5,
        "states": (torch.randn(rows + 3, nh, dv, dk, generator=gen) * 0.5).to(state_dtype),
        "state_indices": slots.to(torch.int32),
    }


def check_fused_update(args: dict) -> None:
    ref = {**args, "states": args["states"].clone()}
    want = fused_update_ref(**ref)
    before = args["states"].clone()
    got = cpu_kernels.rwkv7_fused_update(**args)
    g, states = args["g"], args["states"]
    assert got.dtype == g.dtype and got.shape == want.shape
    tol = GLUE_BF16_TOL if g.dtype == torch.bfloat16 else F32_TOL
    torch.testing.assert_close(got.float(), want.float(), **tol)
    s_tol = _tol(torch.bfloat16) if torch.bfloat16 in (g.dtype, states.dtype) else F32_TOL
    torch.testing.assert_close(states.float(), ref["states"].float(), **s_tol)
    used = torch.zeros(states.shape[0], dtype=torch.bool)
    idx = args["state_indices"]
    used[idx[idx != PAD_SLOT_ID].long()] = True
    assert torch.equal(states[~used], before[~used])


@pytest.mark.parametrize("heads", GLUE_HEADS)
@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_fused_update(
    heads: tuple[int, int, int], first_layer: bool, dtype: torch.dtype
) -> None:
    """Five rows (more than the threads), padding rows first and in the middle; the state in
    the model dtype."""
    args = make_glue(5, heads, dtype=dtype, state_dtype=dtype, first_layer=first_layer, pad=(0, 3))
    check_fused_update(args)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_rwkv7_fused_update_one_row(threads: int, state_dtype: torch.dtype) -> None:
    """Batch 1 with 16 heads (split over the threads), bfloat16 activations over float32 and
    bfloat16 states; then a padding row alone."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for first_layer in (True, False):
            args = make_glue(
                1, (16, 64, 64), dtype=torch.bfloat16, state_dtype=state_dtype,
                first_layer=first_layer, pad=(), seed=2,
            )  # fmt: skip
            check_fused_update(args)
        check_fused_update(
            make_glue(
                1, (2, 64, 64), dtype=torch.float32, state_dtype=state_dtype,
                first_layer=False, pad=(0,),
            )
        )  # fmt: skip
    finally:
        torch.set_num_threads(saved)


def test_rwkv7_fused_update_equals_glue_around_update() -> None:
    """float32: the same as `glue_inputs`, the C++ one-token update and `glue_output`, over
    three steps (the state carried)."""
    args = make_glue(
        4, (2, 64, 64), dtype=torch.float32, state_dtype=torch.float32, first_layer=False,
        pad=(2,),
    )  # fmt: skip
    ref_states = args["states"].clone()
    for _ in range(3):
        got = cpu_kernels.rwkv7_fused_update(**args)
        r = {**args, "states": ref_states}
        parts = rwkv7.glue_inputs(
            r["r"], r["w"], r["k"], r["v"], r["a"], r["v_first"], r["v_gate"], r["k_k"],
            r["k_a"], 64,
        )  # fmt: skip
        o = cpu_kernels.rwkv7_update(*parts, ref_states, r["state_indices"])
        rh, _, kh, vh, _, _ = parts
        want = rwkv7.glue_output(
            o, rh, kh, vh, r["g"], r["r_k"], r["gn_weight"], r["gn_bias"], r["gn_eps"]
        )
        torch.testing.assert_close(got, want, **F32_TOL)
        torch.testing.assert_close(args["states"], ref_states, **F32_TOL)


@pytest.mark.parametrize("mixes", [6, 1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rwkv7_shift_mix(mixes: int | None, dtype: torch.dtype, rows: int) -> None:
    """Six mixes (the time mix), one as `(1, 1, H)` and as `(H,)` (the channel mix); a row
    with a padding slot when B > 1; x a row slice of a wider tensor; 300 channels (more than
    one task, a vector tail)."""
    gen = torch.Generator().manual_seed(rows)
    chans = 300
    x = torch.randn(rows, chans + 7, generator=gen).to(dtype)[:, 3 : 3 + chans]
    shape = (chans,) if mixes is None else (mixes, 1, chans)
    mix = torch.rand(*shape, generator=gen).to(dtype)
    shift = torch.randn(rows + 2, chans, generator=gen).to(dtype)
    slots = torch.randperm(rows + 2, generator=gen)[:rows].to(torch.int32)
    if rows > 1:
        slots[1] = PAD_SLOT_ID
    want_shift = shift.clone()
    want = shift_mix_ref(x, want_shift, slots, mix)
    got = cpu_kernels.rwkv7_shift_mix(x, shift, slots, mix)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(shift, want_shift)


def test_rwkv7_shift_mix_float32_state_of_bfloat16_rows() -> None:
    """A float32 shift with bfloat16 rows: x' read rounded to x's dtype, x saved widened."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    mix = torch.rand(6, 1, 64, generator=gen).bfloat16()
    shift = torch.randn(4, 64, generator=gen)
    slots = torch.tensor([2, PAD_SLOT_ID, 0])
    want_shift = shift.clone()
    want = shift_mix_ref(x, want_shift, slots, mix)
    got = cpu_kernels.rwkv7_shift_mix(x, shift, slots, mix)
    torch.testing.assert_close(got, want, **BF16_TOL)
    assert torch.equal(shift, want_shift)


# --- RWKV-4 -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Case4:
    """w, u `(C,)`, k, v `(T, C)`, the states `(S, C)` float32 and the metadata."""

    w: torch.Tensor
    u: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num: torch.Tensor
    den: torch.Tensor
    mx: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor

    def states(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.num, self.den, self.mx

    def cloned_states(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.num.clone(), self.den.clone(), self.mx.clone()


def make4(
    lens: list[int],
    channels: int = 40,
    *,
    dtype: torch.dtype = torch.float32,
    pad: tuple[int, ...] = PAD,
    init: bool | None = None,
    k_scale: float = 1.0,
    seed: int = 0,
) -> Case4:
    """Random inputs; `k_scale` large makes exp(k) overflow float32 without the max
    stabilisation."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    qsl, slots, has_init, num_slots = _meta(lens, pad, init, gen)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return Case4(
        w=-torch.exp(randn(channels)),
        u=randn(channels).to(dtype),
        k=(randn(tokens, channels) * k_scale).to(dtype),
        v=randn(tokens, channels).to(dtype),
        num=randn(num_slots, channels),
        den=torch.rand(num_slots, channels, generator=gen) + 0.5,
        mx=randn(num_slots, channels) * 3,
        query_start_loc=qsl,
        state_indices=slots,
        has_initial_state=has_init,
    )


def check4_varlen(c: Case4) -> torch.Tensor:
    want_states = c.cloned_states()
    want = wkv4_varlen_ref(
        c.w, c.u, c.k, c.v, *want_states, c.query_start_loc, c.state_indices, c.has_initial_state
    )
    got = cpu_kernels.rwkv4_varlen(
        c.w, c.u, c.k, c.v, *c.states(), c.query_start_loc, c.state_indices, c.has_initial_state
    )
    assert got.dtype == c.v.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    for s, ws in zip(c.states(), want_states):
        torch.testing.assert_close(s, ws, **F32_TOL)
    return got


def check4_update(c: Case4) -> torch.Tensor:
    want_states = c.cloned_states()
    want = wkv4_update_ref(c.w, c.u, c.k, c.v, *want_states, c.state_indices)
    got = cpu_kernels.rwkv4_update(c.w, c.u, c.k, c.v, *c.states(), c.state_indices)
    assert got.dtype == c.v.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype))
    for s, ws in zip(c.states(), want_states):
        torch.testing.assert_close(s, ws, **F32_TOL)
    return got


# Channels: one AVX-512 vector, a tail, and more than one task's 64 channels with a tail.
CHANNELS = [16, 40, 150]


@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("init", [None, False, True])
def test_rwkv4_varlen(channels: int, dtype: torch.dtype, init: bool | None) -> None:
    c = make4(LENS, channels, dtype=dtype, init=init)
    before = c.cloned_states()
    check4_varlen(c)
    empty = c.state_indices[2].item()  # LENS[2] == 0: a fresh state without init
    if init is False:
        assert not c.num[empty].any() and not c.den[empty].any()
        assert (c.mx[empty] == MAX_INIT).all()
    used = torch.zeros(c.num.shape[0], dtype=torch.bool)
    used[c.state_indices[c.state_indices != PAD_SLOT_ID].long()] = True
    for s, b in zip(c.states(), before):
        assert torch.equal(s[~used], b[~used])


@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rwkv4_update(channels: int, dtype: torch.dtype) -> None:
    check4_update(make4([1] * 5, channels, dtype=dtype, pad=(0, 3)))


def test_rwkv4_large_k() -> None:
    """k up to about +-300: exp(k) overflows float32; the running maximum keeps it finite."""
    c = make4(LENS, 40, k_scale=100.0, init=True)
    out = check4_varlen(c)
    assert torch.isfinite(out).all()
    check4_update(make4([1] * 4, 40, k_scale=100.0, pad=(1,)))


def test_rwkv4_update_equals_varlen_and_cut() -> None:
    """Update == varlen of one-token sequences; a 70-token prefill cut at 29 and continued
    equals one call bit for bit (float32 states)."""
    c = make4([1] * 6, 40, pad=(2,), init=True)
    d = c.cloned_states()
    got = cpu_kernels.rwkv4_update(c.w, c.u, c.k, c.v, *c.states(), c.state_indices)
    want = cpu_kernels.rwkv4_varlen(
        c.w, c.u, c.k, c.v, *d, c.query_start_loc, c.state_indices, c.has_initial_state
    )
    assert torch.equal(got, want) and all(map(torch.equal, c.states(), d))
    c = make4([70], 150, pad=(), init=False, seed=2)
    one = c.cloned_states()
    want = cpu_kernels.rwkv4_varlen(
        c.w, c.u, c.k, c.v, *one, c.query_start_loc, c.state_indices, c.has_initial_state
    )
    outs = []
    for lo, hi, init in ((0, 29, False), (29, 70, True)):
        meta = (torch.tensor([0, hi - lo]), c.state_indices, torch.tensor([init]))
        outs.append(cpu_kernels.rwkv4_varlen(c.w, c.u, c.k[lo:hi], c.v[lo:hi], *c.states(), *meta))
    assert torch.equal(torch.cat(outs), want) and all(map(torch.equal, c.states(), one))


def test_rwkv4_non_float32_states_is_an_error() -> None:
    c = make4([1], 16, pad=(), init=True)
    with pytest.raises(RuntimeError, match="states must be float32"):
        cpu_kernels.rwkv4_update(c.w, c.u, c.k, c.v, c.num.bfloat16(), c.den, c.mx, c.state_indices)


def test_registered_for_cpp_backend() -> None:
    ops7, ops4 = family_ops(rwkv7.FAMILY, "cpp"), family_ops(rwkv4.FAMILY, "cpp")
    assert ops7.varlen is cpu_kernels.rwkv7_varlen and ops7.update is cpu_kernels.rwkv7_update
    assert ops7.shift_mix is cpu_kernels.rwkv7_shift_mix
    assert ops7.fused_update is cpu_kernels.rwkv7_fused_update
    assert ops4.varlen is cpu_kernels.rwkv4_varlen and ops4.update is cpu_kernels.rwkv4_update
