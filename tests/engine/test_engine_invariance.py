"""Outputs do not depend on how the engine batches, chunks, forks or preempts."""

from __future__ import annotations

import functools

import pytest

from tests.models.test_mamba_vs_transformers import make_prompts
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20)


@functools.cache
def llm(**kwargs) -> LLM:
    return LLM(tiny_model_dir("tied"), **kwargs)


def prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts()]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def alone() -> list[list[int]]:
    """Each prompt run by itself."""
    return [tokens(llm().generate(p, GREEDY, use_tqdm=False))[0] for p in prompts()]


def test_batched_equals_alone() -> None:
    assert tokens(llm().generate(prompts(), GREEDY, use_tqdm=False)) == alone()


def test_queueing_with_two_slots_equals_alone() -> None:
    engine = llm(max_num_seqs=2)
    assert tokens(engine.generate(prompts(), GREEDY, use_tqdm=False)) == alone()
    assert engine.llm_engine.scheduler.slots.num_used == 0


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_chunked_prefill_equals_whole(budget: int) -> None:
    engine = llm(max_num_batched_tokens=budget)
    # Several prompts at once so chunks of different sequences share steps.
    assert tokens(engine.generate(prompts()[2:7], GREEDY, use_tqdm=False)) == alone()[2:7]


def test_greedy_n4_equals_n1_and_prefills_once() -> None:
    engine = llm()
    stats = engine.llm_engine.stats
    before = stats.prompt_tokens
    params = SamplingParams(temperature=0, max_tokens=20, n=4)
    out = engine.generate(prompts()[4], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(o.token_ids == alone()[4] for o in out.outputs)
    assert stats.prompt_tokens - before == len(prompts()[4]["prompt_token_ids"])


def test_seeded_sampling_n3_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, n=3, seed=7)
    first = llm().generate(prompts()[3], params, use_tqdm=False)[0]
    # Same request again, now with other requests in the batch.
    mixed = llm().generate([prompts()[0], prompts()[3], prompts()[5]], [GREEDY, params, GREEDY])
    again = mixed[1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    # The three samples differ from one another (they are not the same stream thrice).
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_forced_preemption_gives_same_tokens() -> None:
    engine = llm().llm_engine
    for i, p in enumerate(prompts()):
        engine.add_request(f"pre-{i}", p, GREEDY)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps in (3, 9, 15) and engine.scheduler.running:
            engine.scheduler.preempt(engine.scheduler.running[0])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions >= 3
    assert [finished[f"pre-{i}"] for i in range(len(prompts()))] == alone()
    assert engine.scheduler.slots.num_used == 0


def test_preempting_forked_request_gives_same_tokens() -> None:
    """Slots for n=3 are reserved on admission; preempting after the fork recomputes each child."""
    engine = llm(max_num_seqs=3).llm_engine
    engine.add_request("fork", prompts()[6], SamplingParams(temperature=0, max_tokens=20, n=3))
    engine.add_request("other", prompts()[1], GREEDY)
    engine.step()
    assert engine.scheduler.slots.num_free == 0  # three reserved, the other request waits
    assert [g.request_id for g in engine.scheduler.waiting] == ["other"]
    finished = {}
    for step in range(200):
        if step == 5:
            engine.scheduler.preempt(engine.scheduler.running[0])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert all(o.token_ids == alone()[6] for o in finished["fork"].outputs)
    assert finished["other"].outputs[0].token_ids == alone()[1]
    assert engine.scheduler.slots.num_used == 0


def test_many_requests_through_four_slots_free_every_slot() -> None:
    engine = llm(max_num_seqs=4)
    params = [SamplingParams(temperature=0.8, max_tokens=1 + i % 5, seed=i) for i in range(320)]
    outs = engine.generate([prompts()[i % 4] for i in range(320)], params, use_tqdm=False)
    assert len(outs) == 320 and all(o.finished for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1 + i % 5 for i in range(320)]
    sched = engine.llm_engine.scheduler
    assert sched.slots.num_used == 0 and sched.slots.num_free == 4
    assert not sched.running and not sched.waiting


def test_abort_in_flight_frees_slots() -> None:
    engine = llm(max_num_seqs=4).llm_engine
    for i in range(6):
        engine.add_request(f"ab-{i}", prompts()[i], SamplingParams(max_tokens=50, n=1 + i % 2))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.slots.num_used > 0
    engine.abort_request([f"ab-{i}" for i in range(6)])
    assert engine.scheduler.slots.num_used == 0
    assert not engine.has_unfinished_requests()
    # The engine still serves normally afterwards.
    out = llm(max_num_seqs=4).generate(prompts()[0], GREEDY, use_tqdm=False)
    assert tokens(out) == [alone()[0]]
