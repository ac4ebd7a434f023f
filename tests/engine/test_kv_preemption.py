"""KV pressure on a hybrid (Jamba): a forced preemption and aborts in flight free every block
and slot, and the engine serves normally afterwards; a paused request keeps its memory, is
preempted first under pressure and resumes exactly where it was.

Preemption under KV pressure equal to no pressure (also with forks and chunked prefill), with
the preemptions counted, is checked on every hybrid in `tests/models/test_families.py`.
"""

from __future__ import annotations

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

MODEL = "jamba-gqa"
GREEDY = checks.GREEDY  # the lone runs' (`checks.alone`)


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


def test_a_paused_request_holds_still_and_is_preempted_first() -> None:
    """Six prompts of 1 to 64 tokens plus 16 greedy tokens: with 13 blocks of 16, the fifth,
    paused after its first token with 2 blocks, is preempted when the others reach their 12,
    although it is not the most recently admitted. Until then it keeps its slot and blocks;
    paused, it never runs (not even readmitted); resumed, it ends with the tokens of a run
    alone. A paused request aborted frees everything."""
    path = tiny_model_dir(MODEL)
    prompts = checks.prompts()
    with VllmRunner(path, max_num_seqs=6, block_size=16, num_gpu_blocks_override=13) as runner:
        engine, sched = runner.engine, runner.engine.scheduler
        for i in range(6):
            engine.add_request(str(i), prompts[i], GREEDY)
        engine.step()  # every prompt prefilled, a first token each
        assert [g.request_id for g in sched.running] == ["0", "1", "2", "3", "4", "5"]
        held = sched.running[4]
        engine.pause_request("4")
        seq = held.seqs[0]
        first = list(seq.output_token_ids)
        slot, table = seq.slot, list(sched.block_manager.block_table(seq.seq_id))
        assert len(first) == 1 and len(table) == 2
        finished = {}
        while sched.has_unpaused():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
            assert seq.output_token_ids == first
            if held in sched.running:
                assert seq.slot == slot and sched.block_manager.block_table(seq.seq_id) == table
        assert held in sched.waiting and seq.slot is None and engine.stats.preemptions == 1
        assert sorted(finished) == ["0", "1", "2", "3", "5"]
        assert engine.step() == [] and seq.output_token_ids == first
        engine.resume_request("4")
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        assert checks.tokens([finished[str(i)] for i in range(6)]) == checks.alone(path)[:6]

        engine.add_request("gone", prompts[5], GREEDY)
        engine.step()
        engine.pause_request("gone")
        assert engine.step() == []
        engine.abort_request("gone")  # the runner checks on exit that all is free
