"""Prefix caching, cache on against cache off, on Mamba, Mamba2, Jamba and a Mamba2 hybrid.

The reference is the same engine with the cache off, request by request: greedy tokens must
be equal and logprobs (sampled and prompt) close. The workload has what the cache must find:
prompts sharing a prefix shorter than one KV block, a shared "system prompt" at an unaligned
length, a multi-turn follow-up (the last prompt plus its answer plus a new message), prompt
logprobs asked for with a larger top-k than the snapshot kept, and a batch arriving at once
(later requests wait for the branch point). Every slot, block and snapshot is accounted for
after draining and after aborts.

A smaller shared-prefix, batch and multi-turn check runs on every family in
`tests/models/test_families.py`.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import RequestOutput, SamplingParams

MODELS = {
    "mamba": lambda: tiny_model_dir("tied"),
    "mamba2": lambda: tiny_model_dir("mamba2-groups"),
    "jamba": lambda: tiny_model_dir("jamba-gqa"),
    "bamba": lambda: tiny_model_dir("bamba-gqa"),
}
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
ECHO = SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
ECHO3 = SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=3)
ENGINE = dict(max_num_batched_tokens=48, block_size=16, prefix_snapshot_interval=32)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 50000) for _ in range(n)]


def _workload(seed: int = 0) -> list[list[int]]:
    """Sequential prompts: a short shared prefix (7 tokens), a 45-token shared system prompt
    with different questions, and long prompts crossing several chunks and intervals."""
    rng = random.Random(seed)
    short, system = _ids(rng, 7), _ids(rng, 45)
    prompts = [short + _ids(rng, 3), short + _ids(rng, 2), short + _ids(rng, 4)]
    prompts += [system + _ids(rng, rng.randrange(2, 9)) for _ in range(4)]
    prompts += [_ids(rng, 100), _ids(rng, 70)]
    return prompts


def _run(runner: VllmRunner, prompts: list[list[int]], params: SamplingParams) -> list:
    return [runner.generate({"prompt_token_ids": p}, params)[0] for p in prompts]


def _assert_same(got: RequestOutput, ref: RequestOutput) -> None:
    a, b = got.outputs[0], ref.outputs[0]
    assert a.token_ids == b.token_ids
    for ea, eb in zip(a.logprobs, b.logprobs):
        assert ea.keys() == eb.keys()
        for t in ea:
            assert ea[t].logprob == pytest.approx(eb[t].logprob, abs=1e-4)
    if ref.prompt_logprobs is not None:
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(
            ref.prompt_logprobs
        )
        for ea, eb in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert ea.keys() == eb.keys()
            for t in ea:
                assert ea[t].logprob == pytest.approx(eb[t].logprob, abs=1e-4)
                assert ea[t].rank == eb[t].rank


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cache_on_equals_off_and_hits(name: str) -> None:
    path = MODELS[name]()
    prompts = _workload()
    with VllmRunner(path, **ENGINE) as off:
        ref = _run(off, prompts, PARAMS)
        turn2 = prompts[3] + ref[3].outputs[0].token_ids + [11, 12, 13]
        ref2 = _run(off, [turn2], PARAMS)[0]
        ref_echo = _run(off, prompts[3:5], ECHO) + _run(off, prompts[5:6], ECHO3)
        batch = [p + [7, 8] for p in prompts]
        ref_batch = off.generate([{"prompt_token_ids": p} for p in batch], PARAMS)
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as on:
        got = _run(on, prompts, PARAMS)
        for g, r in zip(got, ref):
            _assert_same(g, r)
        cached = [g.num_cached_tokens for g in got]
        assert cached[0] == 0
        assert cached[2] == 7  # the branch point of the first two (shorter than a block)
        assert cached[5] == cached[6] == 45  # the system prompt, at an unaligned length
        assert cached[7] == 0  # nothing in common
        # The next chat turn starts where the earlier sequence ended (all but its last token).
        got2 = _run(on, [turn2], PARAMS)[0]
        _assert_same(got2, ref2)
        assert got2.num_cached_tokens == len(prompts[3]) + len(ref[3].outputs[0].token_ids) - 1
        # Prompt logprobs: the first echo request saves the prompt's, the second reuses them;
        # a request asking for more top tokens than were kept cannot and computes its own.
        echo = _run(on, prompts[3:5], ECHO) + _run(on, prompts[5:6], ECHO3)
        for g, r in zip(echo, ref_echo):
            _assert_same(g, r)
        assert echo[1].num_cached_tokens == 45
        # A batch arriving at once: later requests wait for the first one's branch point.
        got_batch = on.generate([{"prompt_token_ids": p} for p in batch], PARAMS)
        for g, r in zip(got_batch, ref_batch):
            _assert_same(g, r)
        assert sum(g.num_cached_tokens > 0 for g in got_batch) >= len(batch) - 3
        cache = on.engine.prefix_cache
        snap = on.engine.stats_snapshot()
        assert 0 < snap.prefix_cache_hits < snap.prefix_cache_queries
        assert snap.prefix_cache_hits == cache.hits


@pytest.mark.parametrize("name", ["mamba2", "jamba"])
def test_tiny_budget_evicts_and_stays_correct(name: str) -> None:
    """Two snapshot slots: constant eviction; on a hybrid also a KV pool so small that
    snapshots' blocks are evicted before requests are preempted."""
    path = MODELS[name]()
    prompts = _workload(seed=1)
    with VllmRunner(path, **ENGINE) as off:
        ref = _run(off, prompts, PARAMS)
        ref_batch = off.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as probe:
        slot_bytes = probe.engine.cache.bytes_per_slot()
    tight = dict(ENGINE, prefix_cache_memory_bytes=2 * slot_bytes)
    if name == "jamba":
        tight["num_gpu_blocks_override"] = 24
    with VllmRunner(path, enable_prefix_caching=True, **tight) as on:
        cache = on.engine.prefix_cache
        assert cache.slots.num_slots == 2
        for g, r in zip(_run(on, prompts, PARAMS), ref):
            _assert_same(g, r)
            assert cache.num_snapshots <= 2
        for g, r in zip(on.generate([{"prompt_token_ids": p} for p in prompts], PARAMS), ref_batch):
            _assert_same(g, r)
        assert cache.evictions > 0


def test_forks_and_preemption_with_cache() -> None:
    """`n > 1` seeded samples and preemption under KV pressure give the same outputs with the
    cache on; preempted requests restart from their own snapshots."""
    path = MODELS["jamba"]()
    rng = random.Random(2)
    system = _ids(rng, 40)
    prompts = [{"prompt_token_ids": system + _ids(rng, 3 + i)} for i in range(6)]
    params = [SamplingParams(temperature=1.0, max_tokens=10, n=1 + i % 3, seed=i) for i in range(6)]
    kwargs = dict(max_num_seqs=16, max_num_batched_tokens=40)
    with VllmRunner(path, **kwargs) as off:
        ref = off.generate(prompts, params)
    with VllmRunner(path, enable_prefix_caching=True, num_gpu_blocks_override=14, **kwargs) as on:
        got = on.generate(prompts, params)
        assert on.engine.stats.preemptions > 0
        assert on.engine.prefix_cache.hits > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in ref
    ]


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_aborts_mid_prefill_leave_nothing(name: str) -> None:
    path = MODELS[name]()
    prompts = _workload(seed=3)
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as runner:
        engine = runner.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"a{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=30))
        for _ in range(3):
            engine.step()
        engine.abort_request([f"a{i}" for i in range(len(prompts))])
        cache = engine.prefix_cache
        assert not any(n.pending for n in _nodes(cache.tree.root))
        assert not any(n.users for n in _nodes(cache.tree.root))
        assert cache.slots.num_used == cache.num_snapshots
        # Snapshots left by the aborted requests are whole: a new request reusing one matches
        # the cache-off engine.
        out = runner.generate({"prompt_token_ids": prompts[4]}, PARAMS)[0]
    with VllmRunner(path, **ENGINE) as off:
        _assert_same(out, off.generate({"prompt_token_ids": prompts[4]}, PARAMS)[0])


def test_failed_step_discards_its_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    path = MODELS["mamba"]()
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as runner:
        engine = runner.engine
        original = engine.executor.runner.execute

        def boom(step: object) -> object:
            raise RuntimeError("injected")

        monkeypatch.setattr(engine.executor.runner, "execute", boom)
        engine.add_request("x", {"prompt_token_ids": list(range(100, 160))}, PARAMS)
        with pytest.raises(Exception, match="injected"):
            engine.step()
        assert engine.prefix_cache.num_snapshots == 0
        assert engine.prefix_cache.slots.num_used == 0
        monkeypatch.setattr(engine.executor.runner, "execute", original)
        assert runner.generate({"prompt_token_ids": list(range(100, 160))}, PARAMS)


def test_snapshot_never_written_after_it_is_taken() -> None:
    """A hit copies the snapshot: the sequence's later steps leave the saved state as taken."""
    path = MODELS["mamba2"]()
    rng = random.Random(4)
    system = _ids(rng, 30)
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as runner:
        engine = runner.engine
        runner.generate({"prompt_token_ids": system + [5, 6]}, PARAMS)
        runner.generate({"prompt_token_ids": system + [7, 8]}, PARAMS)
        snap = engine.prefix_cache.match(system + [9], len(system))
        assert snap is not None and snap.num_tokens == len(system)

        def slot_states() -> list[torch.Tensor]:
            """Every named state of the snapshot's slot, in every layer."""
            layers = [engine.cache.layer(i) for i in range(engine.cache.num_layers)]
            return [t[snap.slot].clone() for layer in layers for t in layer.values()]

        saved = slot_states()
        out = runner.generate({"prompt_token_ids": system + [9, 10]}, PARAMS)[0]
        assert out.num_cached_tokens == len(system)
        for now, before in zip(slot_states(), saved):
            torch.testing.assert_close(now, before, rtol=0, atol=0)


def _nodes(root: object) -> list:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
