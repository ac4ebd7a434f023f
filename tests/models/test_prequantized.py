"""Pre-quantised checkpoints (`models/prequantized.py`): an FP8 checkpoint with block scales,
written by hand from the format (float8 e4m3 weights beside `weight_scale_inv` per block, as
Qwen's and DeepSeek's `-FP8` releases), generates transformers' tokens on the same weights
dequantised; with `quantization="int8"` it equals the int8 engine on the dequantised float
checkpoint; formats the engine cannot read are one clear error."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.family_checks import prompts
from tests.helpers.runners import HfRunner, VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import hf_class, tiny_model_dir
from vllm_mamba import LLM

BLOCK = [32, 16]  # rows, columns: tiny layers hold several blocks, some partial
NAME = "qwen3_5-gqa"  # Gated DeltaNet, gated attention, MLPs: every kind of projection
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _to_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight (O, I)` -> float8 e4m3 values and the float32 scale of each block."""
    rows, cols = weight.shape
    bo, bi = BLOCK
    scale = torch.empty(math.ceil(rows / bo), math.ceil(cols / bi))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            s = block.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


def _is_projection(name: str, tensor: torch.Tensor) -> bool:
    return (
        tensor.dim() == 2
        and name.endswith("proj.weight")
        and "embed" not in name
        and "lm_head" not in name
    )


@pytest.fixture(scope="module")
def checkpoints() -> tuple[str, str]:
    """(the FP8 checkpoint, its weights dequantised as a float32 checkpoint)."""
    src = tiny_model_dir(NAME)
    fp8_dir, float_dir = make_tmp_dir("fp8-"), make_tmp_dir("fp8-dequantised-")
    for d in (fp8_dir, float_dir):
        shutil.rmtree(d)
        shutil.copytree(src, d)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, dequantised = {}, {}
    converted = 0
    for name, tensor in tensors.items():
        if _is_projection(name, tensor):
            q, scale = _to_fp8_blocks(tensor.float())
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            rows, cols = tensor.shape
            full = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)
            dequantised[name] = q.float() * full[:, :cols]
            converted += 1
        else:
            fp8[name] = dequantised[name] = tensor
    assert converted >= 8
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"))
    save_file(dequantised, os.path.join(float_dir, "model.safetensors"))
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
    }
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return fp8_dir, float_dir


def test_fp8_generates_transformers_tokens_on_the_dequantised_weights(checkpoints) -> None:  # noqa: ANN001
    fp8_dir, float_dir = checkpoints
    token_prompts = [p["prompt_token_ids"] for p in prompts()[:4]]
    want = HfRunner(float_dir, hf_class(NAME)).generate_greedy_logprobs(token_prompts, 12)
    with VllmRunner(fp8_dir, dtype="float32", max_num_seqs=4) as runner:
        got = runner.generate_greedy(prompts()[:4], 12)
    assert got == [tokens for tokens, _ in want]
    assert len({tuple(t) for t in got}) > 1


def test_fp8_requantised_to_int8_equals_int8_of_the_dequantised_weights(checkpoints) -> None:  # noqa: ANN001
    fp8_dir, float_dir = checkpoints
    outs = []
    for path in (fp8_dir, float_dir):
        with VllmRunner(path, dtype="float32", quantization="int8", max_num_seqs=4) as runner:
            outs.append(runner.generate_greedy(prompts()[:4], 12))
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("quant", "match"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ],
)
def test_unreadable_quantised_checkpoints_are_one_clear_error(checkpoints, quant, match) -> None:  # noqa: ANN001
    path = make_tmp_dir("prequantized-bad-")
    shutil.rmtree(path)
    shutil.copytree(checkpoints[0], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=match):
        LLM(path)
