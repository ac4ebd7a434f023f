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
from vllm_mamba.config import record_quantization
from vllm_mamba.layers.quantization import quantize_model
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models import layer_stream
from vllm_mamba.models.layer_stream import LayerStream
from vllm_mamba.ops.dispatch import get_mamba_ops

CPU = torch.device("cpu")


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
    finished = []
    real_loaded = LayerStream.loaded

    def loaded(self: LayerStream, param: str) -> None:
        before = len(self.reports)
        real_loaded(self, param)
        if len(self.reports) > before:  # a layer completed: no other layer is live and float
            finished.append(param)

    monkeypatch.setattr(LayerStream, "loaded", loaded)
    hf_config = load_hf_config(path)
    record_quantization(hf_config, method)
    streamed, _ = build_model(path, hf_config, torch.float32, CPU)
    assert len(finished) == len(streamed.layers)  # every decoder layer went through the stream

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
