"""OLMo Hybrid's checkpoints beyond the family suite: the GDN convs in both saved layouts.

transformers holds a GDN layer's three convs as one `conv1d.weight` (`[q | k | v]` rows) and
saves it back as three equal thirds named `q_conv1d`, `k_conv1d`, `v_conv1d`; the released
checkpoints hold the three at their own sizes (`Hk Dk`, `Hk Dk`, `Hv Dv` rows). Both must load
into the same parameters, whose rows are transformers' `conv1d.weight`. The released layout is
written here from the transformers-saved one, also with the attention layers' post-attention
norm under transformers' own name (`post_attention_layernorm`) instead of the saved
`feedforward_layer_norm`, which the loader must take too.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import MODEL_FAMILY, hf_class, tiny_model_dir
from vllm_mamba.model_loader import build_model, load_hf_config


def _released_layout(source: str, name: str) -> str:
    """`source`'s checkpoint with the convs at their sizes and the attention norms renamed."""
    config = MODEL_FAMILY[name].configs[name]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    tensors = load_file(os.path.join(source, "model.safetensors"))
    released = {}
    for tname, tensor in tensors.items():
        if tname.endswith(".k_conv1d.weight") or tname.endswith(".v_conv1d.weight"):
            continue
        if tname.endswith(".q_conv1d.weight"):
            prefix = tname[: -len("q_conv1d.weight")]
            whole = torch.cat([tensors[f"{prefix}{w}_conv1d.weight"] for w in "qkv"])
            assert tensor.shape[0] != key_dim  # saved as thirds, not at the real size
            for w, part in zip("qkv", whole.split([key_dim, key_dim, value_dim])):
                released[f"{prefix}{w}_conv1d.weight"] = part.clone()
            continue
        layer = tname.split(".")[2] if tname.startswith("model.layers.") else None
        is_attention = layer is not None and config["layer_types"][int(layer)] == "full_attention"
        if is_attention and ".feedforward_layer_norm." in tname:
            tname = tname.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")
        released[tname] = tensor
    path = make_tmp_dir(f"tiny-{name}-released-")
    shutil.copy(os.path.join(source, "config.json"), path)
    save_file(released, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("name", ["olmo-hybrid-rope", "olmo-hybrid-nope"])
def test_both_conv_layouts_load_as_transformers(name: str) -> None:
    import transformers

    source = tiny_model_dir(name)
    cpu = torch.device("cpu")
    saved, _ = build_model(source, load_hf_config(source), torch.float32, cpu)
    released_path = _released_layout(source, name)
    released, _ = build_model(released_path, load_hf_config(released_path), torch.float32, cpu)
    saved_params = dict(saved.named_parameters())
    for pname, param in released.named_parameters():
        assert torch.equal(param, saved_params[pname]), pname
    hf = getattr(transformers, hf_class(name)).from_pretrained(source, dtype=torch.float32)
    for index, layer in enumerate(hf.model.layers):
        if not hasattr(layer, "linear_attn"):
            continue
        gdn = saved.layers[index].linear_attn
        convs = [getattr(gdn, f"{w}_conv1d").weight for w in "qkv"]
        assert torch.equal(torch.cat(convs), layer.linear_attn.conv1d.weight), index
