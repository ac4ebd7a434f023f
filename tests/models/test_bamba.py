"""Bamba against transformers' `BambaForCausalLM` (Mamba2 and RoPE attention layers), and the
engine's invariances on it: batching, chunked prefill across SSD chunks and KV blocks, KV
pressure with preemption, forks; every slot and block free after each run. Also the paged
metadata's token positions, which the rotary embedding reads."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import family_checks as checks
from tests.helpers import hybrid_checks
from tests.helpers.hybrid_models import BAMBA_CONFIGS, hf_class, hybrid_model_dir
from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import build_paged_metadata

NAMES = list(BAMBA_CONFIGS)
MODEL = "bamba-gqa"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers(name: str) -> None:
    checks.assert_matches_transformers(hf_class(name), hybrid_model_dir(name))


def test_batched_equals_alone() -> None:
    checks.assert_batched_equals_alone(hybrid_model_dir(MODEL))


@pytest.mark.parametrize("budget", [1, 5, 17, 23])
def test_chunked_prefill_equals_whole(budget: int) -> None:
    checks.assert_chunked_equals_whole(hybrid_model_dir(MODEL), budget)


def test_kv_pressure_preempts_and_equals_no_pressure() -> None:
    hybrid_checks.assert_kv_pressure_equals_no_pressure(hybrid_model_dir(MODEL))


def test_forks_and_chunks_under_kv_pressure() -> None:
    hybrid_checks.assert_forks_and_chunks_under_pressure(hybrid_model_dir("bamba-mqa"))


def test_forks_equal_alone() -> None:
    checks.assert_forks_equal_alone(hybrid_model_dir(MODEL))


def test_forks_equal_independent_seeded_runs() -> None:
    hybrid_checks.assert_forks_equal_independent_seeded_runs(hybrid_model_dir("bamba-mqa"))


def test_paged_metadata_carries_token_positions() -> None:
    """Decodes sit at their context length; a prefill chunk continues from its context."""
    layout = StepLayout(
        decode_slots=[0, 1],
        prefill_lens=[3, 2],
        prefill_slots=[2, 3],
        prefill_context_lens=[0, 17],
        decode_context_lens=[5, 16],
        block_size=16,
        decode_block_tables=[[4], [1, 2]],
        prefill_block_tables=[[3], [5, 6]],
    )
    meta = build_paged_metadata(layout, torch.device("cpu"))
    assert meta.positions.tolist() == [5, 16, 0, 1, 2, 17, 18]
    assert meta.slot_mapping.tolist() == [69, 32, 48, 49, 50, 97, 98]
