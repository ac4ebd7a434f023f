"""GLM-5-Next and Qwen4-Exp beyond the family suite: the names their checkpoints come in.

`save_pretrained` writes the released names (GLM: `hc_attn_fn`, `self_attn.f_a_proj`,
`q/k/v_conv1d`, per-expert tensors; Qwen4-Exp: the n-gram tables in `split_ngram_parts` shards
and the hash constants); transformers' in-memory models hold `attn_hc.fn`, `forget_gate.*`,
one `conv1d`, stacked experts and whole n-gram tables, which load too. Qwen4-Exp's image-text
release (`Qwen4ExpForConditionalGeneration`, `model.language_model.*` beside a vision tower)
serves its language model; a checkpoint missing an n-gram shard is refused by name.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import build_hf_model, copy_tokenizer, tiny_model_dir

QWEN4 = "qwen4-exp-ple"


def _greedy(path: str) -> list[list[int]]:
    with VllmRunner(path) as runner:
        return checks.tokens(runner.generate(checks.prompts(), checks.GREEDY))


def _checkpoint(name: str, tensors: dict[str, torch.Tensor], config: dict | None = None) -> str:
    """A checkpoint of `name`'s config (or `config`) and tokenizer with `tensors`."""
    path = make_tmp_dir(f"tiny-{name}-")
    if config is None:
        shutil.copy(os.path.join(tiny_model_dir(name), "config.json"), path)
    else:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(path)
    return path


@pytest.mark.parametrize("name", ["glm5-next-moe", QWEN4])
def test_transformers_in_memory_names_give_the_same_tokens(name: str) -> None:
    state = build_hf_model(name).state_dict()
    if name == QWEN4:
        assert any(k.endswith("ngram_embedding.weight") for k in state)
    else:
        assert any(".attn_hc.fn" in k for k in state) and any(".forget_gate." in k for k in state)
    assert _greedy(_checkpoint(name, state)) == checks.alone(tiny_model_dir(name))


def test_qwen4_image_text_release_serves_its_language_model() -> None:
    """The causal checkpoint's tensors under `model.language_model.*` beside a vision tower,
    with the image-text config, give the causal checkpoint's tokens."""
    import transformers

    source = tiny_model_dir(QWEN4)
    with open(os.path.join(source, "config.json")) as f:
        text = json.load(f)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    config = transformers.Qwen4ExpConfig(text_config=text, vision_config=vision).to_dict()
    config["architectures"] = ["Qwen4ExpForConditionalGeneration"]
    tensors = {
        (k if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v
        for k, v in load_file(os.path.join(source, "model.safetensors")).items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(32, 3, 2, 16, 16)
    assert _greedy(_checkpoint(QWEN4, tensors, config)) == checks.alone(source)


def test_qwen4_missing_ngram_shard_is_refused() -> None:
    tensors = load_file(os.path.join(tiny_model_dir(QWEN4), "model.safetensors"))
    shard = next(k for k in tensors if k.endswith("ngram_embedding.shard_1.weight"))
    del tensors[shard]
    with pytest.raises(ValueError, match="split_ngram_parts"):
        _greedy(_checkpoint(QWEN4, tensors))
