"""Tiny checkpoints and helpers of the tensor-parallel tests (2 ranks, gloo on the CPU).

The Mamba and FalconMamba checkpoints are those of `tests.tiny_models`; Mamba2 comes in two
shapes whose heads split over 2 ranks: `n_groups` 2 (each rank holds one group) and
`n_groups` 1 (the group is replicated and the gated norm's statistics are all-reduced), the
latter with biases, a tied head and an odd vocabulary (the last vocabulary shard is padded).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import torch

from tests.tiny_models import TOKENIZER_DIR, other_model_dir, tiny_model_dir

MAMBA2_G1 = dict(
    hidden_size=48,
    num_hidden_layers=2,
    expand=2,
    num_heads=4,
    head_dim=24,
    n_groups=1,
    state_size=8,
    conv_kernel=3,
    chunk_size=8,
    use_bias=True,
    use_conv_bias=True,
    residual_in_fp32=False,
    tie_word_embeddings=True,
    vocab_size=50277,
)


@functools.cache
def mamba2_g1_dir() -> str:
    """Saves the `n_groups` 1 Mamba2 (varied random weights, as `tests.tiny_models`)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(**MAMBA2_G1, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = Mamba2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith(("A_log", ".D")) or "norm" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = tempfile.mkdtemp(prefix="tiny-mamba2-g1-")
    model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


def model_dir(name: str) -> str:
    """The checkpoint directory of a tensor-parallel test model."""
    if name in ("tied", "untied"):
        return tiny_model_dir(name)
    if name == "mamba2-g1":
        return mamba2_g1_dir()
    return other_model_dir(name)
