"""The engine gives the same tokens with the C++ extension and with the PyTorch references."""

from __future__ import annotations

import pytest

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_reference_ops_give_same_tokens(
    vllm_runner: type[VllmRunner],
    example_token_prompts: list[list[int]],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = [{"prompt_token_ids": p} for p in example_token_prompts]
    with vllm_runner(tiny_model_dir(name), max_num_batched_tokens=64) as fast:
        assert fast.engine.model.backbone.layers[0].mixer.ops.name == "cpp"
        want = fast.generate_greedy(prompts, 24)
    assert len({tuple(t) for t in want}) == len(want)

    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    with vllm_runner(tiny_model_dir(name), max_num_batched_tokens=64) as ref:
        assert ref.engine.model.backbone.layers[0].mixer.ops.name == "ref"
        assert ref.generate_greedy(prompts, 24) == want
