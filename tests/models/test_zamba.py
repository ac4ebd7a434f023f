"""What is Zamba v1's own beyond the family checks (`tests/models/test_families.py`): one
shared attention block reused at several depths, with one KV cache layer per use (and, untied,
one block per use); both checkpoint layouts of the tied block (stored once, or under every
use); the multi-head Mamba state per head; config errors that name their field."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba.layers.multihead_mamba_mixer import MultiHeadMambaMixer
from vllm_mamba.model_loader import load_hf_config
from vllm_mamba.models.zamba import ZambaForCausalLM
from vllm_mamba.ops.dispatch import get_mamba_ops

TIED = "zamba-mha-tied"  # hybrid at 2, 4 and 6 over one block; 4 Mamba heads of 32
UNTIED = "zamba-gqa-untied"  # hybrid at 0, 3 and 4, each with its own copy of the block


def _hybrid_layers(runner: VllmRunner) -> list[torch.nn.Module]:
    model = runner.engine.executor.model
    return [layer for layer in model.model.layers if hasattr(layer, "shared_transf")]


@pytest.mark.parametrize(("name", "shared"), [(TIED, True), (UNTIED, False)])
def test_each_use_of_the_block_has_its_own_kv_layer(name: str, shared: bool) -> None:
    """Three hybrid layers: one block when tied (three otherwise), always three KV layers."""
    with VllmRunner(tiny_model_dir(name)) as runner:
        hybrid = _hybrid_layers(runner)
        assert len(hybrid) == 3
        blocks = {id(layer.shared_transf) for layer in hybrid}
        assert len(blocks) == (1 if shared else 3)
        assert len({id(layer.attn.kv.k) for layer in hybrid}) == 3
        assert len({id(layer.attn.kv.v) for layer in hybrid}) == 3


def test_mamba_state_is_kept_per_head() -> None:
    """Each Mamba layer keeps `ssm (heads, head dim, state)` per sequence, as transformers."""
    with VllmRunner(tiny_model_dir(TIED)) as runner:
        model = runner.engine.executor.model
        mixers = [m for m in model.modules() if isinstance(m, MultiHeadMambaMixer)]
        assert len(mixers) == 7
        for mixer in mixers:
            assert mixer.state["ssm"].shape[1:] == (4, 32, 16)
            assert mixer.state["conv"].shape[1:] == (128, 3)


def test_checkpoint_with_every_use_copied_loads_the_same() -> None:
    """A tied checkpoint may store the block under each use (tied copies), not only the
    first."""
    src = tiny_model_dir(TIED)
    weights = load_file(os.path.join(src, "model.safetensors"))
    first = "model.layers.2.shared_transf."
    copies = {
        f"model.layers.{i}.shared_transf.{k[len(first) :]}": v.clone()
        for i in (4, 6)
        for k, v in weights.items()
        if k.startswith(first)
    }
    assert copies and not any(k in weights for k in copies)
    path = make_tmp_dir("tiny-zamba-copies-")
    for file in os.listdir(src):
        if file != "model.safetensors":
            shutil.copy(os.path.join(src, file), path)
    save_file({**weights, **copies}, os.path.join(path, "model.safetensors"))
    prompts = checks.prompts()[:4]
    with VllmRunner(path) as runner:
        assert checks.tokens(runner.generate(prompts, checks.GREEDY)) == checks.alone(src)[:4]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(hidden_mamba_act="gelu"), "hidden_mamba_act"),
        (dict(hidden_act="quick_gelu"), "hidden_act"),
        (dict(attention_head_dim=16), "attention_head_dim"),
        (dict(attention_hidden_size=64), "attention_hidden_size"),
        (dict(n_mamba_heads=3), "n_mamba_heads"),
        (dict(layers_block_type=["mamba", "attention"] * 3 + ["mamba"]), "layers_block_type"),
    ],
)
def test_bad_config_names_the_field(change: dict, field: str) -> None:
    config = load_hf_config(tiny_model_dir(TIED))
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=field), torch.device("meta"):
        ZambaForCausalLM(config, get_mamba_ops(torch.device("cpu")))
