"""The fused decode layers against their references, and the engine with and without them.

Kernel cases cover the shapes of the supported models' Mamba and Mamba2 layers (scaled down):
conv widths 3 and 4, time-step ranks, biases or not, FalconMamba's dt/B/C norms, Mamba2 group
counts 1, 2 and one per head, head dims and state sizes, padding rows (`PAD_SLOT_ID`), the
block norm and residual or the mixer alone, float32 (tight) and bfloat16 weights (tolerance),
int8 weights with per-row scales (`quantization="int8"`) and 4-bit weights with group scales
(`quantization="int4"`; weights whose K is not a multiple of 32 int8, as the quantiser does) in
float32 and bfloat16 models, against the reference run on the same quantised weights (tight
in float32).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.layers.fused_decode_layer import FusedMambaStep
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops import fused_decode as fd
from vllm_mamba.ops.int4_linear import int4_supported, quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8

pytestmark = pytest.mark.skipif(
    "fused_mamba_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

SLOTS = 13


def _w(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random weights: N(0, 1/fan_in) for matrices, N(0, 0.3^2) for vectors."""
    scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.3
    return torch.randn(*shape, generator=g) * scale


def _indices(batch: int, pad: bool) -> torch.Tensor:
    """Distinct slots, the second row a padding row when `pad`."""
    idx = torch.tensor([7, 2, 9, 0, 5, 3, 8, 1, 4, 6, 12, 11][:batch], dtype=torch.int32)
    if pad and batch > 1:
        idx[1] = PAD_SLOT_ID
    return idx


# A case's weight dtype: float32 or bfloat16, int8 or 4-bit weights in a float32 / bfloat16
# model, or float32 weights with bfloat16 conv and SSM states (`ssm_state_dtype="bfloat16"`).
INT8_F32, INT8_BF16 = "int8-float32", "int8-bfloat16"
INT4_F32, INT4_BF16 = "int4-float32", "int4-bfloat16"
STATE_BF16 = "float32-state-bfloat16"


def _model(dtype: torch.dtype | str) -> torch.dtype:
    """The model dtype (activations) of a case's weight dtype."""
    models = {INT8_F32: torch.float32, INT8_BF16: torch.bfloat16, STATE_BF16: torch.float32}
    models.update({INT4_F32: torch.float32, INT4_BF16: torch.bfloat16})
    return models.get(dtype, dtype)


def _states(dtype: torch.dtype | str) -> tuple[torch.dtype, torch.dtype]:
    """The conv and SSM state dtypes of a case."""
    if dtype == STATE_BF16:
        return torch.bfloat16, torch.bfloat16
    return _model(dtype), torch.float32


def _weight_dtypes(params, names, dtype, float_names=()) -> None:  # noqa: ANN001
    """Casts the projection weights `params[f"{n}_w"]` (n in `names`) to `dtype` in place, or
    quantises them to int8 or 4-bit (but `float_names`; 4-bit where K is a multiple of 32, else
    int8), and sets their scale entries `params[f"{n}_scale"]` (None for a float weight)."""
    for n in names:
        w, quantised = params[f"{n}_w"], n not in float_names
        if dtype in (INT4_F32, INT4_BF16) and quantised and int4_supported(w):
            params[f"{n}_w"], params[f"{n}_scale"] = quantize_int4(w)
        elif dtype in (INT8_F32, INT8_BF16, INT4_F32, INT4_BF16) and quantised:
            params[f"{n}_w"], params[f"{n}_scale"] = quantize_int8(w)
        else:
            params[f"{n}_w"], params[f"{n}_scale"] = w.to(_model(dtype)), None


def _mamba_case(g, hidden, inter, nstate, rank, kernel, bias, norm, dtype):  # noqa: ANN001, ANN202
    params = {
        "norm_w": 1 + 0.1 * torch.randn(hidden, generator=g) if norm else None,
        "in_proj_w": _w(g, 2 * inter, hidden),
        "in_proj_b": _w(g, 2 * inter) if bias else None,
        "conv_w": _w(g, inter, kernel),
        "conv_b": _w(g, inter) if bias else None,
        "x_proj_w": _w(g, rank + 2 * nstate, inter),
        "dt_proj_w": _w(g, inter, rank),
        "dt_proj_b": _w(g, inter) - 1.0,
        "A": -torch.exp(torch.rand(inter, nstate, generator=g) * 2),
        "D": torch.randn(inter, generator=g),
        "out_proj_w": _w(g, hidden, inter),
        "out_proj_b": _w(g, hidden) if bias else None,
    }
    # int8 models keep dt_proj float, as the quantiser does
    projections = ("in_proj", "x_proj", "dt_proj", "out_proj")
    _weight_dtypes(params, projections, dtype, float_names=("dt_proj",))
    conv = torch.randn(SLOTS, inter, kernel - 1, generator=g).to(_states(dtype)[0])
    ssm = torch.randn(SLOTS, inter, nstate, generator=g).to(_states(dtype)[1])
    return list(fd.MambaParams(**params)), conv, ssm


def _mamba2_case(g, hidden, heads, head_dim, groups, nstate, kernel, bias, norm, dtype):  # noqa: ANN001, ANN202
    inter = heads * head_dim
    cd = inter + 2 * groups * nstate
    params = {
        "norm_w": 1 + 0.1 * torch.randn(hidden, generator=g) if norm else None,
        "in_proj_w": _w(g, inter + cd + heads, hidden),
        "in_proj_b": _w(g, inter + cd + heads) if bias else None,
        "conv_w": _w(g, cd, kernel),
        "conv_b": _w(g, cd) if bias else None,
        "dt_bias": _w(g, heads) - 1.0,
        "A": -torch.exp(torch.rand(heads, generator=g) * 2),
        "D": torch.randn(heads, generator=g),
        "gate_norm_w": 1 + 0.1 * torch.randn(inter, generator=g),
        "out_proj_w": _w(g, hidden, inter),
        "out_proj_b": _w(g, hidden) if bias else None,
    }
    _weight_dtypes(params, ("in_proj", "out_proj"), dtype)
    conv = torch.randn(SLOTS, cd, kernel - 1, generator=g).to(_states(dtype)[0])
    ssm = torch.randn(SLOTS, heads, head_dim, nstate, generator=g).to(_states(dtype)[1])
    return list(fd.Mamba2Params(**params)), conv, ssm


def _check(run, ref, hidden, conv, ssm, idx, tol) -> None:  # noqa: ANN001
    """Runs kernel and reference on copies of the states; compares outputs and states."""
    conv_k, ssm_k, conv_r, ssm_r = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    got = run(hidden, conv_k, ssm_k, idx)
    want = ref(hidden, conv_r, ssm_r, idx)
    assert got.dtype == want.dtype
    live = idx != PAD_SLOT_ID
    torch.testing.assert_close(got[live], want[live], **tol)
    torch.testing.assert_close(conv_k.float(), conv_r.float(), **tol)
    torch.testing.assert_close(ssm_k, ssm_r, **tol)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[idx[live].long()] = False
    assert torch.equal(ssm_k[untouched], ssm[untouched]), "slots of no live row must not change"


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
TOL[INT8_F32], TOL[INT8_BF16] = TOL[torch.float32], TOL[torch.bfloat16]
TOL[INT4_F32], TOL[INT4_BF16] = TOL[torch.float32], TOL[torch.bfloat16]
TOL[STATE_BF16] = TOL[torch.bfloat16]
# Above 8 rows the kernels' GEMMs multiply bfloat16 weights by bfloat16-rounded activations, as
# the unfused layer does, while the references keep float32 activations: up to 0.056 apart on
# these shapes over 150 seeds (at most 8 rows: 1e-6).
GEMM_BF16_TOL = dict(rtol=2e-2, atol=8e-2)


def _tol(dtype: torch.dtype | str, batch: int) -> dict[str, float]:
    """The comparison tolerance of a case."""
    return GEMM_BF16_TOL if dtype == torch.bfloat16 and batch > 8 else TOL[dtype]


DTYPES = [torch.float32, torch.bfloat16, INT8_F32, INT8_BF16, INT4_F32, INT4_BF16, STATE_BF16]

# (hidden, inter, nstate, rank, kernel, bias, mixer_eps): mamba-130m-like, the tiny test models,
# FalconMamba (normed dt/B/C), a rank that is not a multiple of 16.
MAMBA_SHAPES = [
    (96, 192, 16, 6, 4, False, None),
    (48, 96, 16, 8, 3, True, None),
    (64, 128, 8, 4, 4, False, 1e-6),
    (40, 72, 16, 20, 4, True, 1e-3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MAMBA_SHAPES)
@pytest.mark.parametrize(
    "batch,pad,norm", [(1, False, True), (3, True, True), (8, True, False), (12, True, True)]
)
def test_fused_mamba_decode_matches_reference(dtype, shape, batch, pad, norm) -> None:  # noqa: ANN001
    hidden, inter, nstate, rank, kernel, bias, mixer_eps = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, batch)).encode()))
    params, conv, ssm = _mamba_case(g, hidden, inter, nstate, rank, kernel, bias, norm, dtype)
    x = torch.randn(batch, hidden, generator=g)
    eps = -1.0 if mixer_eps is None else mixer_eps
    out_dtype = torch.float32 if norm else _model(dtype)
    args = (1e-5, eps, out_dtype)

    def run(h, c, s, i):  # noqa: ANN001, ANN202
        return cpu_kernels.fused_mamba_decode(h, params, c, s, i, *args)

    def ref(h, c, s, i):  # noqa: ANN001, ANN202
        return fd.fused_mamba_decode_ref(h, params, c, s, i, *args)

    _check(run, ref, x, conv, ssm, _indices(batch, pad), _tol(dtype, batch))


# (hidden, heads, head_dim, groups, nstate, kernel, bias): mamba2-130m-like (one group,
# state 128), two groups, one group per head, the tiny test models.
MAMBA2_SHAPES = [
    (64, 4, 32, 1, 128, 4, False),
    (64, 8, 16, 2, 16, 4, False),
    (48, 6, 16, 6, 8, 4, True),
    (48, 3, 32, 1, 8, 3, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MAMBA2_SHAPES)
@pytest.mark.parametrize(  # rm: the block's residual multiplier (Granite 4.0-H's 0.22)
    "batch,pad,norm,rm",
    [(1, False, True, 1.0), (3, True, True, 0.22), (8, True, False, 1.0), (12, True, True, 0.22)],
)
def test_fused_mamba2_decode_matches_reference(dtype, shape, batch, pad, norm, rm) -> None:  # noqa: ANN001
    hidden, heads, head_dim, groups, nstate, kernel, bias = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, batch)).encode()) + 1)
    params, conv, ssm = _mamba2_case(
        g, hidden, heads, head_dim, groups, nstate, kernel, bias, norm, dtype
    )
    x = torch.randn(batch, hidden, generator=g)
    group_size = heads * head_dim // groups
    args = (groups, group_size, 1e-5, 1e-6, torch.float32 if norm else _model(dtype))
    scaled = {"residual_scale": rm} if rm != 1.0 else {}

    def run(h, c, s, i):  # noqa: ANN001, ANN202
        return cpu_kernels.fused_mamba2_decode(h, params, c, s, i, *args, **scaled)

    def ref(h, c, s, i):  # noqa: ANN001, ANN202
        return fd.fused_mamba2_decode_ref(h, params, c, s, i, *args, **scaled)

    _check(run, ref, x, conv, ssm, _indices(batch, pad), _tol(dtype, batch))


def test_fused_decode_rejects_bad_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    params, conv, ssm = _mamba2_case(g, 64, 4, 32, 1, 16, 4, False, True, torch.float32)
    x = torch.randn(2, 64, generator=g)
    idx = _indices(2, False)
    with pytest.raises(RuntimeError, match="n_groups"):
        cpu_kernels.fused_mamba2_decode(
            x, params, conv, ssm, idx, 3, 128, 1e-5, 1e-6, torch.float32
        )
    with pytest.raises(RuntimeError, match="in_proj weight"):
        cpu_kernels.fused_mamba2_decode(
            x[:, :32], params, conv, ssm, idx, 1, 128, 1e-5, 1e-6, torch.float32
        )
    mixer_alone = list(fd.Mamba2Params(*params)._replace(norm_w=None))
    with pytest.raises(RuntimeError, match="residual_scale needs the block norm"):
        cpu_kernels.fused_mamba2_decode(
            x, mixer_alone, conv, ssm, idx, 1, 128, 1e-5, 1e-6, torch.float32, residual_scale=0.5
        )
    named = fd.Mamba2Params(*params)
    int8, _ = quantize_int8(named.in_proj_w)
    unscaled = list(named._replace(in_proj_w=int8))  # an int8 weight without its scale
    with pytest.raises(RuntimeError, match="in_proj weight is int8"):
        cpu_kernels.fused_mamba2_decode(
            x, unscaled, conv, ssm, idx, 1, 128, 1e-5, 1e-6, torch.float32
        )
    # a float weight with a scale
    scaled = list(named._replace(in_proj_scale=torch.ones(named.in_proj_w.shape[0])))
    with pytest.raises(RuntimeError, match="has a scale"):
        cpu_kernels.fused_mamba2_decode(
            x, scaled, conv, ssm, idx, 1, 128, 1e-5, 1e-6, torch.float32
        )
    int4, scales = quantize_int4(named.in_proj_w)
    for bad_scales in (None, scales.float(), scales[:, :1].contiguous()):
        bad = list(named._replace(in_proj_w=int4, in_proj_scale=bad_scales))
        with pytest.raises(RuntimeError, match="in_proj weight is 4-bit"):
            cpu_kernels.fused_mamba2_decode(
                x, bad, conv, ssm, idx, 1, 128, 1e-5, 1e-6, torch.float32
            )


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the fused Mamba / Mamba2 steps that ran (`FusedMambaStep` calls)."""
    calls = {"fused": 0}
    real = FusedMambaStep.__call__

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["fused"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FusedMambaStep, "__call__", counting)
    return calls


def _generate(
    model: str, quantization: str | None, state_dtype: str
) -> tuple[list[list[int]], list[list[float]], dict[str, torch.Tensor | None] | None]:
    """Greedy tokens and logprobs of 9 prompts (decode batches of 9 and then fewer rows) and
    the first layer's fused parameters by name (None: unfused)."""
    g = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 50000, (n,), generator=g).tolist()}
        for n in (5, 12, 3, 7, 20, 1, 9, 4, 15)
    ]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, logprobs=0) for i in range(9)]
    kwargs = dict(max_num_seqs=9, quantization=quantization, ssm_state_dtype=state_dtype)
    with VllmRunner(model, **kwargs) as runner:
        outs = [o.outputs[0] for o in runner.generate(prompts, params)]
        plan = runner.engine.model.backbone.layers[0].decode_plan
    logprobs = [[next(iter(d.values())).logprob for d in o.logprobs] for o in outs]
    if plan is None:
        return [o.token_ids for o in outs], logprobs, None
    fields = fd.MAMBA2_PARAMS if "mamba2" in model else fd.MAMBA_PARAMS
    params = dict(zip(fields, plan.step.params, strict=True))
    if quantization == "int8":  # the fused layer runs on the int8 weights themselves
        assert params["in_proj_w"].dtype == torch.int8
    if quantization == "int4":  # on 4-bit weights (in_proj is int8 where K % 32 != 0)
        assert any(t is not None and t.dtype == torch.uint8 for t in params.values())
    return [o.token_ids for o in outs], logprobs, params


@pytest.mark.parametrize(
    "name,quantization,state_dtype",
    [
        ("tied", None, "auto"),
        ("falcon-untied", None, "auto"),
        ("mamba2-groups", None, "auto"),
        ("mamba2-tied", None, "auto"),
        ("tied", "int8", "auto"),
        ("mamba2-groups", "int8", "auto"),
        ("tied", "int4", "auto"),
        ("mamba2-groups", "int4", "auto"),
        ("falcon-untied", "int4", "auto"),
        ("tied", None, "bfloat16"),
        ("mamba2-groups", None, "bfloat16"),
    ],
)
def test_engine_outputs_equal_with_and_without_fused_decode(
    name: str,
    quantization: str | None,
    state_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
    fused_calls: dict[str, int],
) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    model = tiny_model_dir(name)
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    want, want_lp, planned = _generate(model, quantization, state_dtype)
    assert planned is None and fused_calls["fused"] == 0
    assert len({tuple(t) for t in want}) > 5, "reference generations should be varied"
    monkeypatch.delenv("VLLM_MAMBA_FUSED_DECODE")
    got, got_lp, planned = _generate(model, quantization, state_dtype)
    assert planned is not None and fused_calls["fused"] > 0, "the fused kernels did not run"
    assert got == want
    # bfloat16 states round the same values at slightly different points in the two paths
    atol = 1e-4 if state_dtype == "auto" else 1e-3
    for a, b in zip(got_lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


def _chain_slots(long: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of chains and plain rows, in waves: position w of a chain writes its own slot and
    reads the slot the position before wrote (speculative decoding). Short: two chains (3 and 2
    positions) and a plain row; long: 11 rows, more than the small-batch layer's 8."""
    if not long:  # rows [a0, b0, plain, a1, b1, a2]; a: 7 -> 10 -> 11 -> 7, b: 2 -> 12 -> 2
        return torch.tensor([10, 12, 9, 11, 2, 7]), torch.tensor([7, 2, 9, 10, 12, 11])
    # chains a: 0 -> 1 -> 2 -> 0, b: 3 -> 4 -> 5 -> 3, c: 6 -> 7 -> 8 -> 6; plain 9 and 10
    dst = [1, 4, 7, 9, 10, 2, 5, 8, 0, 3, 6]
    src = [0, 3, 6, 9, 10, 1, 4, 7, 2, 5, 8]
    return torch.tensor(dst), torch.tensor(src)


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, STATE_BF16])
@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_fused_chains_equal_one_row_at_a_time(
    family: str, dtype: torch.dtype | str, long: bool
) -> None:
    """A chain in one call: each position's state in its own slot, bit for bit what the
    kernel gives running the rows one by one (after copying the source slot in), and close to
    the reference's chained rows."""
    g = torch.Generator().manual_seed(3)
    if family == "mamba":
        shape = MAMBA_SHAPES[0]
        params, conv, ssm = _mamba_case(g, *shape[:6], True, dtype)
        hidden = shape[0]
        eps = -1.0 if shape[6] is None else shape[6]

        def run(h, c, s, i, src=None):  # noqa: ANN001, ANN202
            return cpu_kernels.fused_mamba_decode(h, params, c, s, i, 1e-5, eps, torch.float32, src)

        def ref(h, c, s, i, src=None):  # noqa: ANN001, ANN202
            return fd.fused_mamba_decode_ref(h, params, c, s, i, 1e-5, eps, torch.float32, src)
    else:
        shape = MAMBA2_SHAPES[1]
        params, conv, ssm = _mamba2_case(g, *shape, True, dtype)
        hidden, heads, head_dim, groups = shape[:4]
        args = (groups, heads * head_dim // groups, 1e-5, 1e-6, torch.float32)

        def run(h, c, s, i, src=None):  # noqa: ANN001, ANN202
            return cpu_kernels.fused_mamba2_decode(h, params, c, s, i, *args, src)

        def ref(h, c, s, i, src=None):  # noqa: ANN001, ANN202
            return fd.fused_mamba2_decode_ref(h, params, c, s, i, *args, src)

    dst, src = _chain_slots(long)
    x = torch.randn(len(dst), hidden, generator=g)
    conv_k, ssm_k, conv_o, ssm_o = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    got = run(x, conv_k, ssm_k, dst, src)
    for b in range(len(dst)):  # one row per call, the source copied in first
        conv_o[dst[b]], ssm_o[dst[b]] = conv_o[src[b]].clone(), ssm_o[src[b]].clone()
        one = run(x[b : b + 1], conv_o, ssm_o, dst[b : b + 1])
        assert torch.equal(one[0], got[b]), b
    assert torch.equal(conv_k, conv_o) and torch.equal(ssm_k, ssm_o)
    conv_r, ssm_r = conv.clone(), ssm.clone()
    want = ref(x, conv_r, ssm_r, dst, src)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ssm_k.float(), ssm_r.float(), **tol)
