"""Mamba2 against transformers' `Mamba2ForCausalLM`, and the engine's invariances."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import family_checks as checks
from tests.tiny_models import OTHER_CONFIGS, other_model_dir
from vllm_mamba import LLM

NAMES = ["mamba2-groups", "mamba2-tied"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers(name: str) -> None:
    checks.assert_matches_transformers("Mamba2ForCausalLM", other_model_dir(name))


def test_configs_differ_where_it_matters() -> None:
    a, b = (OTHER_CONFIGS[n][1] for n in NAMES)
    for key in ("n_groups", "conv_kernel", "chunk_size", "use_bias", "tie_word_embeddings"):
        assert a[key] != b[key]


def test_state_shapes_come_from_the_mixers_specs() -> None:
    llm = checks.engine(other_model_dir("mamba2-groups"))
    cache = llm.llm_engine.cache
    # conv over x, B and C: 128 + 2 * 2 * 16 channels; ssm per head: (heads, head_dim, state).
    layer = cache.layer(0)
    assert tuple(layer["conv"].shape[1:]) == (192, 3)
    assert tuple(layer["ssm"].shape[1:]) == (8, 16, 16)
    assert layer["conv"].shape[0] == layer["ssm"].shape[0] == cache.num_slots
    # every layer has the same spec, so the cache holds one tensor per name for all of them
    num_layers = llm.llm_engine.model.config.num_hidden_layers
    assert len(cache.tensors) == 1 and cache.num_layers == num_layers


def test_batched_equals_alone() -> None:
    checks.assert_batched_equals_alone(other_model_dir("mamba2-groups"))


@pytest.mark.parametrize("budget", [1, 5, 23])
def test_chunked_prefill_equals_whole(budget: int) -> None:
    """Prefill chunks of 5 or 23 tokens cut across the SSD chunks of 16."""
    checks.assert_chunked_equals_whole(other_model_dir("mamba2-groups"), budget)


def test_forks_equal_alone_and_free_slots() -> None:
    checks.assert_forks_equal_alone(other_model_dir("mamba2-groups"))


def test_bad_shapes_are_rejected(tmp_path) -> None:
    from transformers import Mamba2Config

    path = other_model_dir("mamba2-tied")
    config = Mamba2Config.from_pretrained(path)
    config.n_groups = 2  # 3 heads cannot be split into 2 groups
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="multiple of n_groups"):
        LLM(str(tmp_path))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_equal_eager(dtype: str) -> None:
    checks.assert_gpu_graphs_equal_eager_and_cpu(other_model_dir("mamba2-groups"), dtype)
