"""KV pressure on a hybrid (Jamba): a forced preemption and aborts in flight free every block
and slot, and the engine serves normally afterwards.

Preemption under KV pressure equal to no pressure (also with forks and chunked prefill), with
the preemptions counted, is checked on every hybrid in `tests/models/test_families.py`.
"""

from __future__ import annotations

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

MODEL = "jamba-gqa"
GREEDY = SamplingParams(temperature=0, max_tokens=20)


def test_aborts_and_preemptions_free_every_block() -> None:
    path = tiny_model_dir(MODEL)
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
