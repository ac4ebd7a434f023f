"""Pre-quantised checkpoints (`models/prequantized/`): for each format (FP8 blocks, GPTQ 4 / 8
bits v1 / v2 with act-order, AWQ, compressed-tensors W4A16 / W8A16 / int8 / NVFP4 / MXFP4 /
FP8, gpt-oss MXFP4) a tiny Qwen3.5 hybrid checkpoint is written by hand from the format's
specification (`tests/helpers/prequantized_checkpoints.py`, no engine code), beside a float
checkpoint of the values the format's formula defines. Checked: each loaded layer's integer
layout dequantises to exactly those values and runs with integer weights (int8 / uint8, or
float where the format or act-order says so); `LLM` generates transformers' greedy tokens on
the float checkpoint; `quantization="int8"` equals int8 of the float checkpoint; formats and
variants the engine cannot read are one clear error naming the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.family_checks import prompts
from tests.helpers.prequantized_checkpoints import FORMATS
from tests.helpers.runners import HfRunner, VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir, session_cache
from tests.tiny_models import hf_class, tiny_model_dir
from vllm_mamba import LLM
from vllm_mamba.layers.linear import Linear
from vllm_mamba.model_loader import build_model, load_hf_config

NAME = "qwen3_5-gqa"  # Gated DeltaNet, gated attention, MLPs: every kind of projection
# generated end to end (the other formats' layers run the same ops on values checked exactly)
GENERATED = ["fp8-blocks", "gptq-4bit-g32-asym-v1", "awq-4bit-g32", "ct-w4a16-g32-asym",
             "ct-nvfp4"]  # fmt: skip


def _quantised(name: str, tensor: torch.Tensor, rows_of_8: bool) -> bool:
    return (
        tensor.dim() == 2
        and name.endswith(".weight")
        and "proj" in name.split(".")[-2]
        and "embed" not in name
        and "lm_head" not in name
        and (tensor.shape[0] % 8 == 0 or not rows_of_8)
    )


@session_cache
def checkpoints(fmt: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(the `fmt` checkpoint, its spec values as a float32 checkpoint, weight name -> those
    values for each quantised layer)."""
    spec = FORMATS[fmt]
    src = tiny_model_dir(NAME)
    quant_dir, float_dir = make_tmp_dir(f"{fmt}-"), make_tmp_dir(f"{fmt}-float-")
    for d in (quant_dir, float_dir):
        shutil.rmtree(d)
        shutil.copytree(src, d)
    torch.manual_seed(0)
    quantised, floats, values = {}, {}, {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        if _quantised(name, tensor, spec.rows_of_8):
            parts, value = spec.write(tensor.float())
            base = name.removesuffix(".weight")
            quantised.update({f"{base}.{key}": t for key, t in parts.items()})
            floats[name] = values[name] = value
        else:
            quantised[name] = floats[name] = tensor
    assert len(values) >= 20
    save_file(quantised, os.path.join(quant_dir, "model.safetensors"))
    save_file(floats, os.path.join(float_dir, "model.safetensors"))
    with open(os.path.join(quant_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = spec.config
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return quant_dir, float_dir, values


def _layout_values(linear: Linear) -> torch.Tensor:
    """The float weight a loaded integer `Linear` holds, from its codes and scales."""
    from vllm_mamba.ops.grouped_linear import GroupedWeight

    if hasattr(linear, "grouped_op"):
        layout = GroupedWeight(
            linear.weight, linear.weight_scale, linear.weight_offset, linear.bits, linear.group
        )
    else:  # the engine's int4 (groups of 32, offset -8 scale, float16 scales)
        scales = linear.weight_scale.float()
        layout = GroupedWeight(linear.weight, scales, -8 * scales, 4, 32)
    return layout.dequantize()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_layers_hold_the_formats_values_in_integer_weights(fmt: str) -> None:
    quant_dir, _, values = checkpoints(fmt)
    model, _ = build_model(quant_dir, load_hf_config(quant_dir), torch.float32, torch.device("cpu"))
    linears = dict(model.named_modules())
    want_dtype = FORMATS[fmt].runs_as
    for name, value in values.items():
        linear = linears[name.removesuffix(".weight")]
        assert isinstance(linear, Linear), name
        if want_dtype is None:
            assert linear.weight.dtype == torch.float32, name
            assert torch.equal(linear.weight, value), name
        else:
            assert linear.weight.dtype == want_dtype, name
            assert torch.equal(_layout_values(linear), value), name


@pytest.mark.parametrize("fmt", GENERATED)
def test_generates_transformers_tokens_on_the_formats_values(fmt: str) -> None:
    quant_dir, float_dir, _ = checkpoints(fmt)
    token_prompts = [p["prompt_token_ids"] for p in prompts()[:3]]
    want = HfRunner(float_dir, hf_class(NAME)).generate_greedy_logprobs(token_prompts, 10)
    with VllmRunner(quant_dir, dtype="float32", max_num_seqs=3) as runner:
        got = runner.generate_greedy(prompts()[:3], 10)
    assert got == [tokens for tokens, _ in want]
    assert len({tuple(t) for t in got}) > 1


@pytest.mark.parametrize("fmt", ["fp8-blocks", "ct-mxfp4"])
def test_requantised_to_int8_equals_int8_of_the_formats_values(fmt: str) -> None:
    quant_dir, float_dir, _ = checkpoints(fmt)
    outs = []
    for path in (quant_dir, float_dir):
        with VllmRunner(path, dtype="float32", quantization="int8", max_num_seqs=4) as runner:
            outs.append(runner.generate_greedy(prompts()[:4], 12))
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("quant", "match"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}},
            },
            "format 'marlin-24'",
        ),  # fmt: skip
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int"}}
                },
            },
            "int 2-bit",
        ),  # fmt: skip
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "float", "symmetric": False},
                    }
                },
            },
            "symmetric false",
        ),  # fmt: skip
    ],
)
def test_unreadable_quantised_checkpoints_are_one_clear_error(quant, match) -> None:  # noqa: ANN001
    path = make_tmp_dir("prequantized-bad-")
    shutil.rmtree(path)
    shutil.copytree(checkpoints("fp8-blocks")[0], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=match):
        LLM(path)


@pytest.mark.parametrize(
    ("fmt", "dropped"),
    [("gptq-4bit-g32-asym-v1", "qzeros"), ("ct-w4a16-g32-asym", "weight_zero_point")],
)
def test_a_layer_without_one_of_its_tensors_is_one_clear_error(fmt: str, dropped: str) -> None:
    path = make_tmp_dir("prequantized-missing-")
    shutil.rmtree(path)
    shutil.copytree(checkpoints(fmt)[0], path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = f"model.layers.0.mlp.up_proj.{dropped}"
    del tensors[name]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=f"no {name.replace('.', '[.]')}"):
        build_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
