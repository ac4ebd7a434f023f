"""The fused Gated DeltaNet decode layer (`fused_gdn_decode`) against its reference
(`ops.gated_delta.fused_gdn_decode_ref`, composed of the unfused path's reference ops).

Cases cover the layouts' input projections (Qwen3.5's four, Qwen3-Next's two, OLMo Hybrid's
six, one merged weight), value heads per key head 1, 2 and 3, odd head dims, conv widths 3 and
4, `beta_scale` 1 and 2, padding rows (`PAD_SLOT_ID`), the block norm and residual or the mixer
alone, float32 (1e-5) and bfloat16 weights, int8 and 4-bit weights in float32 and bfloat16
models (`quantize_int8` / `quantize_int4`, int8 where K is not a multiple of 32, as the
quantiser does), bfloat16 states, 1, 3 and 8 rows (weight-streaming products) and 9 (GEMMs),
and speculative chains (rows reading the slot an earlier row wrote) in one call, with and
without a chain log (`gdn_chain_replay` rebuilding each position's state from its records).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops import gated_delta as gd
from vllm_mamba.ops.int4_linear import int4_supported, quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8

pytestmark = pytest.mark.skipif(
    "fused_gdn_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

SLOTS = 13
INT8_F32, INT8_BF16 = "int8-float32", "int8-bfloat16"
INT4_F32, INT4_BF16 = "int4-float32", "int4-bfloat16"
STATE_BF16 = "float32-state-bfloat16"
DTYPES = [torch.float32, torch.bfloat16, INT8_F32, INT8_BF16, INT4_F32, INT4_BF16, STATE_BF16]
_MODEL = {INT8_F32: torch.float32, INT8_BF16: torch.bfloat16, INT4_F32: torch.float32}
_MODEL.update({INT4_BF16: torch.bfloat16, STATE_BF16: torch.float32})

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
# Above 8 rows bfloat16 weights multiply bfloat16-rounded activations in the kernel's GEMMs
# (where the CPU has bfloat16 instructions), as the unfused layer does; the reference keeps
# float32 activations (the Mamba2 kernel's bound, `tests/ops/test_fused_decode.py`).
GEMM_BF16_TOL = dict(rtol=2e-2, atol=8e-2)


def _model(dtype: torch.dtype | str) -> torch.dtype:
    """The model dtype (activations, conv states) of a case's weight dtype."""
    return _MODEL.get(dtype, dtype)


def _tol(dtype: torch.dtype | str, batch: int) -> dict[str, float]:
    if _model(dtype) == torch.float32 and dtype != STATE_BF16:
        return F32_TOL
    return GEMM_BF16_TOL if batch > 8 and dtype == torch.bfloat16 else BF16_TOL


def _weight(w: torch.Tensor, dtype: torch.dtype | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float32 weight as a case stores it, with its scale (None for a float weight)."""
    if dtype in (INT4_F32, INT4_BF16) and int4_supported(w):
        return quantize_int4(w)
    if dtype in (INT8_F32, INT8_BF16, INT4_F32, INT4_BF16):
        return quantize_int8(w)
    return w.to(_model(dtype)), None


# (hidden, Hk, Hv, Dk, Dv, K): Qwen3.5's tiny test shape (2 value heads per key head), the MQA
# variant's (Dk 8, Dv 24, conv 3), 3 value heads per key head, odd head dims.
SHAPES = [(64, 2, 4, 16, 16, 4), (64, 2, 2, 8, 24, 3), (64, 1, 3, 12, 20, 4), (40, 2, 2, 7, 9, 4)]
# How the [q | k | v | z | b | a] rows are split into input projections, by section.
LAYOUTS = {
    "qwen3_5": [[0, 1, 2], [3], [4], [5]],
    "qwen3_next": [[0, 1, 2, 3], [4, 5]],
    "olmo": [[0], [1], [2], [3], [4], [5]],
    "merged": [[0, 1, 2, 3, 4, 5]],
}


def _case(g, shape, layout, dtype, norm, beta_scale=1.0):  # noqa: ANN001, ANN202
    """The params list and the conv and recurrent states of a random layer."""
    hidden, hk, hv, dk, dv, kernel = shape
    sections = [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv]
    rows = torch.randn(sum(sections), hidden, generator=g) * hidden**-0.5
    parts = rows.split(sections)
    in_proj = [_weight(torch.cat([parts[i] for i in group]), dtype) for group in LAYOUTS[layout]]
    out_w, out_scale = _weight(torch.randn(hidden, hv * dv, generator=g) * (hv * dv) ** -0.5, dtype)
    cd = 2 * hk * dk + hv * dv
    fixed = gd.GdnDecodeParams(
        norm_w=(1 + 0.1 * torch.randn(hidden, generator=g)) if norm else None,
        conv_w=torch.randn(cd, kernel, generator=g) * 0.5,
        A_log=torch.rand(hv, generator=g) * 2 - 1,
        dt_bias=torch.randn(hv, generator=g) * 0.5,
        gate_norm_w=1 + 0.1 * torch.randn(dv, generator=g),
        out_proj_w=out_w,
        out_proj_scale=out_scale,
    )
    params = gd.gdn_decode_params(fixed, in_proj)
    state_bf16 = dtype == STATE_BF16
    conv = torch.randn(SLOTS, cd, kernel - 1, generator=g)
    conv = conv.to(torch.bfloat16 if state_bf16 else _model(dtype))
    rec = torch.randn(SLOTS, hv, dk, dv, generator=g) * 0.3
    rec = rec.to(torch.bfloat16 if state_bf16 else torch.float32)
    return params, conv, rec


def _indices(batch: int, pad: bool) -> torch.Tensor:
    """Distinct slots, the second row a padding row when `pad`."""
    idx = torch.tensor([7, 2, 9, 0, 5, 3, 8, 1, 4, 6, 12, 11][:batch], dtype=torch.int32)
    if pad and batch > 1:
        idx[1] = PAD_SLOT_ID
    return idx


def _check(run, ref, hidden, conv, rec, idx, tol, src=None) -> torch.Tensor:  # noqa: ANN001
    """Runs kernel and reference on copies of the states; compares outputs and states, and
    that slots no live row writes stay as they were. Returns the kernel's output."""
    conv_k, rec_k, conv_r, rec_r = conv.clone(), rec.clone(), conv.clone(), rec.clone()
    got = run(hidden, conv_k, rec_k, idx, src)
    want = ref(hidden, conv_r, rec_r, idx, src)
    assert got.dtype == want.dtype and got.shape == hidden.shape
    torch.testing.assert_close(got, want, **tol)  # padding rows: the residual (or zeros)
    torch.testing.assert_close(conv_k.float(), conv_r.float(), **tol)
    torch.testing.assert_close(rec_k.float(), rec_r.float(), **tol)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[idx[idx != PAD_SLOT_ID].long()] = False
    assert torch.equal(rec_k[untouched], rec[untouched]), "slots no live row writes must not change"
    assert torch.equal(conv_k[untouched], conv[untouched])
    return got


def _fns(params, args):  # noqa: ANN001, ANN202
    def run(h, c, s, i, src=None):  # noqa: ANN001, ANN202
        return cpu_kernels.fused_gdn_decode(h, params, c, s, i, *args, src)

    def ref(h, c, s, i, src=None):  # noqa: ANN001, ANN202
        return gd.fused_gdn_decode_ref(h, params, c, s, i, *args, src)

    return run, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "batch,pad,norm", [(1, False, True), (3, True, True), (8, True, False), (9, True, True)]
)
def test_fused_gdn_decode_matches_reference(dtype, layout, batch, pad, norm) -> None:  # noqa: ANN001
    shape = SHAPES[list(LAYOUTS).index(layout)]  # each layout on another shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, layout, batch)).encode()))
    beta_scale = 2.0 if layout == "olmo" else 1.0  # OLMo Hybrid's allow_neg_eigval
    params, conv, rec = _case(g, shape, layout, dtype, norm)
    x = torch.randn(batch, shape[0], generator=g)
    out_dtype = torch.float32 if norm else _model(dtype)
    run, ref = _fns(params, (1e-6, 1e-5, beta_scale, out_dtype))
    _check(run, ref, x, conv, rec, _indices(batch, pad), _tol(dtype, batch))


# Chains in waves (rows [a0, b0, plain, pad, a1, b1, a2]): a: 7 -> 10 -> 11 -> 7, b: 2 -> 12 ->
# 2; long: 11 rows, more than the small-batch layer's 8 (chains a, b, c of 3, two plain rows).
CHAINS = {
    "short": ([10, 12, 9, PAD_SLOT_ID, 11, 2, 7], [7, 2, 9, PAD_SLOT_ID, 10, 12, 11]),
    "long": ([1, 4, 7, 9, 10, 2, 5, 8, 0, 3, 6], [0, 3, 6, 9, 10, 1, 4, 7, 2, 5, 8]),
}


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, INT8_F32, INT4_F32, STATE_BF16])
def test_fused_gdn_chains_equal_one_row_at_a_time(chain: str, dtype: torch.dtype | str) -> None:
    """A chain in one call: each position's state in its own slot, bit for bit what the kernel
    gives running the rows one by one (after copying the source slot in), and close to the
    reference's chained rows."""
    g = torch.Generator().manual_seed(5)
    shape = SHAPES[0]
    params, conv, rec = _case(g, shape, "qwen3_5", dtype, True)
    run, ref = _fns(params, (1e-6, 1e-5, 1.0, torch.float32))
    x = torch.randn(len(CHAINS[chain][0]), shape[0], generator=g)
    check_chain(run, ref, x, conv, rec, chain, _tol(dtype, 1))


def check_chain(run, ref, x, conv, rec, chain: str, tol: dict) -> None:  # noqa: ANN001
    """Rows `x` as chain `chain` (`CHAINS`) in one call of `run`: close to `ref`'s chained rows,
    and bit for bit (outputs and states) `run` on one row at a time after copying the source
    slot in."""
    dst, src = (torch.tensor(t) for t in CHAINS[chain])
    got = _check(run, ref, x, conv, rec, dst, tol, src)
    conv_k, rec_k = conv.clone(), rec.clone()
    run(x, conv_k, rec_k, dst, src)
    conv_o, rec_o = conv.clone(), rec.clone()
    for b in range(len(dst)):  # one row per call, the source copied in first
        if dst[b] != PAD_SLOT_ID:
            conv_o[dst[b]], rec_o[dst[b]] = conv_o[src[b]].clone(), rec_o[src[b]].clone()
        one = run(x[b : b + 1], conv_o, rec_o, dst[b : b + 1])
        assert torch.equal(one[0], got[b]), b
    assert torch.equal(conv_k, conv_o) and torch.equal(rec_k, rec_o)


# The logged chains' shapes: heads of 16 x 16, 12 x 80 (a block of 4 vectors of value columns
# and more on AVX-512, `update_read`'s main loop) and 7 x 9 (part of a vector).
LOG_SHAPES = [SHAPES[0], (64, 1, 2, 12, 80, 4), SHAPES[3]]


@pytest.mark.parametrize("shape", LOG_SHAPES, ids=lambda s: f"{s[3]}x{s[4]}")
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, INT4_F32, STATE_BF16])
def test_logged_chains_replay_every_position_bit_for_bit(chain: str, dtype, shape) -> None:  # noqa: ANN001
    """With a chain log the kernel's outputs and conv histories are those of the chain without
    it, bit for bit; no position's recurrent state is written: the chain's source slot keeps
    its start state, its first spare slot gets a copy of it, its other slots stay as they
    were. Replaying the records of positions 0 to m - 1 (every m, the whole chain included)
    from the start, in place in the source slot or from the spare copy, gives bit for bit the
    state the kernel without a log leaves for position m - 1. The reference logs the same
    records (within the tolerance), leaves the same states and its replay agrees."""
    g = torch.Generator().manual_seed(11)
    params, conv, rec = _case(g, shape, "qwen3_5", dtype, True)
    args = (1e-6, 1e-5, 1.0, torch.float32)
    dst, src = (torch.tensor(t) for t in CHAINS[chain])
    x = torch.randn(len(dst), shape[0], generator=g)
    conv_f, rec_f = conv.clone(), rec.clone()
    want = cpu_kernels.fused_gdn_decode(x, params, conv_f, rec_f, dst, *args, src)
    conv_k, rec_k = conv.clone(), rec.clone()
    record = shape[3] + shape[4] + 1
    log = torch.zeros(SLOTS, shape[2], record)
    got = cpu_kernels.fused_gdn_decode(x, params, conv_k, rec_k, dst, *args, src, False, log)
    assert torch.equal(got, want) and torch.equal(conv_k, conv_f)
    chains = [c for c in gd.chain_rows(dst.tolist(), src.tolist()) if len(c) > 1]
    assert chains
    conv_r, rec_r, log_r = conv.clone(), rec.clone(), torch.zeros_like(log)
    ref = gd.fused_gdn_decode_ref(x, params, conv_r, rec_r, dst, *args, src, False, log_r)
    torch.testing.assert_close(got, ref, **_tol(dtype, 1))
    torch.testing.assert_close(rec_r.float(), rec_k.float(), **_tol(dtype, 1))
    for rows in chains:
        start, first = int(src[rows[0]]), int(dst[rows[0]])
        assert torch.equal(rec_k[start], rec[start]) and torch.equal(rec_k[first], rec[start])
        for b in rows[1:]:
            if int(dst[b]) != start:
                assert torch.equal(rec_k[dst[b]], rec[dst[b]]), "a position's state was written"
        assert torch.equal(rec_r[start], rec[start]) and torch.equal(rec_r[first], rec[start])
        for b in rows:
            torch.testing.assert_close(log_r[dst[b]], log[dst[b]], **_tol(dtype, 1))
        for m in range(1, len(rows) + 1):
            records = dst[rows[:m]][None]  # (1, m)
            expect = rec_f[dst[rows[m - 1]]]
            for origin in (start, first):  # in place, or from the spare copy
                for replay, states, records_log in (
                    (cpu_kernels.gdn_chain_replay, rec_k.clone(), log),
                    (gd.gdn_chain_replay_ref, rec_r.clone(), log_r),
                ):
                    replay(states, records_log, torch.tensor([origin]), records, src[rows[:1]])
                    if replay is cpu_kernels.gdn_chain_replay:
                        assert torch.equal(states[start], expect), (rows, m, origin)
                    else:
                        torch.testing.assert_close(
                            states[start].float(), expect.float(), **_tol(dtype, 1)
                        )


def test_int_dot_is_accepted_and_float_weights_ignore_it() -> None:
    g = torch.Generator().manual_seed(1)
    params, conv, rec = _case(g, SHAPES[0], "qwen3_5", torch.float32, True)
    x = torch.randn(2, SHAPES[0][0], generator=g)
    idx = _indices(2, False)
    args = (1e-6, 1e-5, 1.0, torch.float32)
    want = cpu_kernels.fused_gdn_decode(x, params, conv.clone(), rec.clone(), idx, *args)
    got = cpu_kernels.fused_gdn_decode(x, params, conv, rec, idx, *args, None, True)
    assert torch.equal(got, want)


def test_fused_gdn_decode_rejects_bad_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    shape = SHAPES[0]
    params, conv, rec = _case(g, shape, "qwen3_5", torch.float32, True)
    x = torch.randn(2, shape[0], generator=g)
    idx = _indices(2, False)
    args = (1e-6, 1e-5, 1.0, torch.float32)

    def call(p=params, c=conv, s=rec, h=x):  # noqa: ANN001, ANN202
        return cpu_kernels.fused_gdn_decode(h, p, c, s, idx, *args)

    fixed = len(gd.GDN_DECODE_PARAMS)
    with pytest.raises(RuntimeError, match="params must hold"):
        call(p=params[: fixed + 1])
    with pytest.raises(RuntimeError, match="rows together"):
        call(p=params[:-2])  # a missing projection (a)
    with pytest.raises(RuntimeError, match="input projection weight"):
        call(h=x[:, :32])
    with pytest.raises(RuntimeError, match="conv_states must have"):
        call(c=conv[:, :-3].contiguous())
    with pytest.raises(RuntimeError, match="multiple of the key heads"):
        # 3 value heads of 16 against 2 key heads of 16: CD = 64 + 48
        call(c=torch.zeros(SLOTS, 112, 3), s=torch.zeros(SLOTS, 3, 16, 16))
    int8, _ = quantize_int8(params[fixed])
    with pytest.raises(RuntimeError, match="input projection weight is int8"):
        call(p=[*params[:fixed], int8, None, *params[fixed + 2 :]])
    with pytest.raises(RuntimeError, match=r"state_indices\[1\] = 13 is neither"):
        cpu_kernels.fused_gdn_decode(x, params, conv, rec, torch.tensor([0, SLOTS]), *args)
    with pytest.raises(RuntimeError, match=r"src_state_indices\[0\] = -2"):
        cpu_kernels.fused_gdn_decode(x, params, conv, rec, idx, *args, torch.tensor([-2, 0]))
    with pytest.raises(RuntimeError, match="reads no slot"):
        cpu_kernels.fused_gdn_decode(x, params, conv, rec, idx, *args, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="A_log"):
        call(p=[*params[:2], None, *params[3:]])
    with pytest.raises(ValueError, match="1 to 8 projections"):
        gd.gdn_decode_params(gd.GdnDecodeParams(*params[:fixed]), [])
