"""LFM2's fused short-conv block (`short_conv.decode_layer`: `csrc/fused_decode_short_conv.cpp`)
against its reference (`decode_layer_ref`, composed of the unfused path's ops), speculative
chains in one call against the rows one by one, and the engine with and without it.

Kernel cases: conv widths 3 (LFM2's `conv_L_cache`) and 4, biases or not, the block norm and
residual or the mixer alone, padding rows, 1-8 rows (weight-streaming) and 9 (GEMMs), float32
(tight) and bfloat16 weights, int8 and 4-bit weights in float32 and bfloat16 models, bfloat16
histories.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.ops.test_fused_decode import (
    DTYPES,
    SLOTS,
    TOL,
    _chain_slots,
    _indices,
    _model,
    _states,
    _tol,
    _w,
    _weight_dtypes,
)
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.layers.short_conv import FusedShortConvStep
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops import short_conv as sc

pytestmark = pytest.mark.skipif(
    "fused_short_conv_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

EPS = 1e-5


def _case(
    g: torch.Generator,
    hidden: int,
    channels: int,
    kernel: int,
    bias: bool,
    norm: bool,
    dtype: torch.dtype | str,
):  # noqa: ANN202
    params = {
        "norm_w": 1 + 0.1 * torch.randn(hidden, generator=g) if norm else None,
        "in_proj_w": _w(g, 3 * channels, hidden),
        "in_proj_b": _w(g, 3 * channels) if bias else None,
        "conv_w": _w(g, channels, kernel),
        "conv_b": _w(g, channels) if bias else None,
        "out_proj_w": _w(g, hidden, channels),
        "out_proj_b": _w(g, hidden) if bias else None,
    }  # fmt: skip
    _weight_dtypes(params, ("in_proj", "out_proj"), dtype)
    conv = torch.randn(SLOTS, channels, kernel - 1, generator=g).to(_states(dtype)[0])
    return list(sc.ShortConvParams(**params)), conv


# (hidden, channels, kernel, bias): LFM2-like (D = H, width 3), width 4, channels not a
# multiple of 16.
SHAPES = [(64, 64, 3, True), (96, 96, 4, False), (40, 72, 3, False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("batch", "pad", "norm"), [(1, False, True), (3, True, True),
                                                    (8, True, False), (9, True, True)])  # fmt: skip
def test_fused_short_conv_matches_reference(dtype, shape, batch, pad, norm) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(batch * 7 + shape[0])
    params, conv = _case(g, *shape, norm, dtype)
    x = torch.randn(batch, shape[0], generator=g).to(_model(dtype))
    idx = _indices(batch, pad)
    out = torch.float32 if norm else _model(dtype)
    conv_k, conv_r = conv.clone(), conv.clone()
    got = cpu_kernels.fused_short_conv_decode(x, params, conv_k, idx, EPS, out)
    want = sc.decode_layer_ref(x, params, conv_r, idx, EPS, out)
    assert got.dtype == want.dtype == out
    live = idx != PAD_SLOT_ID
    tol = _tol(dtype, batch)
    torch.testing.assert_close(got[live], want[live], **tol)
    torch.testing.assert_close(conv_k.float(), conv_r.float(), **tol)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[idx[live].long()] = False
    assert torch.equal(conv_k[untouched], conv[untouched]), "slots of no live row must not change"


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_short_conv_chains_equal_one_row_at_a_time(dtype: torch.dtype, long: bool) -> None:
    g = torch.Generator().manual_seed(5)
    params, conv = _case(g, *SHAPES[0], True, dtype)
    dst, src = _chain_slots(long)
    x = torch.randn(len(dst), SHAPES[0][0], generator=g)
    conv_k, conv_o = conv.clone(), conv.clone()
    got = cpu_kernels.fused_short_conv_decode(x, params, conv_k, dst, EPS, torch.float32, src)
    for b in range(len(dst)):  # one row per call, the source history copied in first
        conv_o[dst[b]] = conv_o[src[b]].clone()
        one = cpu_kernels.fused_short_conv_decode(
            x[b : b + 1], params, conv_o, dst[b : b + 1], EPS, torch.float32
        )
        assert torch.equal(one[0], got[b]), b
    assert torch.equal(conv_k, conv_o)
    conv_r = conv.clone()
    want = sc.decode_layer_ref(x, params, conv_r, dst, EPS, torch.float32, src)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(conv_k.float(), conv_r.float(), **TOL[dtype])


def _generate(model: str, quantization: str | None) -> tuple[list, list, int]:
    g = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 50000, (n,), generator=g).tolist()}
        for n in (5, 12, 3, 7, 20, 1, 9, 4, 15)
    ]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, logprobs=0) for i in range(9)]
    with VllmRunner(model, max_num_seqs=9, quantization=quantization) as runner:
        outs = [o.outputs[0] for o in runner.generate(prompts, params)]
        plans = [layer.decode_plan for layer in runner.engine.model.layers]
    fused = sum(p is not None and isinstance(p.step, FusedShortConvStep) for p in plans)
    logprobs = [[next(iter(d.values())).logprob for d in o.logprobs] for o in outs]
    return [o.token_ids for o in outs], logprobs, fused


@pytest.mark.parametrize(("name", "quantization"), [("lfm2-gqa", None), ("lfm2-gqa", "int4")])
def test_engine_outputs_equal_with_and_without_the_fused_block(
    name: str, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    model = tiny_model_dir(name)
    calls = {"n": 0}
    real = FusedShortConvStep.__call__

    def counting(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        return real(self, *args)

    monkeypatch.setattr(FusedShortConvStep, "__call__", counting)
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    want, want_lp, fused = _generate(model, quantization)
    assert fused == 0 and calls["n"] == 0
    monkeypatch.delenv("VLLM_MAMBA_FUSED_DECODE")
    got, got_lp, fused = _generate(model, quantization)
    assert fused > 0 and calls["n"] > 0, "the fused block did not run"
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["int8-float32", "int4-float32"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_fused_short_conv_with_integer_dots(dtype: str, batch: int) -> None:
    """`int_dot`: the int8 / 4-bit products on int8-quantised activations, as the reference's
    (`w8a8_linear_ref` / `w4a8_linear_ref`); FUSED_TOL as `test_int_dot_linear`'s."""
    from tests.ops.test_int_dot_linear import FUSED_TOL

    g = torch.Generator().manual_seed(batch)
    params, conv = _case(g, 64, 64, 3, True, True, dtype)
    x = torch.randn(batch, 64, generator=g)
    idx = _indices(batch, True)
    conv_k, conv_r = conv.clone(), conv.clone()
    got = cpu_kernels.fused_short_conv_decode(
        x, params, conv_k, idx, EPS, torch.float32, None, True
    )
    want = sc.decode_layer_ref(x, params, conv_r, idx, EPS, torch.float32, None, True)
    live = idx != PAD_SLOT_ID
    torch.testing.assert_close(got[live], want[live], **FUSED_TOL)
    plain = sc.decode_layer_ref(x, params, conv.clone(), idx, EPS, torch.float32)
    assert not torch.allclose(got[live], plain[live]), "integer dots change the result"
