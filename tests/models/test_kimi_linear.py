"""Kimi Linear beyond the family suite: the checkpoints' own config and transformers' own names.

The released `config.json` lists the layers in `linear_attn_config` (1-indexed
`full_attn_layers` / `kda_layers`) and the dense ones by `first_k_dense_replace`, with no
`layer_types` / `mlp_layer_types`; transformers' in-memory model holds the KDA layer's forget
gate under `forget_gate.*`, its three convs as one `conv1d.weight` and the experts stacked
(`mlp.experts.gate_up_proj`, `down_proj`). Both must give the tokens of the checkpoint
`save_pretrained` writes (the shipped names: `block_sparse_moe`, `experts.E.w1/w2/w3`,
`q_conv1d` ...). Options of the released config this engine does not implement are refused.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import MODEL_FAMILY, build_hf_model, copy_tokenizer, tiny_model_dir

NAME = "kimi-linear-moe"


def _with_config(source: str, edit: dict, drop: tuple[str, ...] = ()) -> str:
    """A copy of checkpoint `source` whose config.json has `edit` and lacks `drop`."""
    path = make_tmp_dir("tiny-kimi-config-")
    for file in os.listdir(source):
        shutil.copy(os.path.join(source, file), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for key in drop:
        config.pop(key, None)
    config.update(edit)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _greedy(path: str) -> list[list[int]]:
    with VllmRunner(path) as runner:
        return checks.tokens(runner.generate(checks.prompts(), checks.GREEDY))


def test_released_config_layout_gives_the_same_tokens() -> None:
    source = tiny_model_dir(NAME)
    types = MODEL_FAMILY[NAME].configs[NAME]["layer_types"]
    released = {
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        "first_k_dense_replace": 1,
        "moe_router_activation_func": "sigmoid",
        "mla_use_nope": True,
    }
    path = _with_config(source, released, drop=("layer_types", "mlp_layer_types"))
    assert _greedy(path) == checks.alone(source)


def test_transformers_in_memory_names_give_the_same_tokens() -> None:
    source = tiny_model_dir(NAME)
    state = build_hf_model(NAME).state_dict()
    assert any(".forget_gate." in k for k in state) and any(".conv1d." in k for k in state)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    path = make_tmp_dir("tiny-kimi-fused-")
    shutil.copy(os.path.join(source, "config.json"), path)
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(path)
    assert _greedy(path) == checks.alone(source)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ],
)
def test_unsupported_options_are_refused(edit: dict, field: str) -> None:
    from vllm_mamba import LLM

    path = _with_config(tiny_model_dir(NAME), edit)
    with pytest.raises(ValueError, match=field):
        LLM(path)
