"""Lara-4-Mini beyond the family suite: its checkpoints' fused GDN input projection and its
router's float32 logits.

The checkpoints (and transformers' `save_pretrained`) hold each GDN layer's input projections
as one `in_proj` (rows `[q | k | v | z | b | a]`) and its gated norm as `out_norm`; loaded, every
GDN parameter must equal the one transformers split and renamed on its own load. The router
computes its logits from float32 inputs and weights: on bfloat16 activations it must choose and
weight the experts exactly as transformers' router does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LaraMiniConfig
from transformers.models.lara_mini.modeling_lara_mini import LaraMiniTopKRouter

from tests.tiny_models import build_hf_model, tiny_model_dir
from vllm_mamba.layers.moe import ExpertRouter, RouterConfig
from vllm_mamba.model_loader import build_model, load_hf_config


@pytest.mark.parametrize("name", ["lara-mini-gqa", "lara-mini-mqa"])
def test_fused_in_proj_loads_as_transformers_splits_it(name: str) -> None:
    path = tiny_model_dir(name)
    model, _ = build_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    want = dict(build_hf_model(name).named_parameters())
    gdn = [(n, p) for n, p in model.named_parameters() if ".linear_attn." in n]
    assert {n.rsplit(".", 2)[-2] for n, _ in gdn} >= {
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "conv1d", "out_proj"
    }  # fmt: skip
    for n, p in gdn:
        assert torch.equal(p, want[n]), n


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_logits_are_float32_on_bfloat16(renormalize: bool) -> None:
    hidden, experts, top_k = 64, 16, 4
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(experts, hidden, generator=g).bfloat16()
    x = torch.randn(64, hidden, generator=g).bfloat16()  # (T, H)
    hf_config = LaraMiniConfig(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=renormalize,
    )  # fmt: skip
    reference = LaraMiniTopKRouter(hf_config).bfloat16()
    reference.weight.data.copy_(weight)
    route = RouterConfig("softmax_topk", experts, top_k, renormalize=renormalize,
                         float32_logits=True)  # fmt: skip
    router = ExpertRouter(hidden, route).bfloat16()
    router.weight.data.copy_(weight)
    _, want_weights, want_chosen = reference(x)
    weights, chosen = router(x)
    assert torch.equal(chosen, want_chosen)
    assert torch.equal(weights.to(x.dtype), want_weights)  # the MoE casts them so
