"""`speculative_config`: vLLM's keys and defaults, and a `ValueError` naming the key for
anything out of range or unknown; the spare state slots it adds; block trimming and the wave
runner the verification relies on."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.mamba_metadata import build_mamba_metadata, run_decode_waves
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.block_manager import BlockManager
from vllm_mamba.spec_decode.config import SpeculativeConfig


def test_ngram_defaults_as_vllm() -> None:
    both = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_value(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    implied = SpeculativeConfig.from_value({"model": "m", "num_speculative_tokens": 2})
    assert implied.method == "draft_model"
    alias = SpeculativeConfig.from_value({"method": "qwen3_next_mtp", "num_speculative_tokens": 1})
    assert alias.method == "mtp"


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max",
        ),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "min"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "mtp", "num_speculative_tokens": 2, "model": "m"}, "model"),
        ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "lookup"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "batch"),
        ("{not json", "JSON"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_values_name_the_key(value: object, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.from_value(value)


def test_engine_args_and_cli_flag() -> None:
    """`--speculative-config` takes the JSON text; `LLM(...)` a dict; both validate early."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(model="m", **vars(args)))
    engine_args.check_values()
    assert SpeculativeConfig.from_value(engine_args.speculative_config).num_speculative_tokens == 2
    bad = EngineArgs(
        model="m", speculative_config={"method": "ngram", "num_speculative_tokens": -1}
    )
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        bad.check_values()


def test_spare_slots_sized_by_k_and_freed() -> None:
    """k spare state slots per speculating sequence, after the sequences' and prefix
    cache's; a step never holds them beyond its end."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    with VllmRunner(tiny_model_dir("tied"), max_num_seqs=4, speculative_config=spec) as runner:
        engine = runner.engine
        assert engine.max_spec_chains == 2
        assert engine.cache.num_slots == 4 + 2 * 3
        assert engine.executor.runner.config.spare_slot_base == 4
        assert engine.scheduler.slots.num_slots == 4


def test_block_trim_releases_rejected_positions() -> None:
    blocks = BlockManager(8, 4)
    blocks.allocate(1, 0, 10)  # 3 blocks
    blocks.fork(1, 2)
    blocks.trim(1, 5)  # 2 blocks kept
    assert len(blocks.block_table(1)) == 2 and blocks.num_free_blocks == 5
    blocks.trim(2, 0)
    assert blocks.block_table(2) == [] and blocks.num_free_blocks == 6


def test_decode_waves_chain_a_state_and_save_each_position() -> None:
    """Two chains (3 and 2 rows) and a plain decode: each wave advances its slots in place;
    between waves the continuing chains save their state into their spare slots, so every
    position's state is kept; the plain decode runs once."""
    state = torch.zeros(8, 1)
    layout = StepLayout(decode_slots=[0, 1, 2, 0, 1, 0], prefill_lens=[], prefill_slots=[],
                        prefill_context_lens=[])  # fmt: skip
    layout.decode_waves = [3, 2, 1]
    layout.decode_chain_dst = [4, 6, 2, 5, 1, 0]  # chain 0: 0 -> 4 -> 5 -> 0, chain 1: 1 -> 6 -> 1
    layout.decode_chain_src = [0, 1, 2, 4, 6, 5]
    meta = build_mamba_metadata(layout, torch.device("cpu"))
    x = torch.tensor([1.0, 10.0, 100.0, 2.0, 20.0, 3.0])

    def update(rows: slice, slots: torch.Tensor) -> torch.Tensor:
        state[slots, 0] += x[rows]
        return state[slots, 0].clone()

    out = run_decode_waves(meta, [state], update)
    assert out.tolist() == [1.0, 10.0, 100.0, 3.0, 30.0, 6.0]
    assert state[:, 0].tolist() == [6.0, 30.0, 100.0, 0.0, 1.0, 3.0, 10.0, 0.0]


def test_stats_line_reports_acceptance(caplog: pytest.LogCaptureFixture) -> None:
    """The periodic stats line gains vLLM's SpecDecoding line over the interval: mean
    acceptance length, counts and the per-position acceptance rate."""
    import logging

    from vllm_mamba.engine.stats import StatLogger, StatsSnapshot

    base = dict(num_running=1, num_waiting=0, slots_used=1, slots_total=4, prompt_tokens=10,
                failed_requests=0, spec_enabled=True)  # fmt: skip
    first = StatsSnapshot(time=0.0, generation_tokens=0, steps=0, **base)
    later = StatsSnapshot(
        time=10.0, generation_tokens=30, steps=10, spec_num_drafts=10, spec_num_draft_tokens=40,
        spec_num_accepted_tokens=20, spec_accepted_per_pos=(9, 6, 4, 1), **base,
    )  # fmt: skip
    stats = StatLogger(interval=5.0)
    logger = logging.getLogger("vllm_mamba.engine")
    logger.addHandler(caplog.handler)
    try:
        stats.maybe_log(first)
        assert stats.maybe_log(later)
    finally:
        logger.removeHandler(caplog.handler)
    line = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert line == [
        "SpecDecoding metrics: Mean acceptance length: 3.00, Accepted: 20 tokens, Drafted: 40 "
        "tokens, Per-position acceptance rate: 0.900, 0.600, 0.400, 0.100, Avg Draft acceptance "
        "rate: 50.0%"
    ]


def test_ngram_drafts_search_a_bounded_window() -> None:
    """The lookup sees the last `NGRAM_WINDOW` tokens: a match inside them proposes what
    followed it; one only before them proposes nothing (bounded work per step)."""
    from vllm_mamba.engine import spec_steps
    from vllm_mamba.engine.sequence import Sequence

    config = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    )
    drafts = spec_steps.NgramDrafts(config, 10**6)
    filler = list(range(1000, 1000 + spec_steps.NGRAM_WINDOW))
    near = Sequence(seq_id=0, index=0, prompt_token_ids=filler[:-6] + [5, 6, 7, 8, 5, 6])
    far = Sequence(seq_id=1, index=0, prompt_token_ids=[5, 6, 7, 8] + filler + [5, 6])
    got = drafts.propose([(None, near, 2), (None, far, 2)])  # type: ignore[list-item]
    assert got == [[7, 8], []]
