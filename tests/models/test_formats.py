"""The checkpoint-format registry (`vllm_mamba.models.formats`): detection of each built-in
format, the errors for an unknown or bad directory, and a plugin's own format loading end to
end through the generic loader."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import ModelRegistry
from vllm_mamba.model_loader import iterate_weights, load_hf_config
from vllm_mamba.models import formats
from vllm_mamba.models.formats import (
    HF_FORMAT,
    CheckpointFormat,
    detect_format,
    register_format,
    registered_formats,
)

PROMPTS = ["Hello world", "The quick brown fox"]

MAMBA_SSM_CONFIG = {
    "d_model": 64,
    "n_layer": 2,
    "vocab_size": 100,
    "ssm_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 8,
}


@pytest.fixture
def isolated_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(formats, "_formats", list(formats._formats))


def test_builtin_formats_are_registered_in_order() -> None:
    names = [f.name for f in registered_formats()]
    assert names[:2] == ["mamba_ssm", "rwkv7_pth"]
    assert HF_FORMAT not in registered_formats()  # the fallback, tried last


def test_hugging_face_directory() -> None:
    path = tiny_model_dir("tied")
    assert detect_format(path) is HF_FORMAT
    assert load_hf_config(path).architectures == ["MambaForCausalLM"]


def test_mamba_ssm_directory(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(json.dumps(MAMBA_SSM_CONFIG))
    fmt = detect_format(str(tmp_path))
    assert fmt.name == "mamba_ssm"
    assert fmt.default_tokenizer == "EleutherAI/gpt-neox-20b"
    config = load_hf_config(str(tmp_path))
    assert config.architectures == ["MambaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 104)


def test_rwkv7_pth_directory() -> None:
    path = tiny_model_dir("rwkv7-h32", "pth")
    fmt = detect_format(path)
    assert fmt.name == "rwkv7_pth"
    names = {name for name, _ in iterate_weights(path)}
    assert "model.embeddings.weight" in names  # BlinkDL's emb.weight, renamed by the format
    assert not any(n.startswith("blocks.") for n in names)


def test_unknown_directory_names_the_formats_tried(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config\.json.*mamba-ssm.*RWKV-7 \(one \.pth"):
        detect_format(str(tmp_path))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_bad_config_json_is_a_value_error(tmp_path, text: str) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json is not"):
        load_hf_config(str(tmp_path))


def test_a_format_that_refuses_the_directory(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "a.pth").write_bytes(b"")
    (tmp_path / "b.pth").write_bytes(b"")
    with pytest.raises(ValueError, match="several .pth checkpoints"):
        detect_format(str(tmp_path))


def test_registration_errors(isolated_formats: None) -> None:
    with pytest.raises(ValueError, match="package.module:ATTRIBUTE"):
        register_format("no_colon_here")
    with pytest.raises(ValueError, match="already registered"):
        register_format("vllm_mamba.models.mamba_ssm_format:FORMAT")
    with pytest.raises(ValueError, match="'mamba_ssm' is already registered"):
        register_format(type(registered_formats()[0])())
    with pytest.raises(TypeError, match="not a CheckpointFormat"):
        register_format(object())  # type: ignore[arg-type]


def test_own_config_classes_are_declared_by_the_registry() -> None:
    from vllm_mamba.models.rwkv7 import Rwkv7Config

    assert ModelRegistry.resolve_config_cls("rwkv7") is Rwkv7Config
    assert ModelRegistry.resolve_config_cls("mamba") is None  # transformers' own


class PrefixedFormat(CheckpointFormat):
    """A plugin's format: its config in `my_config.json`, its tensors in `weights.pt` under
    `my.` + the Hugging Face names."""

    name = "test_prefixed"
    description = "test (my_config.json, weights.pt)"

    def detect(self, path: str, raw: dict[str, Any] | None) -> bool:
        return os.path.isfile(os.path.join(path, "my_config.json"))

    def load_config(self, path: str, raw: dict[str, Any] | None) -> Any:
        from transformers import MambaConfig

        return MambaConfig.from_json_file(os.path.join(path, "my_config.json"))

    def weight_files(self, path: str) -> tuple[list[str], str]:
        return [os.path.join(path, "weights.pt")], "pt"

    def read_file(self, file: str, kind: str, lazy: bool) -> Iterator[tuple[str, Any]]:
        assert kind == "pt"
        yield from torch.load(file, weights_only=True).items()

    def convert_weight(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        return [(name.removeprefix("my."), tensor)]


def test_plugin_format_loads_through_the_generic_loader(tmp_path, isolated_formats: None) -> None:  # noqa: ANN001
    src = tiny_model_dir("tied")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    os.rename(tmp_path / "config.json", tmp_path / "my_config.json")
    weights = load_file(os.path.join(src, "model.safetensors"))
    torch.save({f"my.{k}": v for k, v in weights.items()}, tmp_path / "weights.pt")
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        detect_format(str(tmp_path))
    register_format(PrefixedFormat())
    assert detect_format(str(tmp_path)).name == "test_prefixed"
    with VllmRunner(str(tmp_path)) as runner:
        got = runner.generate_greedy(PROMPTS, 12)
    with VllmRunner(src) as runner:
        want = runner.generate_greedy(PROMPTS, 12)
    assert got == want
