"""The fused attention block (`paged_attention.decode_layer`: `csrc/fused_decode_attention.cpp`)
against its reference (`decode_layer_ref`, composed of the unfused path's ops), and the engine
with and without it.

Kernel cases: GQA and MQA, Qwen3.5's output gate and per-head q/k norms with partial RoPE,
LFM2's full RoPE, no RoPE, a key multiplier, biases, the block norm and residual or the mixer
alone, 1-8 rows (weight-streaming) and 9 (GEMMs), two rows of one sequence (a speculative
chain: the second attends to the first's key), padding rows, sliding windows; float32 (tight)
and bfloat16 weights and caches, int8 and 4-bit weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.ops.test_fused_decode import _model, _tol, _w, _weight_dtypes
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.layers.self_attention import FusedAttentionStep
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops import paged_attention as pa
from vllm_mamba.ops.rotary_embedding import rotary_cos_sin_cache

pytestmark = pytest.mark.skipif(
    "fused_attention_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

DTYPES = [torch.float32, torch.bfloat16, "int8-float32", "int4-bfloat16"]
BLOCK, BLOCKS = 4, 40

# (hidden, heads, kv heads, head dim, rotated dims (0: no RoPE), gate, q/k norms, bias, key mult,
# the block's residual multiplier)
SHAPES = [
    (64, 4, 2, 32, 8, True, True, False, 1.0, 1.0),  # Qwen3.5: gated, q/k norms, partial RoPE
    (96, 6, 2, 16, 16, False, True, False, 1.0, 1.0),  # LFM2: q/k norms, full RoPE
    # MQA without RoPE, biases, key multiplier; a residual multiplier (Granite 4.0-H's 0.22)
    (64, 4, 1, 32, 0, False, False, True, 0.5, 0.22),
]


def _case(g: torch.Generator, shape: tuple, norm: bool, dtype: torch.dtype | str):  # noqa: ANN202
    hidden, heads, kv, dim, _, gate, qk, bias, _, _ = shape
    nq = heads * dim * (2 if gate else 1)
    params = {
        "norm_w": 1 + 0.1 * torch.randn(hidden, generator=g) if norm else None,
        "q_proj_w": _w(g, nq, hidden), "k_proj_w": _w(g, kv * dim, hidden),
        "v_proj_w": _w(g, kv * dim, hidden), "o_proj_w": _w(g, hidden, heads * dim),
        "q_proj_b": _w(g, nq) if bias else None, "k_proj_b": _w(g, kv * dim) if bias else None,
        "v_proj_b": _w(g, kv * dim) if bias else None, "o_proj_b": _w(g, hidden) if bias else None,
        "q_norm_w": 1 + 0.1 * torch.randn(dim, generator=g) if qk else None,
        "k_norm_w": 1 + 0.1 * torch.randn(dim, generator=g) if qk else None,
    }  # fmt: skip
    _weight_dtypes(params, ("q_proj", "k_proj", "v_proj", "o_proj"), dtype)
    cache = _model(dtype)
    k_cache = torch.randn(BLOCKS, BLOCK, kv, dim, generator=g).to(cache)
    v_cache = torch.randn(BLOCKS, BLOCK, kv, dim, generator=g).to(cache)
    return list(pa.AttentionParams(**params)), k_cache, v_cache


def _rows(batch: int, chain: bool, pad: bool) -> tuple[torch.Tensor, ...]:
    """Block tables, seq_lens and slots of `batch` decode rows: distinct sequences of 1-13
    cached tokens (each its own blocks), or with `chain` the last row a second position of the
    first row's sequence; with `pad` the second row a padding row (seq_len 0, slot -1)."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 14, (batch,), generator=g)
    tables = torch.arange(batch * 4, dtype=torch.int32).view(batch, 4)
    if chain and batch > 1:
        tables[-1], lens[-1] = tables[0], lens[0] + 1
    pos = lens - 1
    slots = tables.gather(1, (pos // BLOCK).view(-1, 1)).view(-1).long() * BLOCK + pos % BLOCK
    if pad and batch > 2:
        lens[1], slots[1] = 0, -1
    return tables, lens.int(), slots, pos.clamp(min=0)


ROWS = [(1, True, False), (3, True, True), (8, False, True), (9, True, False)]


WINDOWED = [(torch.float32, 3, 1), (torch.float32, 9, 5), (torch.bfloat16, 3, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("batch", "norm", "chain"), ROWS)
def test_fused_attention_matches_reference(dtype, shape, batch, norm, chain) -> None:  # noqa: ANN001
    _check_against_reference(dtype, shape, batch, norm, chain)


@pytest.mark.parametrize(("dtype", "batch", "window"), WINDOWED)
def test_fused_attention_with_a_sliding_window(dtype, batch: int, window: int) -> None:  # noqa: ANN001
    """Windows of 1 to 5 tokens over contexts of 1 to 13 (a chain's second row included)."""
    _check_against_reference(dtype, SHAPES[0], batch, True, True, window)


def _check_against_reference(dtype, shape, batch, norm, chain, window: int = 0) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(batch + shape[0])
    params, k_cache, v_cache = _case(g, shape, norm, dtype)
    hidden, heads, kv, dim, rot, gate, _, _, key_mult, rm = shape
    tables, lens, slots, pos = _rows(batch, chain, pad=True)
    table = rotary_cos_sin_cache(1e4 ** -(torch.arange(0, rot, 2) / rot), 32, 1.0) if rot else None
    rows = pos if rot else None
    x = torch.randn(batch, hidden, generator=g).to(_model(dtype))
    out = torch.float32 if norm else _model(dtype)
    args = (tables, lens, table, rows, heads, kv, dim, gate, dim**-0.5, key_mult, 1e-6, 1e-6, out)
    kk, vk, kr, vr = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    windowed = {"sliding_window": window} if window else {}
    if norm and rm != 1.0:  # the block's residual scaled (the kernel refuses it without a norm)
        windowed["residual_scale"] = rm
    got = cpu_kernels.fused_attention_decode(x, params, kk, vk, slots, *args, **windowed)
    want = pa.decode_layer_ref(x, params, kr, vr, slots, *args, **windowed)
    assert got.dtype == want.dtype == out
    live = lens > 0
    tol = _tol(dtype, batch)
    torch.testing.assert_close(got[live], want[live], **tol)
    torch.testing.assert_close(kk.float(), kr.float(), **tol)
    torch.testing.assert_close(vk.float(), vr.float(), **tol)
    written = torch.zeros(BLOCKS * BLOCK, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(kk.view(-1, kv, dim)[~written], k_cache.view(-1, kv, dim)[~written])


def test_fused_attention_rejects_bad_arguments() -> None:
    g = torch.Generator().manual_seed(0)
    params, k_cache, v_cache = _case(g, SHAPES[0], True, torch.float32)
    tables, lens, slots, pos = _rows(2, False, pad=False)
    x = torch.randn(2, 64)
    table = torch.zeros(32, 8)
    base = (x, params, k_cache, v_cache, slots, tables, lens)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        cpu_kernels.fused_attention_decode(*base, table, pos, 3, 2, 32, True, 1.0, 1.0, 1e-6,
                                           1e-6, torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.fused_attention_decode(*base, table, pos + 40, 4, 2, 32, True, 1.0, 1.0,
                                           1e-6, 1e-6, torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match="q_proj weight"):
        cpu_kernels.fused_attention_decode(*base, table, pos, 4, 2, 16, True, 1.0, 1.0, 1e-6,
                                           1e-6, torch.float32)  # fmt: skip


def _generate(model: str, quantization: str | None) -> tuple[list, list]:
    g = torch.Generator().manual_seed(4)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 50000, (n,), generator=g).tolist()}
        for n in (5, 12, 3, 7, 20, 1, 9)
    ]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, logprobs=0) for i in range(7)]
    with VllmRunner(model, max_num_seqs=7, quantization=quantization) as runner:
        outs = [o.outputs[0] for o in runner.generate(prompts, params)]
    logprobs = [[next(iter(d.values())).logprob for d in o.logprobs] for o in outs]
    return [o.token_ids for o in outs], logprobs


@pytest.mark.parametrize(("name", "quantization"), [("qwen3_5-gqa", None), ("lfm2-gqa", "int8"),
                                                    ("granite-moe-rope", None)])  # fmt: skip
def test_engine_outputs_equal_with_and_without_the_fused_attention(
    name: str, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    calls = {"n": 0}
    real = FusedAttentionStep.__call__

    def counting(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        return real(self, *args)

    monkeypatch.setattr(FusedAttentionStep, "__call__", counting)
    model = tiny_model_dir(name)
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    want, want_lp = _generate(model, quantization)
    assert calls["n"] == 0
    monkeypatch.delenv("VLLM_MAMBA_FUSED_DECODE")
    got, got_lp = _generate(model, quantization)
    assert calls["n"] > 0, "the fused attention did not run"
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["int8-float32", "int4-float32"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_fused_attention_with_integer_dots(dtype: str, batch: int) -> None:
    """`int_dot`: the int8 / 4-bit products on int8-quantised activations, as the reference's
    (`w8a8_linear_ref` / `w4a8_linear_ref`); FUSED_TOL as `test_int_dot_linear`'s."""
    from tests.ops.test_int_dot_linear import FUSED_TOL

    g = torch.Generator().manual_seed(batch)
    shape = SHAPES[0]
    params, k_cache, v_cache = _case(g, shape, True, dtype)
    hidden, heads, kv, dim, rot, gate, _, _, key_mult, rm = shape
    tables, lens, slots, pos = _rows(batch, True, pad=False)
    table = rotary_cos_sin_cache(1e4 ** -(torch.arange(0, rot, 2) / rot), 32, 1.0)
    x = torch.randn(batch, hidden, generator=g)
    args = (tables, lens, table, pos, heads, kv, dim, gate, dim**-0.5, key_mult, 1e-6, 1e-6)
    run = (x, params, k_cache.clone(), v_cache.clone(), slots, *args, torch.float32)
    got = cpu_kernels.fused_attention_decode(*run, True)
    want = pa.decode_layer_ref(x, params, k_cache.clone(), v_cache.clone(), slots, *args,
                               torch.float32, True)  # fmt: skip
    torch.testing.assert_close(got, want, **FUSED_TOL)
    plain = pa.decode_layer_ref(x, params, k_cache.clone(), v_cache.clone(), slots, *args,
                                torch.float32)  # fmt: skip
    assert not torch.allclose(got, plain), "integer dots change the result"
