"""Tensor parallelism over 2 ranks (worker processes, gloo) gives what one rank gives.

Architectures: FalconMamba (Mamba's mixer by channels, with biases and an untied head),
Mamba2 with one group (replicated, the gated norm's variance all-reduced, an odd vocabulary)
and with two (one per rank), Bamba (GQA with KV heads split), Granite 4.0-H (MoE experts split
over their width, shared MLP), Nemotron-H (grouped-routing MoE, squared-ReLU MLP, MQA with the
KV head replicated), Falcon-H1 (muP sections, norm before the gate), Jamba (Mamba with
dt/B/C norms, GQA, MoE) and Zamba2 (shared attention blocks by heads with per-use LoRA
adapters split like their projections, two groups); and Mamba with int8 weights
(`tied+int8`: row-parallel layers take their whole rows' scales, the vocabulary-parallel
embedding reads the tied int8 head).

Per architecture, one engine with `tensor_parallel_size=2` and chunked prefill (16-token
budget) against one single-rank engine with whole prefills: the same greedy tokens, the same
sampled tokens of seeded forks (`n > 1`), log-probabilities (sampled and prompt) within
1e-3, and every state slot free afterwards on rank 0. Prefix caching is on in both: a
second turn hits the first one's snapshot (copied on every rank) and still matches.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.distributed.conftest import model_dir
from tests.helpers.prompts import make_prompts
from tests.helpers.runners import VllmRunner
from vllm_mamba import SamplingParams

MODELS = [
    "falcon-untied",
    "mamba2-g1",
    "mamba2-groups",
    "bamba-gqa",
    "granite-moe-rope",
    "nemotron-h-mqa-even",
    "falcon-h1-norm",
    "jamba-gqa",
    "zamba2-lora-rope",
    "tied+int8",
]
ATOL = 1e-3


@pytest.fixture(scope="module", params=MODELS)
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[VllmRunner, VllmRunner]]:
    """(single rank, 2 ranks with chunked prefill) on the same checkpoint."""
    name, _, quantization = request.param.partition("+")
    path = model_dir(name)
    kwargs = {"quantization": quantization or None, "enable_prefix_caching": True}
    one = VllmRunner(path, device="cpu", max_num_seqs=8, **kwargs)
    two = VllmRunner(
        path,
        device="cpu",
        max_num_seqs=8,
        max_num_batched_tokens=16,
        tensor_parallel_size=2,
        **kwargs,
    )
    try:
        yield one, two
    finally:
        two.engine.executor.shutdown()


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts()[1:5]]  # 2 to 31 tokens


def test_greedy_tokens_and_logprobs_match(engines: tuple[VllmRunner, VllmRunner]) -> None:
    one, two = engines
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    ref, got = one.generate(_prompts(), params), two.generate(_prompts(), params)
    assert len({tuple(o.outputs[0].token_ids) for o in ref}) == len(ref)  # varied outputs
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for rs, gs in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert rs.keys() == gs.keys()
            for t in rs:
                assert gs[t].logprob == pytest.approx(rs[t].logprob, abs=ATOL)
        for rs, gs in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            for t in rs:
                assert gs[t].logprob == pytest.approx(rs[t].logprob, abs=ATOL)
    two.assert_drained()


def test_seeded_forks_match(engines: tuple[VllmRunner, VllmRunner]) -> None:
    one, two = engines
    params = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=7)
    ref, got = one.generate(_prompts()[:3], params), two.generate(_prompts()[:3], params)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        for rc, gc in zip(r.outputs, g.outputs):
            assert gc.cumulative_logprob == pytest.approx(rc.cumulative_logprob, abs=ATOL)
    two.assert_drained()


def test_prefix_cache_hits_match(engines: tuple[VllmRunner, VllmRunner]) -> None:
    one, two = engines
    first = make_prompts()[5]  # 100 tokens: its end is snapshotted on every rank
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    for runner in (one, two):
        runner.generate([{"prompt_token_ids": first}], params)
    turn = [{"prompt_token_ids": first + [11, 12, 13]}]
    ref, got = one.generate(turn, params)[0], two.generate(turn, params)[0]
    assert got.num_cached_tokens == ref.num_cached_tokens > 0
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert got.outputs[0].cumulative_logprob == pytest.approx(
        ref.outputs[0].cumulative_logprob, abs=ATOL
    )
    two.assert_drained()
