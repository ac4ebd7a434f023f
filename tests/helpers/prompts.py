"""The token-id prompts of the model comparisons: eight lengths from 1 to 131 tokens."""

from __future__ import annotations

import torch

PROMPT_LENS = [1, 2, 5, 13, 31, 64, 100, 131]
MAX_TOKENS = 32  # tokens generated per prompt in the comparisons with transformers


def make_prompts(vocab: int = 50277) -> list[list[int]]:
    """Eight token-id prompts of 1 to 131 tokens, from a fixed seed."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def token_prompts() -> list[dict]:
    """`make_prompts()` as `LLM.generate` inputs."""
    return [{"prompt_token_ids": p} for p in make_prompts()]
