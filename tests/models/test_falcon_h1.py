"""Falcon-H1 against transformers' `FalconH1ForCausalLM` (attention and Mamba2 in parallel in every
layer, RoPE, the muP multipliers, the optional gated norm before or after the gate), and the
engine's invariances on it: batching, chunked prefill across SSD chunks and KV blocks, KV
pressure with preemption, forks; every slot and block free after each run."""

from __future__ import annotations

import pytest

from tests.helpers import family_checks as checks
from tests.helpers import hybrid_checks
from tests.helpers.hybrid_models import FALCON_H1_CONFIGS, hf_class, hybrid_model_dir

NAMES = list(FALCON_H1_CONFIGS)
MODEL = "falcon-h1-norm"


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
    hybrid_checks.assert_forks_and_chunks_under_pressure(hybrid_model_dir("falcon-h1-plain"))


def test_forks_equal_alone() -> None:
    checks.assert_forks_equal_alone(hybrid_model_dir(MODEL))


def test_forks_equal_independent_seeded_runs() -> None:
    hybrid_checks.assert_forks_equal_independent_seeded_runs(hybrid_model_dir("falcon-h1-plain"))
