"""Qwen3-Next beyond the family suite: where the MoE sits, and the released checkpoints' MTP head.

The layers with the MoE (`decoder_sparse_step`, `mlp_only_layers`, `num_experts`) must be the
ones transformers builds it on, over plans the tiny variants do not cover; a checkpoint that
ships a multi-token prediction head (`mtp.*`, as the releases do) must load with those tensors
skipped (one log line) into the same parameters as the checkpoint without them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.logs import captured
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models.qwen3_next import is_moe_layer


@pytest.mark.parametrize(
    ("sparse_step", "mlp_only", "num_experts"),
    [(1, [], 4), (2, [], 4), (2, [3], 4), (3, [0, 2], 4), (1, [], 0)],
)
def test_moe_layers_are_transformers(
    sparse_step: int, mlp_only: list[int], num_experts: int
) -> None:
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    config = transformers.Qwen3NextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
        linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=num_experts, num_experts_per_tok=1, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, decoder_sparse_step=sparse_step,
        mlp_only_layers=mlp_only,
    )  # fmt: skip
    model = transformers.Qwen3NextModel(config)
    want = [isinstance(layer.mlp, Qwen3NextSparseMoeBlock) for layer in model.layers]
    assert [is_moe_layer(config, i) for i in range(6)] == want


def test_mtp_head_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    source = tiny_model_dir("qwen3-next-moe")
    path = make_tmp_dir("tiny-qwen3-next-mtp-")
    shutil.copy(os.path.join(source, "config.json"), path)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)  # the releases' MTP head
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cpu = torch.device("cpu")
    want, _ = build_model(source, load_hf_config(source), torch.float32, cpu)
    with captured(caplog, "vllm_mamba.model_loader"):
        got, _ = build_model(path, load_hf_config(path), torch.float32, cpu)
    skipped = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skipped) == 1 and "2 checkpoint tensors under 'mtp.'" in skipped[0]
    want_params = dict(want.named_parameters())
    for name, param in got.named_parameters():
        assert torch.equal(param, want_params[name]), name
