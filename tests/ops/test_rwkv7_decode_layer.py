"""The fused RWKV-7 decode layer (`csrc/fused_decode_rwkv7.cpp`) against its reference
(`ops.rwkv7.decode_layer_ref`), and the engine's fused decode steps against its unfused ones.

The kernel runs at the best CPU level here; `test_cpu_isa_levels` runs the whole kernel suite
at every level."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_fused_gdn_decode import CHAINS  # (dst, src) layouts of chains in waves
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.layers.rwkv7_decode import FusedRwkv7Step
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.rwkv7 import DecodeLayerParams, decode_layer_ref

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

SLOTS = 40


def layer_params(
    hidden: int, head_dim: int, ffn: int, first: bool, dtype: torch.dtype, int8: bool, seed: int
) -> list[torch.Tensor | None]:
    """Random `DecodeLayerParams` at the released models' scales (ranks 8 / 4 / 6 / 12)."""
    g = torch.Generator().manual_seed(seed)
    heads = hidden // head_dim

    def rnd(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    ranks = {"w": 8, "a": 4, "v": 6, "g": 12}
    p: dict[str, torch.Tensor | None] = {}
    for norm in ("pre", "attn", "ffn"):
        p[f"{norm}_w"], p[f"{norm}_b"] = rnd(hidden, std=0.1, mean=1), rnd(hidden, std=0.1)
    if not first:
        p["pre_w"] = p["pre_b"] = None
    p["mixes"] = torch.rand(6, 1, hidden, generator=g).to(dtype)
    p["cm_x_k"] = torch.rand(hidden, generator=g).to(dtype)
    shapes = {
        "r": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden),
        "o": (hidden, hidden), "key": (ffn, hidden), "value": (hidden, ffn),
    }  # fmt: skip
    for name, rank in ranks.items():
        shapes[f"{name}1"], shapes[f"{name}2"] = (rank, hidden), (hidden, rank)
    for name, (rows, cols) in shapes.items():
        w = rnd(rows, cols, std=cols**-0.5)
        p[f"{name}_w"], p[f"{name}_s"] = quantize_int8(w) if int8 else (w.to(dtype), None)
    for name in ("w2", "a2", "v2"):
        p[f"{name}_b"] = rnd(hidden, std=0.5)
    if first:
        p["v1_w"] = p["v1_s"] = p["v2_w"] = p["v2_s"] = p["v2_b"] = None
    p["k_k"] = rnd(hidden, std=0.1, mean=0.8).to(dtype)
    p["k_a"] = rnd(hidden, std=0.1, mean=1.0).to(dtype)
    p["r_k"] = rnd(heads, head_dim, std=0.3).to(dtype)
    p["gn_w"] = rnd(hidden, std=0.1, mean=1).to(dtype)
    p["gn_b"] = rnd(hidden, std=0.1).to(dtype)
    return list(DecodeLayerParams(**p))


def states(hidden: int, head_dim: int, dtype: torch.dtype, state_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    heads = hidden // head_dim
    tm = torch.randn(SLOTS, hidden, generator=g).to(dtype)
    wkv = (torch.randn(SLOTS, heads, head_dim, head_dim, generator=g) * 0.5).to(state_dtype)
    cm = torch.randn(SLOTS, hidden, generator=g).to(dtype)
    return tm, wkv, cm


CASES = [
    # (dtype, int8, state dtype, hidden, head_dim)
    (torch.float32, False, torch.float32, 128, 64),
    (torch.float32, False, torch.float32, 96, 32),
    (torch.float32, True, torch.float32, 128, 64),
    (torch.bfloat16, False, torch.float32, 128, 64),
    (torch.bfloat16, False, torch.bfloat16, 96, 32),
]


# Up to 8 rows the projections stream the weights; more run them as GEMMs.
ROWS = [[3], [0, 7, 2], [5, PAD_SLOT_ID, 1, 9, 4, 6, 8, 2], [*range(20, 31), PAD_SLOT_ID]]


@pytest.mark.parametrize("dtype,int8,state_dtype,hidden,head_dim", CASES)
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("slots", ROWS)
def test_decode_layer_matches_reference(dtype, int8, state_dtype, hidden, head_dim, first, slots):  # noqa: ANN001
    ffn = 2 * hidden + 32
    params = layer_params(hidden, head_dim, ffn, first, dtype, int8, seed=len(slots))
    g = torch.Generator().manual_seed(1)
    rows = len(slots)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    v_first = None if first else torch.randn(rows, hidden, generator=g).to(dtype)
    idx = torch.tensor(slots, dtype=torch.int32)
    ref_states = states(hidden, head_dim, dtype, state_dtype, seed=2)
    got_states = [s.clone() for s in ref_states]
    want_h, want_v = decode_layer_ref(x, params, *ref_states, idx, v_first, 1e-5, 64e-5)
    got_h, got_v = cpu_kernels.fused_rwkv7_decode(x, params, *got_states, idx, v_first, 1e-5, 64e-5)
    assert got_h.dtype == want_h.dtype == dtype and got_v.dtype == dtype
    # float32: orders of summation only. bfloat16: both round every intermediate to bfloat16,
    # so a value may land one ulp apart (2^-8 relative) and carry that through the next ops.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(got_h, want_h, **tol)
    torch.testing.assert_close(got_v, want_v, **tol)
    for got, want in zip(got_states, ref_states):
        torch.testing.assert_close(got, want, **tol)
    if dtype == torch.bfloat16:  # most values equal: the rounding points are the same
        close = (got_h.float() - want_h.float()).abs() <= 2**-7 * want_h.float().abs().clamp(min=1)
        assert close.float().mean() > 0.95


def test_padding_rows_touch_no_state() -> None:
    params = layer_params(128, 64, 288, False, torch.float32, False, seed=0)
    tm, wkv, cm = states(128, 64, torch.float32, torch.float32, seed=0)
    before = [s.clone() for s in (tm, wkv, cm)]
    x = torch.randn(2, 128)
    idx = torch.tensor([PAD_SLOT_ID, 4])
    cpu_kernels.fused_rwkv7_decode(x, params, tm, wkv, cm, idx, torch.randn(2, 128), 1e-5, 64e-5)
    for now, old in zip((tm, wkv, cm), before):
        changed = (now != old).flatten(1).any(1)
        assert changed.tolist() == [i == 4 for i in range(SLOTS)]


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize(
    "dtype,int8,state_dtype,hidden,head_dim", [CASES[0], CASES[2], CASES[4]], ids=str
)
@pytest.mark.parametrize("first", [True, False])
def test_chains_equal_one_row_at_a_time(chain, dtype, int8, state_dtype, hidden, head_dim, first):  # noqa: ANN001
    """A chain in one call (`src_state_indices`): each position's three states in its own slot
    and its output bit for bit what the kernel gives running the rows one by one after copying
    the source slot in, and close to the reference's chained rows."""
    params = layer_params(hidden, head_dim, 2 * hidden + 32, first, dtype, int8, seed=3)
    dst, src = (torch.tensor(t) for t in CHAINS[chain])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(len(dst), hidden, generator=g).to(dtype)
    v_first = None if first else torch.randn(len(dst), hidden, generator=g).to(dtype)
    start = states(hidden, head_dim, dtype, state_dtype, seed=6)
    got_states, ref_states, one_states = ([s.clone() for s in start] for _ in range(3))
    args = (1e-5, 64e-5)
    got_h, got_v = cpu_kernels.fused_rwkv7_decode(x, params, *got_states, dst, v_first, *args, src)
    want_h, want_v = decode_layer_ref(x, params, *ref_states, dst, v_first, *args, src)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(got_h, want_h, **tol)
    torch.testing.assert_close(got_v, want_v, **tol)
    for got, want in zip(got_states, ref_states):
        torch.testing.assert_close(got, want, **tol)
    for b in range(len(dst)):  # one row per call, the source slot copied in first
        if dst[b] != PAD_SLOT_ID:
            for state in one_states:
                state[dst[b]] = state[src[b]].clone()
        vf = None if first else v_first[b : b + 1]
        row, slot = x[b : b + 1], dst[b : b + 1]
        h, v = cpu_kernels.fused_rwkv7_decode(row, params, *one_states, slot, vf, *args)
        assert torch.equal(h[0], got_h[b]) and torch.equal(v[0], got_v[b]), b
    for got, one in zip(got_states, one_states):
        assert torch.equal(got, one)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_many_rows_match_each_row_alone(int8: bool) -> None:
    """33 rows at once (the GEMM path; with int8 weights on an AMX CPU, the tile products of
    `int8_linear`) against each row through the weight-streaming path."""
    params = layer_params(96, 32, 224, False, torch.float32, int8, seed=5)
    tm, wkv, cm = states(96, 32, torch.float32, torch.float32, seed=5)
    alone = [s.clone() for s in (tm, wkv, cm)]
    x, v_first = torch.randn(33, 96), torch.randn(33, 96)
    idx = torch.arange(33)
    h, _ = cpu_kernels.fused_rwkv7_decode(x, params, tm, wkv, cm, idx, v_first, 1e-5, 64e-5)
    for i in range(33):
        one, _ = cpu_kernels.fused_rwkv7_decode(
            x[i : i + 1], params, *alone, idx[i : i + 1], v_first[i : i + 1], 1e-5, 64e-5
        )
        torch.testing.assert_close(h[i : i + 1], one, rtol=1e-4, atol=1e-4)
    for many, one in zip((tm, wkv, cm), alone):
        torch.testing.assert_close(many, one, rtol=1e-4, atol=1e-4)


@pytest.fixture
def fused_calls(monkeypatch) -> dict[str, int]:  # noqa: ANN001
    """Counts the layer steps that ran fused (`FusedRwkv7Step` calls)."""
    calls = {"fused": 0}
    real = FusedRwkv7Step.__call__

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["fused"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FusedRwkv7Step, "__call__", counting)
    return calls


def test_engine_decode_steps_run_fused_and_match_unfused(monkeypatch, fused_calls) -> None:  # noqa: ANN001
    """Greedy decode of a tiny model: the fused steps (counted) give the unfused tokens, with
    logprobs equal to float32 rounding."""
    prompts = [[11, 42, 7, 300, 5], [9, 8], [1234, 77, 31]] * 4  # 12 rows: the GEMM path too
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)

    def run() -> list:
        llm = LLM(tiny_model_dir("rwkv7-h64"), max_num_seqs=12, max_model_len=256)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    fused = run()
    assert fused_calls["fused"] > 0
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    fused_calls["fused"] = 0
    unfused = run()
    assert fused_calls["fused"] == 0
    for a, b in zip(fused, unfused):
        assert a.token_ids == b.token_ids
        lp_a = torch.tensor([a.logprobs[i][t].logprob for i, t in enumerate(a.token_ids)])
        lp_b = torch.tensor([b.logprobs[i][t].logprob for i, t in enumerate(b.token_ids)])
        torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"quantization": "int8"},
        {"quantization": "int4"},  # K of 8 / 16 (the LoRA ranks): those layers stay int8
        {"ssm_state_dtype": "bfloat16"},
        {"dtype": "bfloat16", "ssm_state_dtype": "bfloat16"},
    ],
)
def test_engine_fused_decode_matches_unfused_across_precisions(
    monkeypatch, fused_calls, engine_args
) -> None:  # noqa: ANN001
    """The fused layer on quantised weights, bfloat16 weights and bfloat16 states: the same
    greedy tokens as the unfused layer (VLLM_MAMBA_FUSED_DECODE=0), with the fused path run."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], [100, 200], [9] * 11)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(tiny_model_dir("rwkv7-h64"), max_model_len=128, **engine_args)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = run()
    assert fused_calls["fused"] > 0
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    assert run() == fused
