"""The fused delta-rule decode layers in the engine (`layers.fused_delta_decode`): planned on
the GDN layers of Qwen3.5, Qwen3-Next and OLMo Hybrid and the KDA layers of Kimi Linear and
Ling 3 (`fused_kda_decode`, two-stage and single-stage gates) with the block's norm, the same
greedy tokens and float32 logprobs (1e-4) as the unfused layers (`VLLM_MAMBA_FUSED_DECODE=0`,
read at plan time) at float32, int8 and 4-bit weights (KDA also integer dot products, w8a8)
and bfloat16 states, decode batches of 9 rows (GEMMs) down to 1 (weight-streaming products);
and speculative decoding whose chains run through the fused layer in one call (rows with
source slots) with the tokens and states of decoding without speculation.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.family_checks import GREEDY, alone, prompts, tokens
from tests.helpers.runners import VllmRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.layers.decode_plan import DecodeScope, planned_layers
from vllm_mamba.layers.fused_delta_decode import FusedDeltaStep
from vllm_mamba.layers.gated_deltanet import GatedDeltaNet
from vllm_mamba.ops import cpu_kernels

pytestmark = pytest.mark.skipif(
    not {"fused_gdn_decode", "fused_kda_decode"} <= cpu_kernels.library_ops(),
    reason="C++ extension not built",
)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the fused GDN steps that ran, and those that ran speculative chains."""
    calls = {"fused": 0, "chains": 0}
    real = FusedDeltaStep.__call__

    def counting(self, hidden, meta):  # noqa: ANN001, ANN202
        calls["fused"] += 1
        calls["chains"] += bool(meta.decode_waves)
        return real(self, hidden, meta)

    monkeypatch.setattr(FusedDeltaStep, "__call__", counting)
    return calls


def _gdn_plans(runner: VllmRunner) -> list:
    """The plans of the layers whose mixer is a Gated DeltaNet."""
    layers = planned_layers(runner.engine.model)
    gdn = [la for la in layers if any(isinstance(m, GatedDeltaNet) for m in la.children())]
    assert gdn, "the model should have GDN layers"
    return [la.decode_plan for la in gdn]


def _generate(
    model: str, quantization: str | None, state_dtype: str
) -> tuple[list[list[int]], list[list[float]], list]:
    """Greedy tokens and logprobs of 9 prompts (decode batches of 9, then fewer rows), and the
    GDN layers' plans."""
    g = torch.Generator().manual_seed(3)
    lengths = (5, 12, 3, 7, 20, 1, 9, 4, 15)
    ids = [
        {"prompt_token_ids": torch.randint(0, 50000, (n,), generator=g).tolist()} for n in lengths
    ]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, logprobs=0) for i in range(9)]
    kwargs = dict(max_num_seqs=9, quantization=quantization, ssm_state_dtype=state_dtype)
    with VllmRunner(model, **kwargs) as runner:
        outs = [o.outputs[0] for o in runner.generate(ids, params)]
        plans = _gdn_plans(runner)
    logprobs = [[next(iter(d.values())).logprob for d in o.logprobs] for o in outs]
    return [o.token_ids for o in outs], logprobs, plans


@pytest.mark.parametrize(
    "name,quantization,state_dtype",
    [
        ("qwen3_5-gqa", None, "auto"),
        ("qwen3_5-mqa", None, "auto"),
        ("qwen3-next-moe", None, "auto"),
        ("qwen3-next-mlp-only", None, "auto"),
        ("olmo-hybrid-rope", None, "auto"),
        ("qwen3_5-gqa", "int8", "auto"),
        ("qwen3-next-moe", "int4", "auto"),
        ("qwen3_5-mqa", "int4", "auto"),
        ("qwen3_5-gqa", None, "bfloat16"),
        ("kimi-linear-moe", None, "auto"),
        ("kimi-linear-qlora", None, "auto"),
        ("kimi-linear-moe", "int8", "auto"),
        ("kimi-linear-qlora", "int4", "auto"),
        ("kimi-linear-qlora", "w8a8", "auto"),
        ("kimi-linear-moe", None, "bfloat16"),
        ("ling-qlora", None, "auto"),
        ("ling-moe", "w8a8", "auto"),
    ],
)
def test_engine_outputs_equal_with_and_without_fused_gdn(
    name: str,
    quantization: str | None,
    state_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
    fused_calls: dict[str, int],
) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    model = tiny_model_dir(name)
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    want, want_lp, plans = _generate(model, quantization, state_dtype)
    assert not any(plans) and fused_calls["fused"] == 0
    assert len({tuple(t) for t in want}) > 5, "reference generations should be varied"
    monkeypatch.delenv("VLLM_MAMBA_FUSED_DECODE")
    got, got_lp, plans = _generate(model, quantization, state_dtype)
    assert all(p is not None and p.scope is DecodeScope.BLOCK for p in plans)
    assert all(isinstance(p.step, FusedDeltaStep) for p in plans)
    assert fused_calls["fused"] > 0, "the fused kernels did not run"
    if quantization == "int8":  # the fused layer runs on the int8 weights themselves
        assert all(p.step.params[-2].dtype == torch.int8 for p in plans)
    if quantization == "int4":  # on 4-bit weights (int8 where K % 32 != 0)
        assert any(t is not None and t.dtype == torch.uint8 for t in plans[0].step.params)
    # integer dot products (int8-quantised activations) in the fused layer as in the unfused
    assert all(p.step.int_dot == (quantization == "w8a8") for p in plans)
    assert got == want
    # bfloat16 states round the same values at slightly different points in the two paths
    atol = 1e-4 if state_dtype == "auto" else 1e-3
    for a, b in zip(got_lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "name", ["qwen3_5-gqa", "qwen3-next-mlp-only", "kimi-linear-moe", "ling-qlora"]
)
def test_speculative_chains_run_fused_and_equal_no_speculation(
    name: str, fused_calls: dict[str, int]
) -> None:
    """Partly right drafts (`OracleProposer`: accepted runs and rejections at every position)
    over 4 speculative tokens: the greedy tokens of each prompt alone without speculation, the
    verification chains through the fused GDN layers."""
    path = tiny_model_dir(name)
    want = alone(path)
    refs = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts(), want, strict=True)}
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with VllmRunner(path, speculative_config=spec) as runner:
        assert all(p is not None for p in _gdn_plans(runner))
        runner.engine.spec_steps.proposer = OracleProposer(refs)
        assert tokens(runner.generate(prompts(), GREEDY)) == want
        counters = runner.engine.spec_steps.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert fused_calls["chains"] > 0, "no chain ran through the fused layer"
