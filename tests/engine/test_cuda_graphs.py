"""CUDA graphs for decode: capture sizes on any machine; graph == eager on a GPU (`cuda`)."""

from __future__ import annotations

import pytest

from tests.helpers.prompts import MAX_TOKENS
from tests.helpers.runners import HfRunner, VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.worker.cuda_graphs import capture_sizes


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [3, 8])  # 3 is not a captured size
def test_graph_equals_eager(
    vllm_runner: type[VllmRunner],
    example_token_prompts: list[list[int]],
    dtype: str,
    num_prompts: int,
) -> None:
    prompts = [{"prompt_token_ids": p} for p in example_token_prompts[:num_prompts]]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    model = tiny_model_dir("tied")
    with (
        vllm_runner(model, dtype=dtype, max_num_seqs=16) as graph_runner,
        vllm_runner(model, dtype=dtype, max_num_seqs=16, enforce_eager=True) as eager_runner,
    ):
        assert graph_runner.engine.executor.runner.cuda_graphs is not None
        assert graph_runner.engine.config.device.type == "cuda"
        assert eager_runner.engine.executor.runner.cuda_graphs is None
        graph = graph_runner.generate(prompts, params)
        eager = eager_runner.generate(prompts, params)
    assert len({tuple(e.outputs[0].token_ids) for e in eager}) == num_prompts
    for g, e in zip(graph, eager):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            e.outputs[0].cumulative_logprob, abs=1e-2 if dtype == "bfloat16" else 1e-4
        )


@pytest.mark.cuda
def test_gpu_float32_equals_transformers(
    hf_runner: type[HfRunner],
    vllm_runner: type[VllmRunner],
    example_token_prompts: list[list[int]],
) -> None:
    model = tiny_model_dir("tied")
    refs = hf_runner(model).generate_greedy_logprobs(example_token_prompts, MAX_TOKENS)
    with vllm_runner(model, device="cuda") as runner:
        got = runner.generate_greedy(
            [{"prompt_token_ids": p} for p in example_token_prompts], MAX_TOKENS
        )
    same = sum(g == t for g, (t, _) in zip(got, refs))
    assert same >= len(refs) - 1  # GPU float32 matmuls (TF32 off) may flip one near-tie
