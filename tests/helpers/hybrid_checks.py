"""Checks of the Mamba2 hybrids beyond `family_checks`: KV pressure with preemption, seeded
forks against independent runs, and the drained state after both.

Every `VllmRunner` block checks on exit that no request is left and every state slot and KV
block is free.
"""

from __future__ import annotations

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from vllm_mamba import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def assert_kv_pressure_equals_no_pressure(path: str, blocks: int = 14) -> None:
    """8 prompts of 1..131 tokens + 20 generated need 37 blocks of 16; `blocks` forces
    preemptions, and the outputs stay those of each prompt alone."""
    with VllmRunner(path, block_size=16, num_gpu_blocks_override=blocks) as runner:
        outs = runner.generate(checks.prompts(), GREEDY)
        assert runner.engine.stats.preemptions > 0
        assert runner.engine.scheduler.block_manager.num_free_blocks == blocks
    assert checks.tokens(outs) == checks.alone(path)


def assert_forks_and_chunks_under_pressure(path: str) -> None:
    """Seeded forked requests under KV pressure and chunked prefill equal a free run."""
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


def assert_forks_equal_independent_seeded_runs(path: str) -> None:
    """Sample `i` of a seeded `n = 3` request equals a lone request seeded `seed + 7919 * i`:
    the forks' shared and copied KV blocks and state slots hold the right values."""
    prompt = checks.prompts()[6]  # 100 tokens: 6 full blocks and a partial one
    forked = SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=11)
    with VllmRunner(path, max_num_seqs=4) as runner:
        out = runner.generate(prompt, forked)[0]
        lone = [
            runner.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=s))[0]
            for s in (11, 11 + 7919, 11 + 2 * 7919)
        ]
    assert [o.token_ids for o in out.outputs] == [lo.outputs[0].token_ids for lo in lone]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
