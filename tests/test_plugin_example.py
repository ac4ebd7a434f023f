"""The example plugin (`examples/ema_plugin`) runs through the engine unchanged.

Its model has a recurrent layer of its own state shape (`ema (C,)`, `last (2, C)`) with
`_ref`-only ops. Checked through `vllm_mamba.LLM` on the CPU: greedy tokens equal to the
plugin's independent full-sequence reference (and varied), batching, chunked prefill at odd
budgets, forks, preemption by recompute and prefix caching each equal to the plain run, and
every state slot free after draining (`VllmRunner` checks it on leaving each block).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import TOKENIZER_DIR
from vllm_mamba import RequestOutput, SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "ema_plugin"))

import vllm_mamba_ema  # noqa: E402
from vllm_mamba_ema.ops import ema_scan_varlen_ref, ema_state_update_ref  # noqa: E402

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a small dragon who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A state-space model keeps a fixed-size state per sequence, so memory does not grow with "
    "the number of tokens it has read, and decoding costs the same at every step.",
]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    vllm_mamba_ema.register()
    return vllm_mamba_ema.write_tiny_checkpoint(str(tmp_path_factory.mktemp("ema")), TOKENIZER_DIR)


@pytest.fixture(scope="module")
def runner(model_dir: str) -> Iterator[VllmRunner]:
    with VllmRunner(model_dir, device="cpu") as r:
        yield r


@pytest.fixture(scope="module")
def alone(runner: VllmRunner) -> list[list[int]]:
    """Each prompt by itself through the engine."""
    return [tokens(runner.generate(p, GREEDY))[0] for p in PROMPTS]


def test_ops_skip_pad_rows() -> None:
    """PAD_SLOT_ID rows and chunks are neither read nor written; real rows are unaffected."""
    g = torch.Generator().manual_seed(0)
    C, S = 4, 3
    a, w = torch.rand(C, generator=g), torch.randn(2, C, generator=g)
    ema, last = torch.randn(S, C, generator=g), torch.randn(S, 2, C, generator=g)
    ema0, last0 = ema.clone(), last.clone()
    u = torch.randn(2, C, generator=g)
    out = ema_state_update_ref(u, a, w, ema, last, torch.tensor([PAD_SLOT_ID, 1]))
    assert torch.equal(out[0], torch.zeros(C))
    assert torch.equal(ema[[0, 2]], ema0[[0, 2]]) and torch.equal(last[[0, 2]], last0[[0, 2]])
    assert torch.allclose(ema[1], a * ema0[1] + (1 - a) * u[1])
    u = torch.randn(5, C, generator=g)
    qsl, slots = torch.tensor([0, 2, 5]), torch.tensor([2, PAD_SLOT_ID])
    out = ema_scan_varlen_ref(u, a, w, ema, last, qsl, slots, torch.tensor([False, True]))
    assert torch.equal(out[2:], torch.zeros(3, C)) and out[:2].abs().sum() > 0
    assert torch.equal(ema[0], ema0[0]) and torch.equal(last[0], last0[0])
    assert torch.equal(last[2, 0], u[1]) and torch.equal(last[2, 1], u[0])


def test_greedy_equals_reference_and_is_varied(runner, model_dir, alone) -> None:
    ref_model = vllm_mamba_ema.EmaReference(
        model_dir, vllm_mamba_ema.EmaConfig.from_pretrained(model_dir)
    )
    tok = runner.llm.get_tokenizer()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # prompts of different lengths
    refs = [ref_model.greedy(i, MAX_TOKENS) for i in ids]
    assert all(len(set(r)) >= MAX_TOKENS // 2 for r in refs), refs
    assert len({tuple(r) for r in refs}) == len(refs)
    assert alone == refs


def test_batched_equals_alone(runner, model_dir, alone) -> None:
    assert tokens(runner.generate(PROMPTS, GREEDY)) == alone
    with VllmRunner(model_dir, device="cpu", max_num_seqs=2) as two_slots:
        assert tokens(two_slots.generate(PROMPTS, GREEDY)) == alone


@pytest.mark.parametrize("budget", [1, 5])
def test_chunked_prefill_equals_whole(model_dir, alone, budget: int) -> None:
    with VllmRunner(model_dir, device="cpu", max_num_batched_tokens=budget) as chunked:
        assert tokens(chunked.generate(PROMPTS[1:], GREEDY)) == alone[1:]


def test_forks_equal_independent_runs(runner, alone) -> None:
    greedy3 = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=3, ignore_eos=True)
    out = runner.generate(PROMPTS[2], greedy3)[0]
    assert [o.token_ids for o in out.outputs] == [alone[2]] * 3
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=3, seed=3, ignore_eos=True)
    first = runner.generate(PROMPTS[3], sampled)[0]
    again = runner.generate([PROMPTS[0], PROMPTS[3]], [GREEDY, sampled])[1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_preemption_equals_no_preemption(runner, alone) -> None:
    """Preemption by recompute, forced as tests/engine/test_engine_invariance.py does (an
    attention-free model never runs out of blocks), of single and forked requests."""
    engine = runner.engine
    before = engine.scheduler.num_preemptions
    fork = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=3, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"pre-{i}", p, fork if i == 4 else GREEDY)
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps in (2, 6, 9) and engine.scheduler.running:
            engine.scheduler.preempt(engine.scheduler.running[-1])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.scheduler.num_preemptions - before == 3
    assert [o.token_ids for o in finished["pre-4"].outputs] == [alone[4]] * 3
    assert [finished[f"pre-{i}"].outputs[0].token_ids for i in range(4)] == alone[:4]
    assert engine.scheduler.slots.num_used == 0


def test_prefix_caching_equals_off_and_hits(model_dir, alone) -> None:
    system = PROMPTS[4] + " "
    follow = [system + "Why?", system + "How?"]
    with VllmRunner(model_dir, device="cpu") as off:
        ref = tokens(off.generate(follow, GREEDY))
    with VllmRunner(model_dir, device="cpu", enable_prefix_caching=True) as on:
        assert tokens(on.generate(PROMPTS[4], GREEDY)) == [alone[4]]
        got = [on.generate(p, GREEDY)[0] for p in follow]
        assert tokens(got) == ref
        assert all(g.num_cached_tokens > 0 for g in got), [g.num_cached_tokens for g in got]
        assert on.engine.stats_snapshot().prefix_cache_hits > 0
        assert on.engine.scheduler.slots.num_used == 0
