"""LFM3 beyond the family suite: the layer plan read off the config (each attention kind's RoPE,
window and gate, as transformers builds them, for LFM3-1.7B's config and the tiny ones), and
the attention gate's two checkpoint names.

transformers holds the gate as `self_attn.g_proj` but saves it, as the released checkpoints
hold it, as `self_attn.gate_proj`; both must load into the same parameters. int8 weights (the
gate's projection too) and bfloat16 stay close to float32.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import tiny_configs as cfg
from tests.helpers.family_checks import teacher_forced
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models.lfm3 import Lfm3ForCausalLM
from vllm_mamba.ops.dispatch import get_mamba_ops

CPU = torch.device("cpu")
MAIN = "lfm3-gqa"
# As tests/models/test_lfm2.py: top-1 agreement with float32 at >= 75% of positions, the
# sequence's own token's logprob off by <= 0.4 on average (measured on lfm3-gqa: int8 89% and
# 0.11, bfloat16 96% and 0.05).
TOP1_AGREEMENT = 0.75
MEAN_LOGPROB_DIFF = 0.4


@pytest.mark.parametrize("variant", [None, *cfg.LFM3], ids=lambda v: v or "LFM3-1.7B")
def test_attention_layers_as_transformers(variant: str | None) -> None:
    """Per attention layer: transformers' inverse frequencies for its kind, its window (the
    config's for `sliding_attention`, none for `full_attention`) and the gate when configured."""
    import transformers

    fields = cfg.LFM3[variant] if variant else {}
    config = transformers.Lfm3Config(**fields)
    rotary = transformers.models.lfm3.modeling_lfm3.Lfm3RotaryEmbedding(config)
    with torch.device("meta"):
        model = Lfm3ForCausalLM(config, get_mamba_ops(CPU))
    kinds = list(config.layer_types)
    for kind, layer in zip(kinds, model.model.layers):
        if kind == "conv":
            assert layer.conv.kernel == config.conv_L_cache
            continue
        attn = layer.self_attn
        want = getattr(rotary, f"{kind}_inv_freq")
        torch.testing.assert_close(attn.rotary.freqs.inv_freq, want, rtol=0, atol=0)
        assert attn.rotary.rot_dim == attn.head_dim == config.head_dim
        window = config.sliding_window if kind == "sliding_attention" else 0
        assert attn.attn.sliding_window == window
        assert (attn.g_proj is not None) == config.use_attention_gate
    post_norms = [layer.part_names()["post_norm"] for layer in model.model.layers]
    assert post_norms == ["post_operator_norm" if config.use_sandwich_norm else None] * len(kinds)


def test_gate_checkpoint_names_load_alike() -> None:
    """A checkpoint naming the gate `g_proj` (transformers' module) loads as the saved
    `gate_proj` one."""
    source = tiny_model_dir(MAIN)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    assert any(".self_attn.gate_proj." in n for n in tensors)
    renamed = {
        n.replace(".self_attn.gate_proj.", ".self_attn.g_proj."): t for n, t in tensors.items()
    }
    path = make_tmp_dir("tiny-lfm3-g-proj-")
    shutil.copy(os.path.join(source, "config.json"), path)
    save_file(renamed, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    saved, _ = build_model(source, load_hf_config(source), torch.float32, CPU)
    held, _ = build_model(path, load_hf_config(path), torch.float32, CPU)
    want = dict(saved.named_parameters())
    assert any(".self_attn.g_proj." in n for n in want)
    for name, param in held.named_parameters():
        assert torch.equal(param, want[name]), name


def test_int8_and_bfloat16_stay_close_to_float32() -> None:
    want_top1, want_own = teacher_forced(tiny_model_dir(MAIN))
    for engine in ({"quantization": "int8"}, {"dtype": "bfloat16"}):
        top1, own = teacher_forced(tiny_model_dir(MAIN), **engine)
        agreement = sum(a == b for a, b in zip(top1, want_top1)) / len(top1)
        assert agreement >= TOP1_AGREEMENT, (engine, agreement)
        assert (own - want_own).abs().mean() <= MEAN_LOGPROB_DIFF, engine
