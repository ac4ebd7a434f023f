"""MiniMax-Text-01 beyond the family suite: the lightning layers' slopes and the checkpoints'
names.

The slopes are computed from the config, as transformers computes them; the checkpoints carry
them (and the block decays derived from them) as buffers, which are not loaded, so a checkpoint
with or without them gives the same tokens. transformers' in-memory model holds the experts
stacked under `mlp.*` (`mlp.experts.gate_up_proj`, `down_proj`) where `save_pretrained` writes
the shipped names (`block_sparse_moe.*`, `experts.E.w1/w2/w3`); both load.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import build_hf_model, copy_tokenizer, tiny_model_dir
from vllm_mamba.layers.lightning_attention import lightning_slopes

NAME = "minimax-full-top2"
DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


@pytest.mark.parametrize(("heads", "layers"), [(4, 5), (64, 80), (6, 2)])
def test_slopes_equal_transformers(heads: int, layers: int) -> None:
    """Bit for bit, every layer (the first decays most, the last barely)."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = MiniMaxConfig(
        hidden_size=2 * heads, num_attention_heads=heads, num_hidden_layers=layers, head_dim=2
    )
    for index in range(layers):
        want = MiniMaxLightningAttention(config, index).slope_rate.view(-1)
        got = lightning_slopes(heads, index, layers)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _greedy(tensors: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy tokens of `NAME`'s config with the checkpoint `tensors`."""
    path = make_tmp_dir("tiny-minimax-names-")
    shutil.copy(os.path.join(tiny_model_dir(NAME), "config.json"), path)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(path)
    with VllmRunner(path) as runner:
        return checks.tokens(runner.generate(checks.prompts(), checks.GREEDY))


def test_transformers_in_memory_names_give_the_same_tokens() -> None:
    state = build_hf_model(NAME).state_dict()
    assert any(k.endswith(".mlp.experts.gate_up_proj") for k in state)
    assert any(k.endswith(".self_attn.slope_rate") for k in state)
    assert _greedy(state) == checks.alone(tiny_model_dir(NAME))


def test_checkpoint_without_the_derived_buffers_gives_the_same_tokens() -> None:
    source = tiny_model_dir(NAME)
    saved = load_file(os.path.join(source, "model.safetensors"))
    assert any(k.endswith(".block_sparse_moe.experts.0.w1.weight") for k in saved)
    kept = {k: v for k, v in saved.items() if k.rpartition(".")[2] not in DERIVED}
    assert len(kept) < len(saved)
    assert _greedy(kept) == checks.alone(source)
