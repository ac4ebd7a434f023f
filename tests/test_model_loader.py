"""Loading checkpoints: formats, tied heads, hub ids from the cache, skipped MTP layers, and bad
checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.logs import captured
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, ModelRegistry, SamplingParams
from vllm_mamba.model_loader import build_model, load_hf_config

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ["Hello world", "The quick brown fox"]


def run(path: str) -> list[list[int]]:
    with VllmRunner(path) as runner:
        return runner.generate_greedy(PROMPTS, 12)


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_sharded_and_bin_equal_single_file(name: str) -> None:
    want = run(tiny_model_dir(name))
    sharded = tiny_model_dir(name, "sharded")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert run(sharded) == want
    binary = tiny_model_dir(name, "bin")
    assert os.path.isfile(os.path.join(binary, "pytorch_model.bin"))
    assert run(binary) == want


def test_tied_head_present_in_checkpoint_is_accepted(tmp_path) -> None:
    src = tiny_model_dir("tied")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights["lm_head.weight"] = weights["backbone.embeddings.weight"].clone()
    save_file(weights, os.path.join(tmp_path, "model.safetensors"))
    assert run(str(tmp_path)) == run(src)


def _copy_with_weights(tmp_path, edit) -> str:
    src = tiny_model_dir("untied")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))
    edit(weights)
    save_file(weights, os.path.join(tmp_path, "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda w: w.pop("backbone.layers.1.mixer.x_proj.weight"),
            "missing.*layers.1.mixer.x_proj",
        ),
        (lambda w: w.__setitem__("backbone.extra.weight", torch.zeros(2)), "unexpected.*extra"),
        (
            lambda w: w.__setitem__("backbone.norm_f.weight", torch.ones(7)),
            r"misshaped.*norm_f.weight.*\(7,\)",
        ),
        (lambda w: w.pop("lm_head.weight"), "missing.*lm_head.weight"),
    ],
)
def test_bad_checkpoint_names_the_tensors(tmp_path, edit, match: str) -> None:
    path = _copy_with_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        LLM(path)


def test_directory_without_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture_lists_supported(tmp_path) -> None:
    shutil.copytree(tiny_model_dir("tied"), tmp_path, dirs_exist_ok=True)
    config_file = os.path.join(tmp_path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["NotARealModel"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="NotARealModel.*MambaForCausalLM"):
        LLM(str(tmp_path))


def test_register_out_of_tree_model(tmp_path) -> None:
    """A plugin architecture served by a registered "module:Class" string."""
    shutil.copytree(tiny_model_dir("tied"), tmp_path, dirs_exist_ok=True)
    config_file = os.path.join(tmp_path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["MyPluginMamba"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    ModelRegistry.register_model("MyPluginMamba", "vllm_mamba.models.mamba:MambaForCausalLM")
    assert "MyPluginMamba" in ModelRegistry.get_supported_archs()
    assert run(str(tmp_path)) == run(tiny_model_dir("tied"))


def test_hub_id_from_offline_cache(tmp_path, monkeypatch) -> None:
    """`org/name` resolves through huggingface_hub's cache with HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    repo = cache / "models--state-spaces--tiny-mamba-test"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_model_dir("tied"), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert run("state-spaces/tiny-mamba-test") == run(tiny_model_dir("tied"))
    with pytest.raises(FileNotFoundError, match="state-spaces/not-in-cache"):
        LLM("state-spaces/not-in-cache")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dtype_option(dtype: str) -> None:
    with VllmRunner(tiny_model_dir("tied"), dtype=dtype) as runner:
        assert runner.engine.model.lm_head.weight.dtype == getattr(torch, dtype)
        out = runner.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model_dir("tied"), dtype="int8")


@pytest.mark.parametrize("name", ["qwen3-next-moe", "nemotron-h-moe"])
def test_mtp_layers_are_skipped(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint that ships its multi-token prediction layers (`mtp.*`: Qwen3-Next's and
    Nemotron 3's releases) loads with those tensors skipped (one log line) into the same
    parameters as the checkpoint without them."""
    source = tiny_model_dir(name)
    path = make_tmp_dir(f"tiny-{name}-mtp-")
    shutil.copy(os.path.join(source, "config.json"), path)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    tensors["mtp.layers.0.eh_proj.weight"] = torch.randn(64, 128)  # as the releases name them
    tensors["mtp.layers.0.enorm.weight"] = torch.randn(64)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cpu = torch.device("cpu")
    want, _ = build_model(source, load_hf_config(source), torch.float32, cpu)
    with captured(caplog, "vllm_mamba.model_loader"):
        got, _ = build_model(path, load_hf_config(path), torch.float32, cpu)
    skipped = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skipped) == 1 and "2 checkpoint tensors under 'mtp.'" in skipped[0]
    want_params = dict(want.named_parameters())
    for param_name, param in got.named_parameters():
        assert torch.equal(param, want_params[param_name]), param_name
