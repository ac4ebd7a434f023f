"""The fused Kimi Delta Attention decode layer (`fused_kda_decode`) against its reference
(`ops.kda.fused_kda_decode_ref`, composed of the unfused path's reference ops).

Cases cover Kimi's layout (six first-stage projections `[q | k | v | f_a | g_a | b]`) and one
merged weight, value heads per key head 1 and 2, odd head dims and ranks, conv widths 3 and 4,
padding rows (`PAD_SLOT_ID`), the block norm and residual or the mixer alone, float32 (1e-5)
and bfloat16 weights, int8 and 4-bit weights in float32 and bfloat16 models, integer dot
products (w8a8 / w4a8), bfloat16 states, 1, 3 and 8 rows (weight-streaming products) and 9
(GEMMs), speculative chains in one call, bit for bit the rows decoded one by one, both
forget gates (Kimi's softplus gate, `lower_bound` 0, and the safe gate, `lower_bound` -5) and
both kinds of gate projections: Kimi's two-stage low-rank gates (`f_b(f_a)`, `g_b(g_a)`) and
Ling 3's single-stage full-rank ones (`[q | k | v | a | gate | b]`, no second stages). The
weights, tolerances, slots and chains are those of the GDN kernel's tests
(`tests/ops/test_fused_gdn_decode.py`).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.ops.test_fused_gdn_decode import (
    CHAINS,
    DTYPES,
    INT4_F32,
    INT8_F32,
    SLOTS,
    STATE_BF16,
    _check,
    _indices,
    _model,
    _tol,
    _weight,
    check_chain,
)
from vllm_mamba.ops import cpu_kernels, kda
from vllm_mamba.ops.gated_delta import gdn_decode_params
from vllm_mamba.ops.int8_linear import quantize_int8

pytestmark = pytest.mark.skipif(
    "fused_kda_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

# (hidden, Hk, Hv, Dk, Dv, R, K): Kimi's shape (Hk = Hv, Dk = Dv = R; every K a multiple of
# 32 for the 4-bit and integer-dot cases), 2 value heads per key head with Dk != Dv, odd dims.
SHAPES = [(64, 2, 2, 32, 32, 32, 4), (48, 1, 2, 16, 24, 16, 3), (40, 2, 2, 7, 9, 5, 4)]
# How the [q | k | v | f_a | g_a | b] rows are split into input projections, by section.
LAYOUTS = {"kimi": [[0], [1], [2], [3], [4], [5]], "merged": [[0, 1, 2, 3, 4, 5]]}
INT_DOT_TOL = dict(rtol=2e-3, atol=2e-3)
# The gates' projections: Kimi's two stages (low rank R), or one (Ling 3's full rank: the
# first stage's f and g outputs are the forget gate's input and the output gate).
TWO_STAGE, SINGLE_STAGE = "two-stage", "single-stage"
# (gate projections, lower_bound): Kimi's softplus gate, the safe gate, and the safe gate on
# single-stage gates (Ling 3's; its softplus variant in the integer-dot cases).
GATES = [(TWO_STAGE, 0.0), (TWO_STAGE, -5.0), (SINGLE_STAGE, -5.0)]


def _case(g, shape, layout, dtype, norm, gates=TWO_STAGE):  # noqa: ANN001, ANN202
    """The params list and the conv and recurrent states of a random layer."""
    hidden, hk, hv, dk, dv, rank, kernel = shape
    widths = [rank, rank] if gates == TWO_STAGE else [hv * dk, hv * dv]  # f, g
    sections = [hk * dk, hk * dk, hv * dv, *widths, hv]
    rows = torch.randn(sum(sections), hidden, generator=g) * hidden**-0.5
    parts = rows.split(sections)
    in_proj = [_weight(torch.cat([parts[i] for i in group]), dtype) for group in LAYOUTS[layout]]
    out_w, out_scale = _weight(torch.randn(hidden, hv * dv, generator=g) * (hv * dv) ** -0.5, dtype)
    f_b = f_b_scale = g_b = g_b_scale = None
    if gates == TWO_STAGE:
        f_b, f_b_scale = _weight(torch.randn(hv * dk, rank, generator=g) * rank**-0.5, dtype)
        g_b, g_b_scale = _weight(torch.randn(hv * dv, rank, generator=g) * rank**-0.5, dtype)
    cd = 2 * hk * dk + hv * dv
    fixed = kda.KdaDecodeParams(
        norm_w=(1 + 0.1 * torch.randn(hidden, generator=g)) if norm else None,
        conv_w=torch.randn(cd, kernel, generator=g) * 0.5,
        A_log=torch.rand(hv, generator=g) * 2 - 1,
        dt_bias=torch.randn(hv * dk, generator=g) * 0.5,
        gate_norm_w=1 + 0.1 * torch.randn(dv, generator=g),
        out_proj_w=out_w, out_proj_scale=out_scale,
        f_b_w=f_b, f_b_scale=f_b_scale, g_b_w=g_b, g_b_scale=g_b_scale,
    )  # fmt: skip
    params = gdn_decode_params(fixed, in_proj)
    state_bf16 = dtype == STATE_BF16
    conv = torch.randn(SLOTS, cd, kernel - 1, generator=g)
    conv = conv.to(torch.bfloat16 if state_bf16 else _model(dtype))
    rec = torch.randn(SLOTS, hv, dk, dv, generator=g) * 0.3
    rec = rec.to(torch.bfloat16 if state_bf16 else torch.float32)
    return params, conv, rec


def _fns(params, args, int_dot=False, lower_bound=0.0):  # noqa: ANN001, ANN202
    def run(h, c, s, i, src=None):  # noqa: ANN001, ANN202
        return cpu_kernels.fused_kda_decode(
            h, params, c, s, i, *args, src, int_dot, lower_bound=lower_bound
        )

    def ref(h, c, s, i, src=None):  # noqa: ANN001, ANN202
        return kda.fused_kda_decode_ref(
            h, params, c, s, i, *args, src, int_dot, lower_bound=lower_bound
        )

    return run, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize(
    "batch,pad,norm", [(1, False, True), (3, True, True), (8, True, False), (9, True, True)]
)
@pytest.mark.parametrize("gates,lower_bound", GATES)
def test_fused_kda_decode_matches_reference(
    dtype: torch.dtype | str, shape: int, batch: int, pad: bool, norm: bool, gates: str,
    lower_bound: float,
) -> None:  # fmt: skip
    layout = list(LAYOUTS)[(shape + batch) % len(LAYOUTS)]
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, layout, batch, dtype)).encode()))
    params, conv, rec = _case(g, SHAPES[shape], layout, dtype, norm, gates)
    x = torch.randn(batch, SHAPES[shape][0], generator=g)
    out_dtype = torch.float32 if norm else _model(dtype)
    run, ref = _fns(params, (1e-5, 1e-5, out_dtype), lower_bound=lower_bound)
    _check(run, ref, x, conv, rec, _indices(batch, pad), _tol(dtype, batch))


@pytest.mark.parametrize("dtype", [INT8_F32, INT4_F32])
@pytest.mark.parametrize("batch", [1, 3, 9])
@pytest.mark.parametrize("gates", [TWO_STAGE, SINGLE_STAGE])
def test_int_dot_matches_reference(dtype: str, batch: int, gates: str) -> None:
    """w8a8 / w4a8: every projection (each K a multiple of 32) multiplies int8-quantised
    activations, as the reference's `w8a8_linear_ref` / `w4a8_linear_ref` do."""
    g = torch.Generator().manual_seed(batch)
    params, conv, rec = _case(g, SHAPES[0], "kimi", dtype, True, gates)
    x = torch.randn(batch, SHAPES[0][0], generator=g)
    run, ref = _fns(params, (1e-5, 1e-5, torch.float32), int_dot=True)
    _check(run, ref, x, conv, rec, _indices(batch, True), INT_DOT_TOL)


def test_strong_gates_past_the_softplus_threshold() -> None:
    """Forget-gate inputs above softplus's threshold (20: softplus(x) = x) on every other channel
    and near-total decays there (A_log 1.5), weak ones on the other head: as the reference."""
    g = torch.Generator().manual_seed(11)
    params, conv, rec = _case(g, SHAPES[0], "kimi", torch.float32, True)
    fields = list(kda.KDA_DECODE_PARAMS)
    dt_bias = params[fields.index("dt_bias")]
    dt_bias[::2] += 25.0
    params[fields.index("A_log")][:] = torch.tensor([1.5, -3.0])
    x = torch.randn(3, SHAPES[0][0], generator=g)
    run, ref = _fns(params, (1e-5, 1e-5, torch.float32))
    _check(run, ref, x, conv, rec, _indices(3, False), _tol(torch.float32, 3))


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, INT8_F32, INT4_F32, STATE_BF16])
@pytest.mark.parametrize("gates,lower_bound", GATES)
def test_fused_kda_chains_equal_one_row_at_a_time(
    chain: str, dtype: torch.dtype | str, gates: str, lower_bound: float
) -> None:
    """A chain in one call: each position's state in its own slot, bit for bit what the kernel
    gives running the rows one by one (after copying the source slot in), and close to the
    reference's chained rows."""
    g = torch.Generator().manual_seed(5)
    params, conv, rec = _case(g, SHAPES[0], "kimi", dtype, True, gates)
    run, ref = _fns(params, (1e-5, 1e-5, torch.float32), lower_bound=lower_bound)
    x = torch.randn(len(CHAINS[chain][0]), SHAPES[0][0], generator=g)
    check_chain(run, ref, x, conv, rec, chain, _tol(dtype, 1))


def test_fused_kda_decode_rejects_bad_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    shape = SHAPES[0]
    params, conv, rec = _case(g, shape, "kimi", torch.float32, True)
    x = torch.randn(2, shape[0], generator=g)
    idx = _indices(2, False)
    args = (1e-5, 1e-5, torch.float32)

    def call(p=params, c=conv, s=rec, h=x):  # noqa: ANN001, ANN202
        return cpu_kernels.fused_kda_decode(h, p, c, s, idx, *args)

    fixed, fields = len(kda.KDA_DECODE_PARAMS), list(kda.KDA_DECODE_PARAMS)
    with pytest.raises(RuntimeError, match="params must hold"):
        call(p=params[: fixed + 1])
    with pytest.raises(RuntimeError, match="f_b_proj weight"):
        call(p=params[:-2])  # b missing: the rank no longer matches f_b's columns
    with pytest.raises(RuntimeError, match="input projection weight"):
        call(h=x[:, :32])
    with pytest.raises(RuntimeError, match="conv_states must have"):
        call(c=conv[:, :-3].contiguous())
    with pytest.raises(RuntimeError, match="dt_bias"):
        call(p=[*params[:3], params[3][:-1].clone(), *params[4:]])
    int8, _ = quantize_int8(params[fixed])
    with pytest.raises(RuntimeError, match="input projection weight is int8"):
        call(p=[*params[:fixed], int8, None, *params[fixed + 2 :]])
    with pytest.raises(RuntimeError, match=r"state_indices\[1\] = 13 is neither"):
        cpu_kernels.fused_kda_decode(x, params, conv, rec, torch.tensor([0, SLOTS]), *args)
    with pytest.raises(RuntimeError, match=r"src_state_indices\[0\] = -2"):
        cpu_kernels.fused_kda_decode(x, params, conv, rec, idx, *args, torch.tensor([-2, 0]))
    for fn in (cpu_kernels.fused_kda_decode, kda.fused_kda_decode_ref):
        with pytest.raises(ValueError, match="lower_bound"):
            fn(x, params, conv, rec, idx, *args, lower_bound=0.5)
    # single-stage gates: f_b and g_b both absent, with their scales, and full-rank f and g
    single, _, _ = _case(g, shape, "kimi", torch.float32, True, SINGLE_STAGE)
    f_b = fields.index("f_b_w")
    one_stage_f = [*params[:f_b], None, *params[f_b + 1 :]]
    with pytest.raises(RuntimeError, match="both be None"):
        call(p=one_stage_f)
    with pytest.raises(ValueError, match="both be None"):
        kda.fused_kda_decode_ref(x, one_stage_f, conv, rec, idx, *args)
    with pytest.raises(RuntimeError, match="take no f_b / g_b scales"):
        call(p=[*single[: f_b + 1], torch.ones(1), *single[f_b + 2 :]])
    with pytest.raises(RuntimeError, match="with single-stage gates the input projections"):
        call(p=[*params[:f_b], None, None, None, None, *params[f_b + 4 :]])  # low-rank f, g
