"""KV pressure on a hybrid: when decode growth runs out of blocks, the most recently admitted
request is preempted by recompute, automatically; outputs equal those without pressure, the
preemptions are counted, and every block and slot is free afterwards (also after aborts)."""

from __future__ import annotations

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.tiny_models import other_model_dir
from vllm_mamba import SamplingParams

MODEL = "jamba-gqa"
GREEDY = SamplingParams(temperature=0, max_tokens=20)


def test_kv_pressure_preempts_and_equals_no_pressure() -> None:
    path = other_model_dir(MODEL)
    # 8 prompts of 1..131 tokens + 20 generated need 37 blocks of 16; the pool holds 14.
    with VllmRunner(path, block_size=16, num_gpu_blocks_override=14) as runner:
        outs = runner.generate(checks.prompts(), GREEDY)
        engine = runner.engine
        assert engine.stats.preemptions > 0
        assert engine.stats_snapshot().preemptions == engine.stats.preemptions
        assert engine.stats_snapshot().kv_blocks_total == 14
    assert checks.tokens(outs) == checks.alone(path)


def test_kv_pressure_with_forks_and_chunks() -> None:
    """Forked requests and chunked prefill under pressure: seeded samples are unchanged."""
    path = other_model_dir(MODEL)
    prompts = checks.prompts()
    params = [SamplingParams(temperature=1.0, max_tokens=12, n=1 + i % 3, seed=i) for i in range(8)]
    with VllmRunner(path, max_num_seqs=16) as runner:
        free = runner.generate(prompts, params)
    with VllmRunner(
        path, max_num_seqs=16, num_gpu_blocks_override=30, max_num_batched_tokens=40
    ) as runner:
        tight = runner.generate(prompts, params)
        assert runner.engine.stats.preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in tight] == [
        [o.token_ids for o in r.outputs] for r in free
    ]


def test_aborts_and_preemptions_free_every_block() -> None:
    path = other_model_dir(MODEL)
    prompts = checks.prompts()
    with VllmRunner(path, max_num_seqs=6, num_gpu_blocks_override=16) as runner:
        engine = runner.engine
        blocks = engine.scheduler.block_manager
        for i in range(6):
            engine.add_request(f"ab-{i}", prompts[i], SamplingParams(max_tokens=40, n=1 + i % 2))
        for _ in range(12):
            engine.step()
        assert blocks.num_used_blocks > 0
        engine.scheduler.preempt(engine.scheduler.running[-1])
        engine.step()
        engine.abort_request([f"ab-{i}" for i in range(6)])
        runner.assert_drained()
        assert blocks.num_free_blocks == 16
        assert checks.tokens(runner.generate(prompts[3], GREEDY)) == [checks.alone(path)[3]]
