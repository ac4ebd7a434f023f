"""`transformers` as the reference for the server's numbers: the tiny model and its tokenizer
loaded from the directory the server serves, float32 log-softmax, greedy continuation.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def hf_model(model_dir: str):  # noqa: ANN201 - a transformers model
    """The `MambaForCausalLM` in `model_dir`, float32, eval mode."""
    from transformers import MambaForCausalLM

    return MambaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def hf_tokenizer(model_dir: str):  # noqa: ANN201 - a transformers tokenizer
    """The tokenizer in `model_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """`(len(ids), vocab)`: row i is log p(. | ids[: i + 1])."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def hf_greedy(model_dir: str, ids: list[int], max_tokens: int) -> list[int]:
    """`ids` followed by `max_tokens` greedy tokens."""
    ids = list(ids)
    for _ in range(max_tokens):
        ids.append(int(hf_logprobs(model_dir, ids)[-1].argmax()))
    return ids
