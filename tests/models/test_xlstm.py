"""xLSTM beyond the family suite: the fused checkpoint layout and the widths of the release.

transformers 5.24 cannot build or load an xLSTM with `weight_mode="fused"` (its weight
initialisation indexes the stacked gate bias with the wrong length and raises), so the fused
layout is checked against the single one: the tiny checkpoint's projections stacked as the
fused names (`qkv_opreact`, `ifgate_preact`, `proj_up_gate_z`, weights and biases) give the
same tokens and logprobs as the checkpoint they came from, which the family suite compares
with transformers.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import copy_tokenizer, tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.models.xlstm import XLSTMForCausalLM, ffn_size
from vllm_mamba.ops.table import bind_ops

NAME = "xlstm-bias"  # biases on every projection: the fused biases are split too
# fused name -> the single names it stacks, in row order
STACKS = {
    "mlstm_layer.qkv_opreact": ("q", "k", "v", "ogate_preact"),
    "mlstm_layer.ifgate_preact": ("igate_preact", "fgate_preact"),
    "ffn.proj_up_gate_z": ("proj_up_gate", "proj_up"),
}


def _fused(single: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`single`'s tensors with each block's projections stacked under the fused names."""
    fused = dict(single)
    for name in single:
        match = re.fullmatch(r"(backbone\.blocks\.\d+)\.mlstm_layer\.q\.(weight|bias)", name)
        if match is None:
            continue
        block, kind = match.groups()
        for stacked, parts in STACKS.items():
            stem = f"{block}.{stacked.split('.')[0]}"
            rows = [fused.pop(f"{stem}.{p}.{kind}") for p in parts]
            fused[f"{block}.{stacked}.{kind}"] = torch.cat(rows).contiguous()
    return fused


def test_fused_checkpoint_equals_single() -> None:
    source = tiny_model_dir(NAME)
    single = load_file(os.path.join(source, "model.safetensors"))
    fused = _fused(single)
    assert "backbone.blocks.1.mlstm_layer.qkv_opreact.bias" in fused
    assert not any(".q." in k or "proj_up." in k for k in fused)
    path = make_tmp_dir("tiny-xlstm-fused-")
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "weight_mode": "fused"}, f)
    save_file(fused, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(path)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    outs = []
    for model in (source, path):
        with VllmRunner(model) as runner:
            outs.append(runner.generate(checks.prompts(), params))
    for got, want in zip(*outs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


def test_widths_of_xlstm_7b() -> None:
    """xLSTM-7B's config (transformers' defaults, one block, built on the meta device): heads
    of 256 / 512, a feed-forward of 10944 (4096 x 2.667 rounded to 64); the tie flag set is
    ignored, as transformers ignores it."""
    from transformers import xLSTMConfig

    config = xLSTMConfig(num_hidden_layers=1, tie_word_embeddings=True)
    with torch.device("meta"):
        model = XLSTMForCausalLM(config, bind_ops("ref"))
    block = model.layers[0]
    assert block.mlstm_layer.state_spec().tensors[0].shape == (8, 256, 512)
    assert tuple(block.ffn.gate_proj.weight.shape) == (10944, 4096) == (ffn_size(config), 4096)
    assert model.lm_head.weight is not model.stack.token_embedding.weight
