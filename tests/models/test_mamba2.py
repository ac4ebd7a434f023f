"""What is Mamba2's own beyond the family checks (`tests/models/test_families.py`): the state
cache's shapes come from the model (conv over x, B and C; SSM state per head), and heads that
cannot be split into the configured groups are refused."""

from __future__ import annotations

import pytest

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM


def test_state_shapes_come_from_the_mixers_specs() -> None:
    with VllmRunner(tiny_model_dir("mamba2-groups")) as runner:
        cache = runner.engine.cache
        # conv over x, B and C: 128 + 2 * 2 * 16 channels; ssm per head: (heads, head_dim, state).
        layer = cache.layer(0)
        assert tuple(layer["conv"].shape[1:]) == (192, 3)
        assert tuple(layer["ssm"].shape[1:]) == (8, 16, 16)
        assert layer["conv"].shape[0] == layer["ssm"].shape[0] == cache.num_slots
        # every layer has the same spec: the cache holds one tensor per name for all of them
        num_layers = runner.engine.model.config.num_hidden_layers
        assert len(cache.tensors) == 1 and cache.num_layers == num_layers


def test_bad_shapes_are_rejected(tmp_path) -> None:
    from transformers import Mamba2Config

    path = tiny_model_dir("mamba2-tied")
    config = Mamba2Config.from_pretrained(path)
    config.n_groups = 2  # 3 heads cannot be split into 2 groups
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="multiple of n_groups"):
        LLM(str(tmp_path))
