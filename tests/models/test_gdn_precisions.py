"""The Gated DeltaNet hybrids (and Kimi Linear's KDA, the same rule with a per-channel decay, and
RWKV-7, the generalised delta rule) at lower precisions, against the same engine in float32.

Teacher-forced (`prompt_logprobs` over the same token sequences, so one early difference does
not change every later position):

- `ssm_state_dtype="bfloat16"`: the recurrent state is stored in bfloat16. A prompt prefilled
  in one step never reads its stored state back, so the prompts are prefilled in chunks of 8
  tokens: every chunk starts from the rounded state. Measured on these models: top-1 agreement
  99.4-100%, mean |logprob difference| 1.3e-4 to 1.7e-3, worst 0.024.
- `dtype="bfloat16"`: weights and activations in bfloat16 (the state stays float32). Measured:
  88-93% top-1 agreement and a mean difference of 0.025-0.056 on these random models, whose
  logits are nearly flat over 50k tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

MODELS = ["qwen3_5-gqa", "qwen3-next-moe", "olmo-hybrid-rope", "kimi-linear-moe", "rwkv7-h64"]
CHUNK = 8  # prefill chunk of the state-dtype check


def _sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 50000, (n,), generator=g).tolist() for n in (9, 50, 120)]


@functools.cache
def _teacher_forced(name: str, **kwargs: object) -> tuple[list[int], torch.Tensor, list]:
    """Top-1 token and the sequence token's log-probability at every position, and the
    engine's recurrent state dtypes."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    seqs = _sequences()
    with VllmRunner(tiny_model_dir(name), max_num_seqs=4, **kwargs) as runner:
        outs = runner.generate([{"prompt_token_ids": s} for s in seqs], params)
        state_dtypes = runner.engine.cache.state_dtypes()
    top1, own = [], []
    for seq, out in zip(seqs, outs):
        for pos in range(1, len(seq)):
            entry = out.prompt_logprobs[pos]
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            own.append(entry[seq[pos]].logprob)
    return top1, torch.tensor(own, dtype=torch.float64), state_dtypes


def _compare(name: str, **kwargs: object) -> tuple[float, torch.Tensor]:
    base_top1, base_lp, _ = _teacher_forced(name, max_num_batched_tokens=CHUNK)
    top1, lp, _ = _teacher_forced(name, max_num_batched_tokens=CHUNK, **kwargs)
    agree = sum(a == b for a, b in zip(base_top1, top1)) / len(top1)
    return agree, (lp - base_lp).abs()


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_state_close_to_float32_state(name: str) -> None:
    assert _teacher_forced(name, max_num_batched_tokens=CHUNK)[2] == [torch.float32]
    _, _, dtypes = _teacher_forced(name, max_num_batched_tokens=CHUNK, ssm_state_dtype="bfloat16")
    assert dtypes == [torch.bfloat16]
    agree, diff = _compare(name, ssm_state_dtype="bfloat16")
    assert diff.max() > 0, "the bfloat16 state was never read back"
    assert agree >= 0.97 and diff.mean() <= 0.01 and diff.max() <= 0.1, (agree, diff)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_model_close_to_float32(name: str) -> None:
    agree, diff = _compare(name, dtype="bfloat16")
    assert agree >= 0.8 and diff.mean() <= 0.15, (agree, diff.mean())
