"""Checks shared by the tests of every model family: transformers parity and invariances.

Each family's test module calls these on its tiny checkpoints (`tests.tiny_models`), so every
model is held to the same table: greedy tokens equal to transformers with varied references,
close logprobs, batching invariance, chunked prefill equal to whole prefill, `n > 1` forks
and no state slot left in use (`VllmRunner` checks it when its block ends).
"""

from __future__ import annotations

import functools

import torch

from tests.helpers.prompts import MAX_TOKENS, make_prompts
from tests.helpers.runners import HfRunner, VllmRunner
from vllm_mamba import LLM, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20)


@functools.cache
def hf_reference(cls_name: str, path: str) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and per-step log-softmax `(steps, V)` from transformers, prompt by prompt."""
    return HfRunner(path, cls_name).generate_greedy_logprobs(make_prompts(), MAX_TOKENS)


def assert_matches_transformers(cls_name: str, path: str) -> None:
    """Greedy tokens equal, top-5 logprobs within 1e-4 (abs + rel), references varied."""
    refs = hf_reference(cls_name, path)
    ref_tokens = [t for t, _ in refs]
    # A model that repeats itself proves nothing: the references must be varied.
    assert all(len(set(t)) >= MAX_TOKENS // 2 for t in ref_tokens), ref_tokens
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    with VllmRunner(path) as runner:
        outs = runner.generate(prompts(), params)
    for out, (tokens, ref_lp) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert len(got.logprobs) == len(tokens)
        for step, entry in enumerate(got.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
            ref_top = ref_lp[step].topk(5)
            assert [t for t, _ in top] == ref_top.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([lp.logprob for _, lp in top]), ref_top.values, rtol=1e-4, atol=1e-4
            )


def prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts()]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def engine(path: str, **kwargs) -> LLM:  # noqa: ANN003 - LLM's keyword arguments
    """A fresh engine on `path`."""
    return LLM(path, **kwargs)


@functools.cache
def alone(path: str) -> list[list[int]]:
    """Each prompt run by itself, 20 greedy tokens."""
    with VllmRunner(path) as runner:
        return [tokens(runner.generate(p, GREEDY))[0] for p in prompts()]


def assert_batched_equals_alone(path: str) -> None:
    """All prompts in one batch, then queued through two slots; every slot freed after."""
    with VllmRunner(path) as runner:
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(path)
    with VllmRunner(path, max_num_seqs=2) as runner:
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(path)


def assert_chunked_equals_whole(path: str, budget: int) -> None:
    """Prefills cut into chunks of at most `budget` tokens (several sequences per step)."""
    with VllmRunner(path, max_num_batched_tokens=budget) as runner:
        assert tokens(runner.generate(prompts()[2:8], GREEDY)) == alone(path)[2:8]


def assert_forks_equal_alone(path: str) -> None:
    """Greedy `n = 3` gives three copies of the lone run; the forked slots are freed."""
    sampled = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=3)
    with VllmRunner(path, max_num_seqs=4) as runner:
        out = runner.generate(prompts()[5], SamplingParams(temperature=0, max_tokens=20, n=3))[0]
        first = runner.generate(prompts()[3], sampled)[0]
        again = runner.generate([prompts()[0], prompts()[3]], [GREEDY, sampled])[1]
    assert [o.token_ids for o in out.outputs] == [alone(path)[5]] * 3
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def assert_gpu_graphs_equal_eager_and_cpu(path: str, dtype: str) -> None:
    """On CUDA: decode through CUDA graphs equals eager; float32 matches the CPU tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    with (
        VllmRunner(path, dtype=dtype, max_num_seqs=16, device="cuda") as graph_runner,
        VllmRunner(path, dtype=dtype, max_num_seqs=16, device="cuda", enforce_eager=True) as eager,
    ):
        assert graph_runner.engine.runner.cuda_graphs is not None
        graph = tokens(graph_runner.generate(prompts()[:5], params))
        assert graph == tokens(eager.generate(prompts()[:5], params))
    if dtype == "float32":
        with VllmRunner(path, max_num_seqs=16, device="cpu") as cpu_runner:
            cpu = tokens(cpu_runner.generate(prompts()[:5], params))
        same = sum(g == c for g, c in zip(graph, cpu))
        assert same >= 4  # GPU float32 matmuls may flip one near-tie
