"""LFM2 and LFM2-MoE beyond the family suite: the checkpoints' expert layouts, the config
fields the engine derives or requires, and the reduced precisions.

transformers holds LFM2-MoE's experts fused (`experts.gate_up_proj (E, 2F, H)`, `[w1 | w3]`
rows, and `experts.down_proj (E, H, F)`) but saves them, as the released checkpoints hold them,
one by one (`experts.E.w1`, `w2`, `w3`); both layouts must load into the same parameters, the
ones transformers' fused tensors hold. LFM2-MoE's config has no default `layer_types`, so a
checkpoint without it is refused by name. LFM2's SwiGLU width is derived from
`intermediate_size` as transformers derives it. int8 weights and bfloat16 stay close to
float32 on both families.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.family_checks import teacher_forced
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import hf_class, tiny_model_dir
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models.lfm2 import dense_ffn_size

MOE = "lfm2-moe-top2"
CPU = torch.device("cpu")
# Random tiny models, as tests/engine/test_int8.py holds the other families: top-1 agreement
# with float32 at >= 75% of positions, the sequence's own token's logprob off by <= 0.4 on
# average (measured: int8 91% and 0.08 on lfm2-gqa, 88% and 0.06 on lfm2-moe-top2; bfloat16
# 98% and 0.04, 96% and 0.04).
TOP1_AGREEMENT = 0.75
MEAN_LOGPROB_DIFF = 0.4


def _copy_with(source: str, prefix: str, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """A checkpoint directory holding `tensors` and `config`."""
    path = make_tmp_dir(prefix)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _fused_experts(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert tensors (`experts.E.w1/w2/w3.weight`) stacked as transformers holds them."""
    fused, experts = {}, {}
    for name, tensor in per_expert.items():
        head, sep, tail = name.partition(".feed_forward.experts.")
        if not sep:
            fused[name] = tensor
            continue
        index, kind = tail.split(".")[:2]  # "E", "w1" / "w2" / "w3"
        experts.setdefault(head, {}).setdefault(kind, {})[int(index)] = tensor
    for head, kinds in experts.items():

        def stack(kind: str, parts: dict = kinds) -> torch.Tensor:
            return torch.stack([parts[kind][e] for e in sorted(parts[kind])])

        fused[f"{head}.feed_forward.experts.gate_up_proj"] = torch.cat(
            [stack("w1"), stack("w3")], 1
        )
        fused[f"{head}.feed_forward.experts.down_proj"] = stack("w2")
    return fused


def test_per_expert_and_fused_checkpoints_load_as_transformers() -> None:
    import transformers

    source = tiny_model_dir(MOE)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    assert any(".feed_forward.experts.0.w1." in n for n in tensors)  # saved one by one
    fused = _fused_experts(tensors)
    assert any(n.endswith("experts.gate_up_proj") for n in fused) and len(fused) < len(tensors)
    path = _copy_with(source, "tiny-lfm2-moe-fused-", fused, _config(source))
    per_expert, _ = build_model(source, load_hf_config(source), torch.float32, CPU)
    from_fused, _ = build_model(path, load_hf_config(path), torch.float32, CPU)
    want = dict(per_expert.named_parameters())
    for name, param in from_fused.named_parameters():
        assert torch.equal(param, want[name]), name
    hf = getattr(transformers, hf_class(MOE)).from_pretrained(source, dtype=torch.float32)
    for index, layer in enumerate(hf.model.layers):
        block = layer.feed_forward
        if not hasattr(block, "experts"):
            continue
        ours = per_expert.layers[index].feed_forward
        assert torch.equal(ours.gate.e_score_correction_bias, block.expert_bias)
        for e, expert in enumerate(ours.experts):
            gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight])
            assert torch.equal(gate_up, block.experts.gate_up_proj[e]), (index, e)
            assert torch.equal(expert.down_proj.weight, block.experts.down_proj[e]), (index, e)


def test_moe_checkpoint_without_layer_types_is_refused() -> None:
    source = tiny_model_dir(MOE)
    config = {k: v for k, v in _config(source).items() if k != "layer_types"}
    path = make_tmp_dir("tiny-lfm2-moe-no-layer-types-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(source, "model.safetensors"), path)
    with pytest.raises(ValueError, match="layer_types"):
        build_model(path, load_hf_config(path), torch.float32, CPU)


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        # LFM2-350M and LFM2-1.2B as released: 2/3, times 1.0, up to a multiple of 256.
        (dict(intermediate_size=6656, block_ffn_dim_multiplier=1.0, block_multiple_of=256), 4608),
        (dict(intermediate_size=12288, block_ffn_dim_multiplier=1.0, block_multiple_of=256), 8192),
        (dict(intermediate_size=144, block_ffn_dim_multiplier=None, block_multiple_of=32), 96),
    ],
)
def test_dense_ffn_size_as_transformers(fields: dict, want: int) -> None:
    config = SimpleNamespace(block_auto_adjust_ff_dim=True, **fields)
    assert dense_ffn_size(config) == want
    config.block_auto_adjust_ff_dim = False
    assert dense_ffn_size(config) == fields["intermediate_size"]


@pytest.mark.parametrize("engine", [{"quantization": "int8"}, {"dtype": "bfloat16"}], ids=str)
@pytest.mark.parametrize("name", ["lfm2-gqa", MOE])
def test_int8_and_bfloat16_close_to_float(name: str, engine: dict) -> None:
    path = tiny_model_dir(name)
    top_f, lp_f = teacher_forced(path)
    top_q, lp_q = teacher_forced(path, **engine)
    agree = sum(a == b for a, b in zip(top_f, top_q)) / len(top_f)
    diff = float((lp_f - lp_q).abs().mean())
    assert agree >= TOP1_AGREEMENT and diff <= MEAN_LOGPROB_DIFF, (agree, diff)
