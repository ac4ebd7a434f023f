"""Outputs do not depend on how the engine schedules: greedy forks prefill once, forced
preemption (also of a forked request), many requests through four slots, aborts in flight.

On Mamba ("tied"); the checks every family shares (batched and queued equal to alone, chunked
prefill, forks, KV pressure) are in `tests/models/test_families.py`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model_dir("tied")


@pytest.fixture(scope="module")
def prompts(example_token_prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in example_token_prompts]


@pytest.fixture(scope="module")
def shared(vllm_runner, model: str) -> Iterator[VllmRunner]:
    """The engine with default options, shared by the tests that need no other."""
    with vllm_runner(model) as runner:
        yield runner


@pytest.fixture
def llm(shared: VllmRunner) -> Iterator[VllmRunner]:
    """The shared engine, drained after each test."""
    yield shared
    shared.assert_drained()


@pytest.fixture(scope="module")
def alone(shared: VllmRunner, prompts: list[dict]) -> list[list[int]]:
    """Each prompt run by itself."""
    runs = [tokens(shared.generate(p, GREEDY))[0] for p in prompts]
    assert len({tuple(t) for t in runs}) == len(runs)  # equal to a varied reference
    return runs


def test_greedy_n4_equals_n1_and_prefills_once(llm, prompts, alone) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, n=4)
    before = llm.engine.stats.prompt_tokens
    out = llm.generate(prompts[4], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(o.token_ids == alone[4] for o in out.outputs)
    assert llm.engine.stats.prompt_tokens - before == len(prompts[4]["prompt_token_ids"])


def test_forced_preemption_gives_same_tokens(llm, prompts, alone) -> None:
    engine = llm.engine
    before = engine.scheduler.num_preemptions
    for i, p in enumerate(prompts):
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
    assert engine.scheduler.num_preemptions - before == 3
    assert [finished[f"pre-{i}"] for i in range(len(prompts))] == alone


def test_preempting_forked_request_gives_same_tokens(vllm_runner, model, prompts, alone) -> None:
    """n=3 in three slots beside another request: one slot is left for the other request, so
    one fork is reserved and the third sequence waits; preempting after the fork recomputes
    each sequence."""
    with vllm_runner(model, max_num_seqs=3) as runner:
        engine = runner.engine
        engine.add_request("fork", prompts[6], SamplingParams(temperature=0, max_tokens=20, n=3))
        engine.add_request("other", prompts[1], GREEDY)
        engine.step()
        assert engine.scheduler.slots.num_free == 0  # one reserved fork, and the other request
        assert [g.request_id for g in engine.scheduler.running] == ["fork", "other"]
        finished = {}
        for step in range(200):
            if step == 5:
                group = engine.scheduler.running[0]
                assert group.request_id == "fork" and len(group.seqs) == 3  # forked already
                engine.scheduler.preempt(group)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
    assert [o.token_ids for o in finished["fork"].outputs] == [alone[6]] * 3
    assert finished["other"].outputs[0].token_ids == alone[1]


def test_many_requests_through_four_slots_free_every_slot(vllm_runner, model, prompts) -> None:
    params = [SamplingParams(temperature=0.8, max_tokens=1 + i % 5, seed=i) for i in range(320)]
    with vllm_runner(model, max_num_seqs=4) as runner:
        outs = runner.generate([prompts[i % 4] for i in range(320)], params)
        assert runner.engine.scheduler.slots.num_free == 4
    assert all(o.finished for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1 + i % 5 for i in range(320)]


def test_abort_in_flight_frees_slots(vllm_runner, model, prompts, alone) -> None:
    with vllm_runner(model, max_num_seqs=4) as runner:
        engine = runner.engine
        for i in range(6):
            engine.add_request(f"ab-{i}", prompts[i], SamplingParams(max_tokens=50, n=1 + i % 2))
        for _ in range(4):
            engine.step()
        assert engine.scheduler.slots.num_used > 0
        engine.abort_request([f"ab-{i}" for i in range(6)])
        runner.assert_drained()
        # The engine still serves normally afterwards.
        assert tokens(runner.generate(prompts[0], GREEDY)) == [alone[0]]


def test_large_n_leaves_room_for_a_later_request(
    vllm_runner, model, prompts, alone, shared
) -> None:
    """Issue 46: a request of n = max_num_seqs held every slot until it finished. A request
    added after it now runs before it finishes (the large one gives back a slot, its last
    sequence restarting later from the prompt), and every output is what it is with room for
    all: the seeded samples of each index, the other request's greedy tokens."""
    big = SamplingParams(temperature=1.0, seed=11, max_tokens=30, n=4)
    roomy = [o.token_ids for o in shared.generate(prompts[6], big)[0].outputs]
    with vllm_runner(model, max_num_seqs=4) as runner:
        engine = runner.engine
        engine.add_request("big", prompts[6], big)
        engine.step()
        assert engine.scheduler.slots.num_free == 0  # the big request holds every slot
        engine.add_request("small", prompts[1], GREEDY)
        finished: dict[str, RequestOutput] = {}
        order = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    order.append(out.request_id)
        assert order == ["small", "big"]
        assert engine.scheduler.num_preemptions >= 1
    assert finished["small"].outputs[0].token_ids == alone[1]
    assert [o.token_ids for o in finished["big"].outputs] == roomy


def test_a_request_without_a_slot_is_not_starved_by_new_ones(vllm_runner, model, prompts, alone):
    """n=2 in two slots while a short request arrives every other step: each new request
    takes one of the two slots back, and when the request's running sequence ends, its other
    one gets the free slot before the newer requests waiting (not once none waits)."""
    with vllm_runner(model, max_num_seqs=2) as runner:
        engine = runner.engine
        engine.add_request("big", prompts[6], SamplingParams(temperature=0, max_tokens=20, n=2))
        big = None
        for step in range(400):
            if step < 150 and step % 2 == 0:
                engine.add_request(f"s{step}", prompts[1], SamplingParams(max_tokens=4))
            for out in engine.step():
                if out.request_id == "big" and out.finished:
                    big = (step, out)
            if not engine.has_unfinished_requests():
                break
    assert big is not None and big[0] < 150, big  # while new requests still came
    assert [o.token_ids for o in big[1].outputs] == [alone[6]] * 2
