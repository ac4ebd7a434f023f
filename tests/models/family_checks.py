"""Checks shared by the tests of every model family: transformers parity and invariances.

Each family's test module calls these on its tiny checkpoints (`tests.tiny_models`), so every
model is held to the same table: greedy tokens equal to transformers with varied references,
close logprobs, batching invariance, chunked prefill equal to whole prefill, `n > 1` forks
and no state slot left in use.
"""

from __future__ import annotations

import functools

import torch

from tests.models.test_mamba_vs_transformers import MAX_TOKENS, make_prompts
from vllm_mamba import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20)


@functools.cache
def hf_reference(cls_name: str, path: str) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and per-step log-softmax `(steps, V)` from transformers, prompt by prompt."""
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(path).eval()
    refs = []
    for prompt in make_prompts():
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        refs.append((tokens, torch.stack(out.scores)[:, 0].float().log_softmax(-1)))
    return refs


def assert_matches_transformers(cls_name: str, path: str) -> None:
    """Greedy tokens equal, top-5 logprobs within 1e-4 (abs + rel), references varied."""
    refs = hf_reference(cls_name, path)
    ref_tokens = [t for t, _ in refs]
    # A model that repeats itself proves nothing: the references must be varied.
    assert all(len(set(t)) >= MAX_TOKENS // 2 for t in ref_tokens), ref_tokens
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    outs = LLM(path).generate(prompts(), params, use_tqdm=False)
    for out, (tokens, ref_lp) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for step, entry in enumerate(got.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
            ref_top = ref_lp[step].topk(5)
            assert [t for t, _ in top] == ref_top.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([lp.logprob for _, lp in top]), ref_top.values, rtol=1e-4, atol=1e-4
            )


def prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts()]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def engine(path: str, **kwargs) -> LLM:
    return LLM(path, **kwargs)


@functools.cache
def alone(path: str) -> list[list[int]]:
    """Each prompt run by itself, 20 greedy tokens."""
    return [tokens(engine(path).generate(p, GREEDY, use_tqdm=False))[0] for p in prompts()]


def assert_batched_equals_alone(path: str) -> None:
    """All prompts in one batch, then queued through two slots; every slot freed after."""
    assert tokens(engine(path).generate(prompts(), GREEDY, use_tqdm=False)) == alone(path)
    llm = engine(path, max_num_seqs=2)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == alone(path)
    assert llm.llm_engine.scheduler.slots.num_used == 0


def assert_chunked_equals_whole(path: str, budget: int) -> None:
    """Prefills cut into chunks of at most `budget` tokens (several sequences per step)."""
    llm = engine(path, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts()[2:8], GREEDY, use_tqdm=False)) == alone(path)[2:8]
    assert llm.llm_engine.scheduler.slots.num_used == 0


def assert_forks_equal_alone(path: str) -> None:
    """Greedy `n = 3` gives three copies of the lone run; the forked slots are freed."""
    llm = engine(path, max_num_seqs=4)
    out = llm.generate(prompts()[5], SamplingParams(temperature=0, max_tokens=20, n=3))[0]
    assert [o.token_ids for o in out.outputs] == [alone(path)[5]] * 3
    sampled = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=3)
    first = llm.generate(prompts()[3], sampled, use_tqdm=False)[0]
    again = llm.generate([prompts()[0], prompts()[3]], [GREEDY, sampled], use_tqdm=False)[1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    sched = llm.llm_engine.scheduler
    assert sched.slots.num_used == 0 and not sched.running and not sched.waiting


def assert_gpu_graphs_equal_eager_and_cpu(path: str, dtype: str) -> None:
    """On CUDA: decode through CUDA graphs equals eager; float32 matches the CPU tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    graph_llm = LLM(path, dtype=dtype, max_num_seqs=16, device="cuda")
    assert graph_llm.llm_engine.runner.cuda_graphs is not None
    eager_llm = LLM(path, dtype=dtype, max_num_seqs=16, device="cuda", enforce_eager=True)
    graph = graph_llm.generate(prompts()[:5], params, use_tqdm=False)
    eager = eager_llm.generate(prompts()[:5], params, use_tqdm=False)
    assert tokens(graph) == tokens(eager)
    if dtype == "float32":
        cpu = LLM(path, max_num_seqs=16, device="cpu").generate(prompts()[:5], params)
        same = sum(g == c for g, c in zip(tokens(graph), tokens(cpu)))
        assert same >= 4  # GPU float32 matmuls may flip one near-tie
