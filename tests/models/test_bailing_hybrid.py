"""Ling 3 (`BailingHybridForCausalLM`) beyond the family suite: transformers' own names, the
multi-token prediction layers the checkpoints carry, and the SwiGLU clip.

`save_pretrained` writes the shipped names (`word_embeddings`, `attention.*` with `dense`,
`f_proj` / `A_log` / `dt_bias` under the layer, `q/k/v_conv1d`, `experts.E.*`,
`gate.expert_bias`); transformers' in-memory model holds `forget_gate.*`, one `conv1d` and
stacked experts. The releases store `num_nextn_predict_layers` MTP layers after the decoder
(`model.layers.{num_hidden_layers}.*`), which the engine skips. transformers 5.24 ignores the
per-layer SwiGLU limits (`expert_swiglu_limit_list`, `share_expert_swiglu_limit_list`);
5.25 clips after the activation, `min(act(g), l) * clamp(u, -l, l)`: the reference here is
5.24's model with that clip added to its expert loop and shared experts.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import MODEL_FAMILY, build_hf_model, copy_tokenizer, tiny_model_dir

NAME = "ling-moe"
pytestmark = pytest.mark.xdist_group("ling")  # the family's checkpoints and lone runs


def _greedy(path: str) -> list[list[int]]:
    with VllmRunner(path) as runner:
        return checks.tokens(runner.generate(checks.prompts(), checks.GREEDY))


def _checkpoint(tensors: dict[str, torch.Tensor]) -> str:
    """A checkpoint of `NAME`'s config and tokenizer with `tensors`."""
    path = make_tmp_dir("tiny-ling-")
    shutil.copy(os.path.join(tiny_model_dir(NAME), "config.json"), path)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(path)
    return path


def test_transformers_in_memory_names_give_the_same_tokens() -> None:
    state = build_hf_model(NAME).state_dict()
    assert any(".forget_gate." in k for k in state) and any(".conv1d." in k for k in state)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    assert _greedy(_checkpoint(state)) == checks.alone(tiny_model_dir(NAME))


def test_mtp_layer_weights_are_skipped() -> None:
    """The checkpoint's MTP layer (a decoder layer's tensors plus its own projections, at index
    `num_hidden_layers`) loads and changes nothing."""
    source = tiny_model_dir(NAME)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    layers = MODEL_FAMILY[NAME].configs[NAME]["num_hidden_layers"]
    last = f"model.layers.{layers - 1}."
    extra = {
        k.replace(last, f"model.layers.{layers}."): v.clone()
        for k, v in tensors.items()
        if k.startswith(last)
    }
    extra[f"model.layers.{layers}.eh_proj.weight"] = torch.randn(64, 128)
    extra[f"model.layers.{layers}.enorm.weight"] = torch.ones(64)
    assert _greedy(_checkpoint({**tensors, **extra})) == checks.alone(source)


def _clipped_experts(self: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):  # noqa: ANN202
    """transformers 5.24's expert loop with 5.25's clip after the activation."""
    out = torch.zeros_like(hidden)
    limit = self.limit
    for e in range(self.num_experts):
        tok, pos = torch.where(index == e)  # (T, k): token rows, top-k places
        if tok.numel() == 0:
            continue
        gate, up = F.linear(hidden[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
        gate = self.act_fn(gate)
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        y = F.linear(gate * up, self.down_proj[e]) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _clipped_mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.act_fn(self.gate_proj(x)), self.up_proj(x)
    limit = getattr(self, "limit", 0)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return self.down_proj(gate * up)


def test_swiglu_clip_matches_transformers_with_the_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf

    init = hf.BailingHybridDecoderLayer.__init__

    def layer_init(self: Any, config: Any, layer_idx: int) -> None:
        init(self, config, layer_idx)
        none = [0] * config.num_hidden_layers  # a config without the lists: no clip
        routed = (getattr(config, "expert_swiglu_limit_list", None) or none)[layer_idx]
        shared = (getattr(config, "share_expert_swiglu_limit_list", None) or none)[layer_idx]
        if isinstance(self.mlp, hf.BailingHybridMoE):
            self.mlp.experts.limit = routed
            self.mlp.shared_experts.limit = shared

    monkeypatch.setattr(hf.BailingHybridDecoderLayer, "__init__", layer_init)
    monkeypatch.setattr(hf.BailingHybridExperts, "forward", _clipped_experts)
    monkeypatch.setattr(hf.BailingHybridMLP, "forward", _clipped_mlp)
    checks.assert_matches_transformers("ling-clipped")
    # the same weights as ling-moe: the clip changes the tokens
    assert checks.alone(tiny_model_dir("ling-clipped")) != checks.alone(tiny_model_dir(NAME))
