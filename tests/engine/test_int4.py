"""`quantization="int4"`: the engine with 4-bit group-quantised weights against the float engine.

The comparisons of `test_int8.py`, teacher-forced (`prompt_logprobs` over the same sequences):
the int4 model equals the float model run on its dequantised weights (the plumbing: which
layers are 4-bit, which fall back to int8, the tied embedding, the kernels), and it stays close
to the float model on the random tiny models and on the shipped trained model (the 4-bit
rounding error, measured bounds below). Also: greedy outputs equal batched and one by one,
the layers and memory, the fallback to int8 for K not a multiple of 32, the refusal of tensor
parallelism, the CLI flag and the reference ops.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.engine.test_int8 import (
    MODELS,
    _compare,
    _compare_trained,
    _dequantised_checkpoint,
    _sequences,
    _teacher_forced,
)
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.config import record_quantization
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.layers import quantization
from vllm_mamba.layers.quantization import Int4Embedding, Int8Embedding
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.ops.int4_linear import dequantize_int4, int4_linear_ref

EXACT_MODELS = ["mamba-tied", "mamba-untied-bias", "mamba2", "jamba", "qwen3_5"]
RANDOM_MODELS = ["mamba-tied", "falcon-mamba", "mamba2", "jamba", "bamba", "qwen3_5"]

# Random tiny models (N(0, 0.3^2) weights, nearly flat logits over 50k tokens): the 4-bit step
# is about 12x int8's and moves their top-1 token at most positions. Measured top-1 agreement
# 0.07-0.42 and mean |logprob difference| 0.32-1.64 (int8: 0.82-0.95 and 0.05-0.25); that the
# difference is the rounding alone is `test_int4_is_the_float_model_with_dequantised_weights`.
RANDOM_TOP1_AGREEMENT = 0.05
RANDOM_MEAN_LOGPROB_DIFF = 2.0
# The trained model (LM head int8): measured 95.5% top-1 agreement, mean difference 0.076,
# worst 0.61 over 134 positions (with a 4-bit head: 88.8%, 0.14, 0.94; int8: 98.5%, 0.008, 0.09).
TRAINED_TOP1_AGREEMENT = 0.93
TRAINED_MEAN_LOGPROB_DIFF = 0.1
TRAINED_MAX_LOGPROB_DIFF = 0.8


@pytest.mark.parametrize("name", EXACT_MODELS)
def test_int4_is_the_float_model_with_dequantised_weights(name: str) -> None:
    path = MODELS[name]()
    seqs = _sequences(50000)
    top_q, lp_q = _teacher_forced(path, seqs, "int4")
    top_d, lp_d = _teacher_forced(_dequantised_checkpoint(path, "int4"), seqs)
    assert top_q == top_d
    torch.testing.assert_close(lp_q, lp_d, rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_int4_close_to_float_on_random_tiny_models(name: str) -> None:
    agree, diff = _compare(name, "int4")
    print(f"{name}: top-1 agreement {agree:.3f}, mean |dlogprob| {float(diff.mean()):.3f}")
    assert agree >= RANDOM_TOP1_AGREEMENT, (agree, float(diff.mean()))
    assert float(diff.mean()) <= RANDOM_MEAN_LOGPROB_DIFF, (agree, float(diff.mean()))


def test_int4_close_to_float_on_the_trained_model() -> None:
    agree, diff = _compare_trained("int4")
    print(f"trained: top-1 {agree:.4f}, mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f}")
    assert agree >= TRAINED_TOP1_AGREEMENT, agree
    assert float(diff.mean()) <= TRAINED_MEAN_LOGPROB_DIFF, float(diff.mean())
    assert float(diff.max()) <= TRAINED_MAX_LOGPROB_DIFF, float(diff.max())


@pytest.mark.parametrize("name", ["mamba-tied", "mamba2", "qwen3_5"])
def test_int4_greedy_equal_batched_and_one_by_one(name: str) -> None:
    path = MODELS[name]()
    g = torch.Generator().manual_seed(5)
    prompts = [
        {"prompt_token_ids": torch.randint(2, 50000, (n,), generator=g).tolist()}
        for n in (3, 17, 8, 30, 1, 12)
    ]
    params = SamplingParams(temperature=0, max_tokens=10)
    with VllmRunner(path, max_num_seqs=8, quantization="int4") as runner:
        batched = [o.outputs[0].token_ids for o in runner.generate(prompts, params)]
        single = [runner.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == single


def test_int4_layers_memory_and_int8_fallback() -> None:
    with VllmRunner(tiny_model_dir("tied"), quantization="int4", max_num_seqs=1) as runner:
        model = runner.engine.model
        mixer = model.backbone.layers[0].mixer
        for linear in (mixer.in_proj, mixer.x_proj, mixer.out_proj):
            k = linear.in_features
            assert linear.weight.dtype == torch.uint8 and linear.weight.shape[1] == k // 2
            assert linear.weight_scale.dtype == torch.float16
            assert linear.weight_scale.shape == (linear.out_features, k // 32)
            assert linear.compute_dtype == torch.float32
        assert mixer.dt_proj.weight.dtype == torch.float32  # read directly by the mixer
        assert model.lm_head.weight.dtype == torch.int8  # the head stays int8 (INT8_UNDER_INT4)
        assert isinstance(model.backbone.embeddings, Int8Embedding)  # the tied head's table
        assert model.backbone.embeddings.weight is model.lm_head.weight
        assert runner.engine.config.model_config.quantization == "int4"
    # hidden 48: in_proj's K is not a multiple of 32, so it is int8; out_proj's (96) is 4-bit
    with VllmRunner(tiny_model_dir("untied"), quantization="int4", max_num_seqs=1) as runner:
        mixer = runner.engine.model.backbone.layers[0].mixer
        assert mixer.in_proj.in_features % 32 != 0 and mixer.in_proj.weight.dtype == torch.int8
        assert mixer.out_proj.weight.dtype == torch.uint8


def test_a_4bit_tied_head_serves_the_embedding(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the head 4-bit too (not the default), the tied embedding reads its 4-bit table."""
    monkeypatch.setattr(quantization, "INT8_UNDER_INT4", ())
    path = tiny_model_dir("tied")
    hf_config = load_hf_config(path)
    record_quantization(hf_config, "int4")
    model, _ = build_model(path, hf_config, torch.float32, torch.device("cpu"))
    table = model.backbone.embeddings
    assert isinstance(table, Int4Embedding) and table.weight is model.lm_head.weight
    ids = torch.tensor([0, 5, 5, 49999])
    want = dequantize_int4(model.lm_head.weight, model.lm_head.weight_scale, torch.float32)[ids]
    assert torch.equal(table(ids), want)


def test_int4_with_tensor_parallelism_is_a_value_error() -> None:
    args = EngineArgs(model=tiny_model_dir("tied"), quantization="int4", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2.*int4"):
        args.create_engine_config()


def test_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--quantization", "int4"])
    assert EngineArgs.from_cli_args(argparse.Namespace(model="m", **vars(args))).quantization == (
        "int4"
    )


def test_reference_ops_run_int4(monkeypatch: pytest.MonkeyPatch) -> None:
    """`VLLM_MAMBA_OPS=ref` (no extension needed): the same function as the C++ kernels."""
    path, seqs = MODELS["mamba-tied"](), _sequences(50000)
    top_cpp, lp_cpp = _teacher_forced(path, seqs, "int4")
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with VllmRunner(path, max_num_seqs=4, quantization="int4") as runner:
        assert runner.engine.model.backbone.layers[0].mixer.out_proj.int4_op is int4_linear_ref
        outs = runner.generate([{"prompt_token_ids": list(s)} for s in seqs], params)
    own = [
        out.prompt_logprobs[p][s[p]].logprob for s, out in zip(seqs, outs) for p in range(1, len(s))
    ]
    torch.testing.assert_close(torch.tensor(own, dtype=torch.float64), lp_cpp, rtol=0, atol=2e-3)
