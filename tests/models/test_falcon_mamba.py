"""FalconMamba against transformers' `FalconMambaForCausalLM`, and the engine's invariances."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import family_checks as checks
from tests.tiny_models import OTHER_CONFIGS, other_model_dir

NAMES = ["falcon-tied", "falcon-untied"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers(name: str) -> None:
    checks.assert_matches_transformers("FalconMambaForCausalLM", other_model_dir(name))


def test_configs_differ_where_it_matters() -> None:
    a, b = (OTHER_CONFIGS[n][1] for n in NAMES)
    assert a["mixer_rms_eps"] != b["mixer_rms_eps"]
    assert a["tie_word_embeddings"] != b["tie_word_embeddings"]


def test_batched_equals_alone() -> None:
    checks.assert_batched_equals_alone(other_model_dir("falcon-untied"))


@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_equals_whole(budget: int) -> None:
    checks.assert_chunked_equals_whole(other_model_dir("falcon-untied"), budget)


def test_forks_equal_alone_and_free_slots() -> None:
    checks.assert_forks_equal_alone(other_model_dir("falcon-untied"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_equal_eager(dtype: str) -> None:
    checks.assert_gpu_graphs_equal_eager_and_cpu(other_model_dir("falcon-untied"), dtype)
