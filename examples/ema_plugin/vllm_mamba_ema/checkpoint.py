"""Writes a tiny random EMA checkpoint: `config.json`, `model.safetensors` and a tokenizer.

Weights are drawn from N(0, std^2) with a fixed seed (norm weights stay ones), so greedy
generations are varied rather than one repeated token.
"""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import save_file

from vllm_mamba_ema.configuration import EmaConfig


def random_weights(config: EmaConfig, seed: int = 0, std: float = 0.4) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name (no `lm_head.weight` when tied)."""
    g = torch.Generator().manual_seed(seed)
    H, C, F_, V = config.hidden_size, config.ema_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.mixer.in_proj.weight": (2 * C, H),
            f"{p}.mixer.decay": (C,),
            f"{p}.mixer.lag_weight": (2, C),
            f"{p}.mixer.out_proj.weight": (H, C),
            f"{p}.mlp.gate_proj.weight": (F_, H),
            f"{p}.mlp.up_proj.weight": (F_, H),
            f"{p}.mlp.down_proj.weight": (H, F_),
        }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    weights = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.endswith("decay") else std  # a = sigmoid(decay) spread over (0, 1)
        weights[name] = torch.randn(shape, generator=g) * scale
    for i in range(config.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = torch.ones(H)
    weights["model.norm.weight"] = torch.ones(config.hidden_size)
    return weights


def write_tiny_checkpoint(
    path: str, tokenizer_dir: str, config: EmaConfig | None = None, seed: int = 0
) -> str:
    """Saves a seeded random model and copies the tokenizer files of `tokenizer_dir`.

    Returns:
        `path`.
    """
    config = config or EmaConfig()
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in random_weights(config, seed).items()},
              os.path.join(path, "model.safetensors"))  # fmt: skip
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path
