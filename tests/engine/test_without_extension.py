"""The engine gives the same tokens with the C++ extension and with the PyTorch references."""

from __future__ import annotations

import pytest

from tests.models.test_mamba_vs_transformers import make_prompts
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_reference_ops_give_same_tokens(name: str, monkeypatch) -> None:
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = SamplingParams(temperature=0, max_tokens=24)
    fast = LLM(tiny_model_dir(name), max_num_batched_tokens=64)
    assert fast.llm_engine.model.backbone.layers[0].mixer.ops.name == "cpp"
    want = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    ref = LLM(tiny_model_dir(name), max_num_batched_tokens=64)
    assert ref.llm_engine.model.backbone.layers[0].mixer.ops.name == "ref"
    got = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want
