"""The fused feed-forward stage in the engine (`DecoderLayer.ffn_plan`): planned where the stage is
a dense gated MLP or an MoE (softmax or sigmoid router, with or without its shared expert, or an
MoE plus a shared MLP; an MLP or MoE between the ends of a layer's residual-stream connection,
as the stage alone; clipped SwiGLUs), the kernel runs on decode steps, and the tokens and
logprobs equal those of the same model with `VLLM_MAMBA_FUSED_DECODE=0` (greedy equal,
logprobs within 1e-4 in float32), also with int8 and 4-bit weights (the experts stacked
quantised) and with the plans dropped again (the unfused layers then read the stacked experts).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.layers import moe
from vllm_mamba.layers.decode_plan import DecodeScope, drop_decode_plans, planned_layers
from vllm_mamba.layers.mlp import FusedFfnStep
from vllm_mamba.layers.moe import MOE_MAX_ROWS, ExpertList, GroupedExperts
from vllm_mamba.ops import cpu_kernels, ffn

pytestmark = pytest.mark.skipif(
    "fused_moe_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

PROMPTS = [[11, 42, 7, 300, 5], [9, 8], [1234, 77, 31]]

# (model, quantization, the ops of its planned feed-forward stages)
CASES = [
    ("qwen3_5-gqa", None, {"mlp": 4}),  # dense SwiGLU after zero-centred norms
    ("qwen3-next-moe", None, {"moe": 3}),  # softmax top-2 renormalised, gated shared expert
    ("qwen3-next-moe", "int8", {"moe": 3}),
    ("qwen3-next-moe", "int4", {"moe": 3}),  # 4-bit experts; the shared down (K 48) int8
    ("lfm2-moe-top2", None, {"mlp": 1, "moe": 3}),  # a dense layer, then sigmoid-routed MoEs
    ("kimi-linear-moe", None, {"mlp": 1, "moe": 3}),  # sigmoid in groups, shared experts
    ("granite-moe-rope", None, {"moe": 4}),  # top-k softmax, stacked experts, shared MLP, rm
    # MoEs inside gated hyper-connections: the stage alone, without a norm or the residual
    ("qwen4-exp-ple", None, {"moe": 4}),
    ("qwen4-exp-ple", "int8", {"moe": 4}),
    # SwiGLUs clipped before the activation, inside mHC streams: a dense layer, then MoEs
    ("glm5-next-moe", None, {"mlp": 1, "moe": 3}),
    ("ling-clipped", None, {"mlp": 1, "moe": 3}),  # clipped after the activation, per layer
]


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the fused feed-forward steps run."""
    seen: Counter = Counter()
    real = FusedFfnStep.__call__

    def counted(self, hidden, meta):  # noqa: ANN001, ANN202
        seen[len(hidden)] += 1
        return real(self, hidden, meta)

    monkeypatch.setattr(FusedFfnStep, "__call__", counted)
    return seen


@pytest.fixture
def grouped_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the grouped routed-experts calls (`GroupedExperts`) by their rows."""
    seen: Counter = Counter()
    real = GroupedExperts.__call__

    def counted(self, x, weights, chosen):  # noqa: ANN001, ANN202
        seen[len(x)] += 1
        return real(self, x, weights, chosen)

    monkeypatch.setattr(GroupedExperts, "__call__", counted)
    return seen


def _llm(name: str, quantization: str | None) -> LLM:
    return LLM(
        tiny_model_dir(name), threads=1, max_num_seqs=4, max_model_len=128,
        quantization=quantization,
    )  # fmt: skip


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_same(fused: list, unfused: list) -> None:
    for a, b in zip(fused, unfused, strict=True):
        assert a.token_ids == b.token_ids
        lp_a = torch.tensor([a.logprobs[i][t].logprob for i, t in enumerate(a.token_ids)])
        lp_b = torch.tensor([b.logprobs[i][t].logprob for i, t in enumerate(b.token_ids)])
        torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-4)


# A bfloat16 model's grouped experts through `bf16_gemm` against the same engine's grouped
# experts through `mm` (`VLLM_MAMBA_BF16_GEMM=0`): the same bfloat16 products summed in another
# order, so that a product's rounding flips now and then (measured: logprobs within 1e-3). Its
# logits are bfloat16, so two tokens often tie, and greedy may take either of a tie. (Against
# the unfused loop, which runs each expert in bfloat16 where the grouped call keeps float32
# between the products, logprobs part by up to 0.3 through either product.)
BF16_LOGPROB_ATOL = 1e-2


def _assert_same_bf16(grouped: list, other: list) -> None:
    """Greedy equal up to a tie (where the two runs part, each run's token is within
    BF16_LOGPROB_ATOL of the other's in the first run's top logprobs; the rest of that sequence
    is not compared), and the chosen tokens' logprobs within BF16_LOGPROB_ATOL."""
    for a, b in zip(grouped, other, strict=True):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                assert tb in a.logprobs[i], (i, ta, tb)
                gap = a.logprobs[i][ta].logprob - a.logprobs[i][tb].logprob
                assert gap <= BF16_LOGPROB_ATOL, (i, ta, tb, gap)
                break
            assert abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob) <= BF16_LOGPROB_ATOL


def _op_kinds(llm: LLM) -> Counter:
    kinds: Counter = Counter()
    for layer in planned_layers(llm.llm_engine.model):
        plan = layer.ffn_plan
        if plan is not None:
            assert plan.scope is DecodeScope.FFN
            kinds["moe" if plan.step.op.__name__.endswith("moe_decode") else "mlp"] += 1
    return kinds


@pytest.mark.parametrize("name,quantization,kinds", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_fused_feed_forward_equals_unfused(
    name: str, quantization: str | None, kinds: dict, fused_calls: Counter,
    grouped_calls: Counter, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Also the MoE's prefill steps, whose routed experts run grouped (`GroupedExperts`)."""
    llm = _llm(name, quantization)
    assert _op_kinds(llm) == kinds, "the feed-forward plans made"
    fused = _generate(llm)
    if kinds:
        assert fused_calls[len(PROMPTS)] > 0, "the fused feed-forward steps did not run"
    else:
        assert not fused_calls, "a feed-forward stage without a plan ran fused"
    prefill_rows = sum(len(p) for p in PROMPTS)
    assert bool(grouped_calls[prefill_rows]) == ("moe" in kinds), "the grouped experts' prefill"
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    unfused_llm = _llm(name, quantization)
    assert not _op_kinds(unfused_llm)
    calls = sum(fused_calls.values()) + sum(grouped_calls.values())
    _assert_same(fused, _generate(unfused_llm))
    assert sum(fused_calls.values()) + sum(grouped_calls.values()) == calls
    drop_decode_plans(llm.llm_engine.model)  # the same engine unfused (stacked experts' views)
    _assert_same(fused, _generate(llm))
    assert sum(fused_calls.values()) + sum(grouped_calls.values()) == calls


def test_stacked_experts_are_the_layers_weights() -> None:
    """The experts' `Linear`s read their rows of the stacked tensors (held once), and a binding
    that re-plans reuses the stacking."""
    llm = _llm("qwen3-next-moe", None)
    model = llm.llm_engine.model
    lists = [m for m in model.modules() if isinstance(m, ExpertList)]
    assert lists
    steps = [layer.ffn_plan.step for layer in planned_layers(model) if layer.ffn_plan]
    gate_up_i = ffn.MOE_PARAMS.index("experts_gate_up_w")
    for experts, step in zip(lists, steps, strict=True):
        stacked = step.params[gate_up_i]
        inter = experts[0].gate_proj.weight.shape[0]
        for e, mlp in enumerate(experts):
            assert mlp.gate_proj.weight.data_ptr() == stacked[2 * inter * e].data_ptr()
            assert mlp.up_proj.weight.data_ptr() == stacked[2 * inter * e + inter].data_ptr()
    engine = llm.llm_engine
    engine.executor.cache.bind(model)
    again = [layer.ffn_plan.step for layer in planned_layers(model) if layer.ffn_plan]
    for a, b in zip(again, steps, strict=True):
        assert a is not b and a.params[gate_up_i] is b.params[gate_up_i]


def _dead_bytes(model: torch.nn.Module) -> int:
    """Bytes inside the span of each storage the model's tensors use that no tensor covers."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in [*model.parameters(), *model.buffers()]:
        start = t.data_ptr()
        spans.setdefault(t.untyped_storage().data_ptr(), []).append(
            (start, start + t.numel() * t.element_size())
        )
    dead = 0
    for intervals in spans.values():
        intervals.sort()
        covered, end = 0, intervals[0][0]
        for a, b in intervals:
            covered += max(0, b - max(a, end))
            end = max(end, b)
        dead += end - intervals[0][0] - covered
    return dead


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_experts_are_held_once(quantization: str | None) -> None:
    """The experts are stacked at load, before the weights move to their final memory, so the
    plan views them: no copy of every expert left behind (dead bytes between the live weights
    were the experts' size before)."""
    model = _llm("qwen3-next-moe", quantization).llm_engine.model
    experts = sum(
        p.numel() * p.element_size()
        for m in model.modules() if isinstance(m, ExpertList) for p in m.parameters()
    )  # fmt: skip
    assert experts > 0 and _dead_bytes(model) < experts // 8


MANY_PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(i % 4 + 2)] for i in range(20)]


@pytest.mark.parametrize(
    "name,quantization",
    [("kimi-linear-moe", None), ("qwen3-next-moe", "int4"), ("lfm2-moe-top2", "w8a8")],
)
def test_moe_steps_past_max_rows_run_fused_in_parts(
    name: str, quantization: str | None, fused_calls: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step of more rows than one call takes (20 > `ffn.MAX_ROWS`) runs an MoE stage
    fused, in calls of `MAX_ROWS` rows (`FusedFfnStep.max_rows`), and equals the unfused
    engine; a dense MLP's plan keeps `MAX_ROWS` (its GEMM reads the weight once)."""
    assert len(MANY_PROMPTS) > ffn.MAX_ROWS

    def run(llm: LLM) -> list:
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in MANY_PROMPTS]
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    def make() -> LLM:
        return LLM(
            tiny_model_dir(name), threads=1, max_num_seqs=len(MANY_PROMPTS), max_model_len=64,
            quantization=quantization,
        )  # fmt: skip

    llm = make()
    plans = [layer.ffn_plan for layer in planned_layers(llm.llm_engine.model) if layer.ffn_plan]
    moe_rows = {p.step.max_rows for p in plans if p.step.op.__name__.endswith("moe_decode")}
    assert moe_rows == {MOE_MAX_ROWS}
    assert all(
        p.step.max_rows == ffn.MAX_ROWS for p in plans if p.step.op.__name__.endswith("mlp_decode")
    )
    fused = run(llm)
    assert fused_calls[len(MANY_PROMPTS)] > 0, "the 20-row decode steps did not run fused"
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    _assert_same(fused, run(make()))


LONG_PROMPTS = [[(13 * i + 5 * j) % 700 + 3 for j in range(20 + 9 * i)] for i in range(3)]


@pytest.mark.parametrize(
    "name,quantization",
    [("qwen3-next-moe", None), ("qwen3-next-moe", "int4"), ("lfm2-moe-top2", "w8a8"),
     ("lfm2-moe-top2", "w4a8"), ("granite-moe-rope", None), ("ling-clipped", None),
     ("granite-moe-rope", "bfloat16")],
)  # fmt: skip
def test_grouped_experts_equal_the_unfused_loop(
    name: str, quantization: str | None, grouped_calls: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill steps of 20-38-token prompts (several rows an expert: the integer-dot GEMM
    path) with the MoE's routed experts grouped (`GroupedExperts`) equal the same engine with
    the unfused loop (`dispatch_experts`), whose decode plans are the same: greedy equal,
    logprobs within 1e-4 (float32 models). "bfloat16": the model in bfloat16, its grouped
    experts through `bf16_gemm` (on a CPU with AVX512-BF16) against the same grouped experts
    through `mm` (`_assert_same_bf16`)."""
    dtype = "bfloat16" if quantization == "bfloat16" else "auto"
    quantization = None if quantization == "bfloat16" else quantization

    def run() -> list:
        llm = LLM(
            tiny_model_dir(name), threads=1, max_num_seqs=4, max_model_len=128,
            quantization=quantization, dtype=dtype,
        )  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in LONG_PROMPTS]
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    grouped = run()
    assert grouped_calls[sum(len(p) for p in LONG_PROMPTS)] > 0, "the grouped prefill did not run"
    if dtype == "bfloat16":
        monkeypatch.setenv("VLLM_MAMBA_BF16_GEMM", "0")
        return _assert_same_bf16(grouped, run())
    monkeypatch.setattr(moe, "plan_grouped_experts", lambda _: None)
    calls = sum(grouped_calls.values())
    _assert_same(grouped, run())
    assert sum(grouped_calls.values()) == calls


@pytest.mark.parametrize(
    "name,quantization",
    [("kimi-linear-moe", None), ("lfm2-moe-top2", "w8a8"), ("granite-moe-rope", "bfloat16")],
)
def test_moe_steps_past_the_fused_rows_run_grouped(
    name: str, quantization: str | None, grouped_calls: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step of more rows than the fused stage takes (`MOE_MAX_ROWS`; bfloat16 experts
    on a CPU with bfloat16 instructions `MOE_MAX_ROWS_BF16`) runs the routed experts grouped,
    and equals the same engine with the unfused loop (its decode plans the same; bfloat16 as in
    `test_grouped_experts_equal_the_unfused_loop`)."""
    dtype = "bfloat16" if quantization == "bfloat16" else "auto"
    quantization = None if quantization == "bfloat16" else quantization
    bf16 = dtype == "bfloat16" and cpu_kernels.native_bf16()
    max_rows = moe.MOE_MAX_ROWS_BF16 if bf16 else MOE_MAX_ROWS
    prompts = [[(11 * i + j) % 500 + 3 for j in range(i % 3 + 2)] for i in range(max_rows + 8)]

    def run() -> list:
        llm = LLM(
            tiny_model_dir(name), threads=1, max_num_seqs=len(prompts), max_model_len=64,
            quantization=quantization, dtype=dtype,
        )  # fmt: skip
        plans = [layer.ffn_plan for layer in planned_layers(llm.llm_engine.model)]
        moes = [p for p in plans if p and p.step.op.__name__.endswith("moe_decode")]
        assert moes and {p.step.max_rows for p in moes} == {max_rows}
        params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    grouped = run()
    assert grouped_calls[len(prompts)] > 0, "the decode steps past the fused rows ran unfused"
    if dtype == "bfloat16":
        monkeypatch.setenv("VLLM_MAMBA_BF16_GEMM", "0")
        return _assert_same_bf16(grouped, run())
    monkeypatch.setattr(moe, "plan_grouped_experts", lambda _: None)
    _assert_same(grouped, run())
