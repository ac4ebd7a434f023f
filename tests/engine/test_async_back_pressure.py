"""`AsyncLLMEngine` back-pressure: a request's undelivered outputs stay one (the newest
cumulative output replaces the older), a request whose output goes unread for `pause_after_s`
is paused until it is read (and then continues as if never paused), one unread for
`stall_timeout_s` is aborted with its slots freed, and one call may not take more than
`max_slots_per_request` slots. (A paused request under KV pressure:
tests/engine/test_kv_preemption.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers.runners import assert_drained
from tests.tiny_models import tiny_model_dir
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.async_engine import AsyncLLMEngine, StreamStalledError
from vllm_mamba.sampling_params import SamplingParams

LONG = SamplingParams(n=2, max_tokens=400, ignore_eos=True, temperature=1.0, seed=0)
GREEDY = SamplingParams(n=2, max_tokens=400, ignore_eos=True, temperature=0)


def _engine(**kwargs: object) -> AsyncLLMEngine:
    args = EngineArgs(model=tiny_model_dir("tied"), max_model_len=512, max_num_seqs=8)
    return AsyncLLMEngine.from_engine_args(args, **kwargs)


def test_unread_request_is_aborted_and_frees_its_slots() -> None:
    async def main() -> None:
        engine = _engine(stall_timeout_s=0.5)
        try:
            stream = await engine.add_request("slow", "import os", LONG)
            first = await anext(stream)  # then the client stops reading
            assert not first.finished
            deadline = time.monotonic() + 30
            while engine.num_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.num_requests == 0
            with pytest.raises(StreamStalledError):
                async for _ in stream:
                    pass
            while engine.stats.slots_used and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.stats.slots_used == 0
            assert engine.stats.generation_tokens < 2 * LONG.max_tokens  # not run to the end
            probe = await engine.add_request("probe", "def f():", SamplingParams(max_tokens=3))
            outs = [out async for out in probe]
            assert outs[-1].finished
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _tokens(engine: AsyncLLMEngine) -> list[int]:
    """On the engine thread: the token counts of every sequence in the engine."""
    sched = engine.engine.scheduler
    return [s.num_tokens for g in (*sched.running, *sched.waiting) for s in g.seqs]


async def _assert_held(engine: AsyncLLMEngine) -> None:
    """The engine's one request is unfinished and stays as it is for a second, with its two
    slots, while the loop sleeps (no step, not even an empty one)."""
    held = await engine.call(_tokens, engine)
    assert len(held) == 2 and max(held) < GREEDY.max_tokens
    published = engine.stats.time
    await asyncio.sleep(1.0)
    assert await engine.call(_tokens, engine) == held
    assert engine.stats.time == published
    assert engine.stats.slots_used == 2


def test_an_unread_request_is_paused_until_read() -> None:
    async def main() -> None:
        engine = _engine(stall_timeout_s=None, pause_after_s=0.1)
        try:
            free = [out async for out in await engine.add_request("free", "import os", GREEDY)]
            stream = await engine.add_request("held", "import os", GREEDY)
            await anext(stream)  # then the consumer stops reading
            await asyncio.sleep(0.5)
            await _assert_held(engine)
            outs = [out async for out in stream]  # reading resumes it, to the end
            assert outs[-1].finished
            assert [o.token_ids for o in outs[-1].outputs] == [
                o.token_ids for o in free[-1].outputs
            ]
            assert engine.stats.slots_used == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_paused_request_closed_frees_everything() -> None:
    async def main() -> None:
        engine = _engine(stall_timeout_s=None, pause_after_s=0.1)
        try:
            stream = await engine.add_request("held", "import os", GREEDY)
            await anext(stream)
            await asyncio.sleep(0.5)
            await _assert_held(engine)
            await stream.aclose()  # the client went away: aborted on the engine thread,
            await engine.call(assert_drained, engine.engine)  # before this
            assert engine.num_requests == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_slow_reader_gets_the_newest_output() -> None:
    async def main() -> None:
        engine = _engine(stall_timeout_s=None)
        try:
            params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
            stream = await engine.add_request("r", "import os", params)
            await asyncio.sleep(1.0)  # many steps ran meanwhile: one output waits, the newest
            out = await anext(stream)
            assert len(out.outputs[0].token_ids) > 1
            last = out
            async for last in stream:  # noqa: B007 - the last output is checked
                pass
            assert last.finished and len(last.outputs[0].token_ids) == 40
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_one_call_may_not_take_most_slots() -> None:
    async def main() -> None:
        engine = _engine()
        try:
            with pytest.raises(ValueError, match="SamplingParams.n"):
                await engine.add_requests([("a", "x"), ("b", "y")], SamplingParams(n=3))
            assert engine.num_requests == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())
