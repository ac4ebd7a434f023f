"""CUDA graphs for decode: capture sizes on any machine; graph == eager on a GPU (`cuda`)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_mamba_vs_transformers import make_prompts
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.engine.cuda_graphs import capture_sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [3, 8])  # 3 is not a captured size
def test_graph_equals_eager(dtype: str, num_prompts: int) -> None:
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:num_prompts]]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    graph_llm = LLM(tiny_model_dir("tied"), dtype=dtype, max_num_seqs=16)
    assert graph_llm.llm_engine.runner.cuda_graphs is not None
    assert graph_llm.llm_engine.config.device.type == "cuda"
    eager_llm = LLM(tiny_model_dir("tied"), dtype=dtype, max_num_seqs=16, enforce_eager=True)
    assert eager_llm.llm_engine.runner.cuda_graphs is None
    graph = graph_llm.generate(prompts, params, use_tqdm=False)
    eager = eager_llm.generate(prompts, params, use_tqdm=False)
    for g, e in zip(graph, eager):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            e.outputs[0].cumulative_logprob, abs=1e-2 if dtype == "bfloat16" else 1e-4
        )


@pytest.mark.cuda
@needs_cuda
def test_gpu_float32_equals_transformers() -> None:
    from tests.models.test_mamba_vs_transformers import hf_reference

    refs = hf_reference("tied")
    llm = LLM(tiny_model_dir("tied"), device="cuda")
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in make_prompts()],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )
    same = sum(o.outputs[0].token_ids == t for o, (t, _) in zip(outs, refs))
    assert same >= len(refs) - 1  # GPU float32 matmuls (TF32 off) may flip one near-tie
