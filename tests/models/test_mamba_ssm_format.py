"""Checkpoints in the original mamba-ssm format run like their Hugging Face twins."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tiny_configs import MAMBA, MAMBA2
from tests.tiny_models import TOKENIZER_DIR, build_hf_model, tiny_model_dir
from vllm_mamba.model_loader import load_hf_config
from vllm_mamba.models.mamba_ssm_format import convert_mamba_ssm_config

# config.json of state-spaces/mamba-130m and state-spaces/mamba2-130m.
MAMBA_130M = {
    "d_model": 768,
    "n_layer": 24,
    "vocab_size": 50277,
    "ssm_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 8,
}
MAMBA2_130M = {
    "d_model": 768,
    "d_intermediate": 0,
    "n_layer": 24,
    "vocab_size": 50277,
    "ssm_cfg": {"layer": "Mamba2"},
    "attn_layer_idx": [],
    "attn_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 16,
    "tie_embeddings": True,
}


def save_mamba_ssm_format(model, raw_config: dict, path: str) -> str:
    """Writes `model` (a transformers Mamba / Mamba2) as mamba-ssm's `save_pretrained` does."""
    os.makedirs(path, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        state[name.replace("backbone.embeddings.", "backbone.embedding.")] = tensor.clone()
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()  # saved even when tied
    torch.save(state, os.path.join(path, "pytorch_model.bin"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw_config, f)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


def test_130m_configs_convert() -> None:
    m1 = convert_mamba_ssm_config(MAMBA_130M)
    assert m1.architectures == ["MambaForCausalLM"]
    assert (m1.hidden_size, m1.num_hidden_layers, m1.vocab_size) == (768, 24, 50280)
    assert (m1.intermediate_size, m1.state_size, m1.time_step_rank) == (1536, 16, 48)
    assert m1.tie_word_embeddings and m1.residual_in_fp32 and m1.use_conv_bias
    m2 = convert_mamba_ssm_config(MAMBA2_130M)
    assert m2.architectures == ["Mamba2ForCausalLM"]
    assert (m2.vocab_size, m2.num_heads, m2.head_dim, m2.state_size) == (50288, 24, 64, 128)
    assert (m2.n_groups, m2.chunk_size, m2.conv_kernel) == (1, 256, 4)
    assert m2.tie_word_embeddings and not m2.use_bias


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"rms_norm": False}, "rms_norm"),
        ({"attn_layer_idx": [3]}, "attn_layer_idx"),
        ({"d_intermediate": 1024}, "d_intermediate"),
        ({"ssm_cfg": {"layer": "Mamba2", "norm_before_gate": True}}, "gated RMSNorm"),
        ({"ssm_cfg": {"layer": "Mamba2", "d_ssm": 512}}, "d_ssm"),
        ({"ssm_cfg": {"layer": "Mamba3"}}, "Mamba3"),
        ({"ssm_cfg": {"layer": "Mamba2", "new_knob": 1}}, "new_knob"),
    ],
)
def test_unsupported_options_are_rejected(edit: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        convert_mamba_ssm_config(dict(MAMBA2_130M, **edit))


def _greedy(path: str) -> list[list[int]]:
    """The greedy tokens of every prompt, in one batch."""
    with VllmRunner(path) as runner:
        return checks.tokens(runner.generate(checks.prompts(), checks.GREEDY))


def _mamba1_twin(tmp_path) -> tuple[str, str]:
    """The tiny "tied" Mamba in both formats."""
    cfg = MAMBA["tied"]
    raw = dict(
        MAMBA_130M,
        d_model=cfg["hidden_size"],
        n_layer=cfg["num_hidden_layers"],
        ssm_cfg={"d_state": cfg["state_size"], "d_conv": cfg["conv_kernel"], "expand": 2},
    )
    orig = save_mamba_ssm_format(build_hf_model("tied"), raw, str(tmp_path / "mamba1"))
    return orig, tiny_model_dir("tied")


def _mamba2_twin(tmp_path) -> tuple[str, str]:
    """The tiny "mamba2-tied" Mamba2 in both formats."""
    cfg = MAMBA2["mamba2-tied"]
    raw = dict(
        MAMBA2_130M,
        d_model=cfg["hidden_size"],
        n_layer=cfg["num_hidden_layers"],
        residual_in_fp32=cfg["residual_in_fp32"],
        ssm_cfg={
            "layer": "Mamba2",
            "d_state": cfg["state_size"],
            "d_conv": cfg["conv_kernel"],
            "expand": cfg["expand"],
            "headdim": cfg["head_dim"],
            "ngroups": cfg["n_groups"],
            "chunk_size": cfg["chunk_size"],
            "bias": cfg["use_bias"],
            "conv_bias": cfg["use_conv_bias"],
            "dt_min": 0.001,
        },
    )
    model = build_hf_model("mamba2-tied")
    orig = save_mamba_ssm_format(model, raw, str(tmp_path / "mamba2"))
    return orig, tiny_model_dir("mamba2-tied")


@pytest.mark.parametrize("twin", [_mamba1_twin, _mamba2_twin], ids=["mamba1", "mamba2"])
def test_original_format_gives_same_tokens_as_hf_twin(twin, tmp_path) -> None:
    orig, hf = twin(tmp_path)
    converted, hf_config = load_hf_config(orig), load_hf_config(hf)
    for key in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
        assert getattr(converted, key) == getattr(hf_config, key)
    assert "backbone.embedding.weight" in torch.load(
        os.path.join(orig, "pytorch_model.bin"), weights_only=True
    )
    want, got = _greedy(hf), _greedy(orig)
    assert all(len(set(t)) >= 10 for t in want), want
    assert got == want


def test_tokenizerless_checkpoint_takes_gpt_neox_from_hub_cache(tmp_path, monkeypatch) -> None:
    """Like `state-spaces/mamba-130m`: no tokenizer files, so GPT-NeoX-20B's comes from the hub."""
    import huggingface_hub.constants as hf_constants

    orig, hf = _mamba1_twin(tmp_path)
    for file in os.listdir(orig):
        if file.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(orig, file))
    cache = tmp_path / "hub"
    repo = cache / "models--EleutherAI--gpt-neox-20b"
    commit = "0" * 40
    shutil.copytree(TOKENIZER_DIR, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    want = _greedy(hf)
    with VllmRunner(orig) as runner:
        assert runner.engine.config.model_config.tokenizer.startswith(str(cache))
        assert checks.tokens(runner.generate(checks.prompts(), checks.GREEDY)) == want
