"""`quantization="int8"`: the engine with int8 weights against the float engine.

Three comparisons, all teacher-forced (`prompt_logprobs` over the same token sequences, so one
early difference does not change every later position):

- against the float engine on a checkpoint whose quantised weights were replaced by their
  dequantised values: the same function, so the same top-1 token at every position and
  log-probabilities within float32 rounding. This checks the plumbing (which layers are
  int8, the tied embedding, biases, the kernels) exactly.
- against the float engine on the original checkpoint, on the tiny random test models of every
  family: the int8 rounding error of random N(0, 0.3^2) weights through a few layers. Their
  logits are nearly flat over 50k tokens, so this bound is loose.
- the same on the shipped trained model (`tiny-stdlib`), where the bound is tight.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.config import record_quantization
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.quantization import Int4Embedding, Int8Embedding, plain_weight
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.model_zoo import DEFAULT_MODEL, shipped_model_path
from vllm_mamba.ops.int4_linear import dequantize_int4
from vllm_mamba.ops.int8_linear import dequantize_int8, int8_linear_ref
from vllm_mamba.ops.q4k import dequantize_q4k

MODELS = {
    "mamba-tied": lambda: tiny_model_dir("tied"),
    "mamba-untied-bias": lambda: tiny_model_dir("untied"),
    "falcon-mamba": lambda: tiny_model_dir("falcon-untied"),
    "mamba2": lambda: tiny_model_dir("mamba2-groups"),
    "jamba": lambda: tiny_model_dir("jamba-gqa"),
    "bamba": lambda: tiny_model_dir("bamba-gqa"),
    "granite-moe": lambda: tiny_model_dir("granite-moe-rope"),
    "nemotron-h-moe": lambda: tiny_model_dir("nemotron-h-moe"),
    "falcon-h1": lambda: tiny_model_dir("falcon-h1-norm"),
    "qwen3_5": lambda: tiny_model_dir("qwen3_5-gqa"),
    "qwen3_5-moe": lambda: tiny_model_dir("qwen3_5-moe-top2"),
    "qwen3-next": lambda: tiny_model_dir("qwen3-next-moe"),
    "olmo-hybrid": lambda: tiny_model_dir("olmo-hybrid-rope"),
    "kimi-linear": lambda: tiny_model_dir("kimi-linear-moe"),
    "rwkv7": lambda: tiny_model_dir("rwkv7-h64"),
}
EXACT_MODELS = [
    "mamba-tied",
    "mamba-untied-bias",
    "mamba2",
    "jamba",
    "qwen3_5",
    "olmo-hybrid",
    "kimi-linear",
    "rwkv7",
]

# Random tiny models: top-1 agreement with the float model at >= 75% of positions, and the
# log-probability of the sequence's token off by <= 0.4 on average (measured: 82-95% and
# 0.05-0.25 on these models).
RANDOM_TOP1_AGREEMENT = 0.75
RANDOM_MEAN_LOGPROB_DIFF = 0.4
# The trained model: >= 97% top-1 agreement, mean difference <= 0.02, worst <= 0.3
# (measured: 98.5%, 0.008 and 0.09 over 134 positions).
TRAINED_TOP1_AGREEMENT = 0.97
TRAINED_MEAN_LOGPROB_DIFF = 0.02
TRAINED_MAX_LOGPROB_DIFF = 0.3


def _sequences(vocab: int) -> tuple[tuple[int, ...], ...]:
    g = torch.Generator().manual_seed(7)
    return tuple(tuple(torch.randint(2, vocab, (n,), generator=g).tolist()) for n in (9, 50))


@functools.cache
def _teacher_forced(
    path: str, seqs: tuple[tuple[int, ...], ...], quantization: str | None = None
) -> tuple[list[int], torch.Tensor]:
    """Top-1 token and the log-probability of the sequence's own token, at every position."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with VllmRunner(path, max_num_seqs=4, quantization=quantization) as runner:
        outs = runner.generate([{"prompt_token_ids": list(s)} for s in seqs], params)
    top1, own = [], []
    for seq, out in zip(seqs, outs):
        for pos in range(1, len(seq)):
            entry = out.prompt_logprobs[pos]
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            own.append(entry[seq[pos]].logprob)
    return top1, torch.tensor(own, dtype=torch.float64)


@functools.cache
def _compare(name: str, method: str = "int8") -> tuple[float, torch.Tensor]:
    """Top-1 agreement and `|logprob difference|` per position, `method` against float."""
    path = MODELS[name]()
    seqs = _sequences(50000)
    top_f, lp_f = _teacher_forced(path, seqs)
    top_q, lp_q = _teacher_forced(path, seqs, method)
    agree = sum(a == b for a, b in zip(top_f, top_q)) / len(top_f)
    return agree, (lp_f - lp_q).abs()


def _dequantised_checkpoint(path: str, method: str = "int8") -> str:
    """A copy of the checkpoint in `path` whose weights that `method` quantises are replaced by
    their dequantised values (taken from the quantised model the loader builds)."""
    hf_config = load_hf_config(path)
    record_quantization(hf_config, method)
    model, _ = build_model(path, hf_config, torch.float32, torch.device("cpu"))
    dequantised = {}
    for name, module in model.named_modules():
        quantised = isinstance(module, (Int8Embedding, Int4Embedding)) or (
            isinstance(module, Linear) and module.weight.dtype in (torch.int8, torch.uint8)
        )
        if quantised:
            weight, scale = plain_weight(module)
            dequantise = dequantize_int4 if weight.dtype == torch.uint8 else dequantize_int8
            if scale.dtype == torch.uint8:  # Q4_K-style scale bytes (w4a8_k)
                dequantise = dequantize_q4k
            w = dequantise(weight, scale, torch.float32)
            dequantised[f"{name}.weight"] = w
    remap = getattr(model, "remap_weight_name", lambda n: n)
    out = make_tmp_dir("tiny-dequantised-")
    for file in os.listdir(path):
        src = os.path.join(path, file)
        if file.endswith(".safetensors"):
            tensors = load_file(src)
            for key in tensors:
                if remap(key) in dequantised:
                    tensors[key] = dequantised[remap(key)].to(tensors[key].dtype).contiguous()
            save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        elif os.path.isfile(src):
            shutil.copy(src, out)
    assert dequantised, "nothing was quantised"
    return out


@pytest.mark.parametrize("name", EXACT_MODELS)
def test_int8_is_the_float_model_with_dequantised_weights(name: str) -> None:
    path = MODELS[name]()
    seqs = _sequences(50000)
    top_q, lp_q = _teacher_forced(path, seqs, "int8")
    top_d, lp_d = _teacher_forced(_dequantised_checkpoint(path), seqs)
    assert top_q == top_d
    torch.testing.assert_close(lp_q, lp_d, rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", list(MODELS))
def test_int8_close_to_float_on_random_tiny_models(name: str) -> None:
    agree, diff = _compare(name)
    assert agree >= RANDOM_TOP1_AGREEMENT, (agree, float(diff.mean()))
    assert float(diff.mean()) <= RANDOM_MEAN_LOGPROB_DIFF, (agree, float(diff.mean()))


def _compare_trained(method: str) -> tuple[float, torch.Tensor]:
    """`_compare` on the shipped trained model, over its own greedy continuations."""
    path = shipped_model_path(DEFAULT_MODEL)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 4096, (n,), generator=g).tolist() for n in (40, 90)]
    with VllmRunner(path) as runner:  # natural text: the float model's greedy continuations
        outs = runner.generate_greedy([{"prompt_token_ids": s[:8]} for s in seqs], 60)
    seqs = tuple(tuple(s[:8] + o) for s, o in zip(seqs, outs))
    top_f, lp_f = _teacher_forced(path, seqs)
    top_q, lp_q = _teacher_forced(path, seqs, method)
    agree = sum(a == b for a, b in zip(top_f, top_q)) / len(top_f)
    return agree, (lp_f - lp_q).abs()


def test_int8_close_to_float_on_the_trained_model() -> None:
    agree, diff = _compare_trained("int8")
    assert agree >= TRAINED_TOP1_AGREEMENT, agree
    assert float(diff.mean()) <= TRAINED_MEAN_LOGPROB_DIFF, float(diff.mean())
    assert float(diff.max()) <= TRAINED_MAX_LOGPROB_DIFF, float(diff.max())


def test_int8_layers_and_memory() -> None:
    with VllmRunner(tiny_model_dir("tied"), quantization="int8", max_num_seqs=1) as runner:
        model = runner.engine.model
        mixer = model.backbone.layers[0].mixer
        for linear in (mixer.in_proj, mixer.x_proj, mixer.out_proj, model.lm_head):
            assert linear.weight.dtype == torch.int8 and linear.weight_scale.dtype == torch.float32
            assert linear.compute_dtype == torch.float32
        assert mixer.dt_proj.weight.dtype == torch.float32  # read directly by the mixer
        assert isinstance(model.backbone.embeddings, Int8Embedding)  # the tied head's table
        assert model.backbone.embeddings.weight is model.lm_head.weight
        assert runner.engine.config.model_config.quantization == "int8"


def test_unknown_quantization_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="quantization 'fp8'"):
        LLM(tiny_model_dir("tied"), quantization="fp8")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=tiny_model_dir("tied"), quantization=8).create_engine_config()


def test_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--quantization", "int8"])
    assert EngineArgs.from_cli_args(argparse.Namespace(model="m", **vars(args))).quantization == (
        "int8"
    )
    assert parser.parse_args([]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp8"])


def test_reference_ops_run_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    """`VLLM_MAMBA_OPS=ref` (no extension needed): the same function as the C++ kernels."""
    path, seqs = MODELS["mamba-tied"](), _sequences(50000)
    top_cpp, lp_cpp = _teacher_forced(path, seqs, "int8")
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with VllmRunner(path, max_num_seqs=4, quantization="int8") as runner:
        assert runner.engine.model.lm_head.int8_op is int8_linear_ref
        outs = runner.generate([{"prompt_token_ids": list(s)} for s in seqs], params)
    own = [
        out.prompt_logprobs[p][s[p]].logprob for s, out in zip(seqs, outs) for p in range(1, len(s))
    ]
    torch.testing.assert_close(torch.tensor(own, dtype=torch.float64), lp_cpp, rtol=0, atol=2e-3)
