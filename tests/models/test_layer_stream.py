"""Load-time quantisation one decoder layer at a time (`vllm_mamba.models.layer_stream`).

The reference is the whole-model path (build the float model, process it, then
`quantize_model`): the streamed model's every parameter and buffer is bit-for-bit the same, for
families whose layers transform their weights after loading (Qwen3-Next reorders rows, the
Gated DeltaNet and Mamba precompute conv filters), with a tied and an untied head, int8 and
int4. Models whose layers share modules (Zamba2's shared block) are not streamed.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import tiny_model_dir
from vllm_mamba import model_loader
from vllm_mamba.config import record_quantization
from vllm_mamba.layers.moe import ExpertList
from vllm_mamba.layers.quantization import quantize_model
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models import layer_stream
from vllm_mamba.models.layer_stream import LayerStream
from vllm_mamba.ops.dispatch import get_mamba_ops

CPU = torch.device("cpu")


def _holds_float(unit: torch.nn.Module) -> bool:
    """Whether `unit` holds materialised float weights (loaded, not yet quantised)."""
    return any(p.device.type != "meta" and p.is_floating_point() for p in unit.parameters())


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize(
    ("name", "method"),
    [("qwen3-next-moe", "int4"), ("qwen3_5-gqa", "int8"), ("mamba2-groups", "int4"),
     ("jamba-gqa", "int8"), ("tied", "int4"), ("lfm2-gqa", "int4")],
)  # fmt: skip
def test_streamed_layers_equal_the_whole_model_path(
    name: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_dir(name)
    quantised: list[str] = []  # what the stream quantised, by name, in order
    floats: list[int] = []  # after each tensor: the experts holding float weights
    real_loaded, real_quantize = LayerStream.loaded, model_loader.quantize_model

    def quantize(module: torch.nn.Module, ops: object, method: str, prefix: str = "") -> object:
        quantised.append(prefix)
        return real_quantize(module, ops, method, prefix)

    def loaded(self: LayerStream, param: str) -> None:
        real_loaded(self, param)
        floats.append(sum(_holds_float(u) for p, u in self._units if p != "lm_head."))

    monkeypatch.setattr(LayerStream, "loaded", loaded)
    monkeypatch.setattr(model_loader, "quantize_model", quantize)
    hf_config = load_hf_config(path)
    record_quantization(hf_config, method)
    streamed, _ = build_model(path, hf_config, torch.float32, CPU)
    layers = [n for n, m in streamed.named_modules() if any(m is la for la in streamed.layers)]
    # every decoder layer went through the stream, each expert before its layer, alone
    assert [n for n in quantised if n in layers] == layers
    experts = [n for n, m in streamed.named_modules() if isinstance(m, ExpertList)]
    for prefix in experts:
        units = [n for n in quantised if n.startswith(prefix + ".")]
        assert len(units) == len(streamed.get_submodule(prefix)), prefix
        assert quantised.index(units[-1]) < quantised.index(prefix.rsplit(".", 2)[0]), prefix
    assert max(floats) <= 1
    # an untied head is quantised as it arrives, a tied one with the embedding at the end
    head = streamed.lm_head
    tied = any(
        getattr(m, "weight", None) is head.weight for m in streamed.modules() if m is not head
    )
    assert ("lm_head" in quantised) == (not tied), tied

    reference, _ = build_model(path, load_hf_config(path), torch.float32, CPU)
    quantize_model(reference, get_mamba_ops(CPU), method)
    got, want = _state(streamed), _state(reference)
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_layers_sharing_a_module_load_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dir("zamba2-lora-rope")
    hf_config = load_hf_config(path)
    record_quantization(hf_config, "int8")
    built = []
    monkeypatch.setattr(layer_stream.LayerStream, "__init__", lambda *a: built.append(a))
    model, _ = build_model(path, hf_config, torch.float32, CPU)
    assert not built and LayerStream.of(model) is None
    assert all(p.device.type == "cpu" for p in model.parameters())
