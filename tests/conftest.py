"""Fixtures shared by every test module (vLLM's `hf_runner` / `vllm_runner` pattern).

- `hf_runner`: the `HfRunner` class; `hf_runner(model_dir)` loads the transformers reference.
- `vllm_runner`: the `VllmRunner` class; `with vllm_runner(model_dir, **engine_kwargs) as
  runner:` gives a fresh engine and checks, on a clean exit, that it drained.
- `example_token_prompts`: the eight token-id prompts (1 to 131 tokens) of the comparisons.

Tests marked `cuda` are skipped on a machine without an NVIDIA GPU.

Tiny checkpoints of every family come from the one registry, `tests.tiny_models` (by name,
saved once per session); the OpenAI server fixtures are in `tests/entrypoints/conftest.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.prompts import make_prompts
from tests.helpers.runners import HfRunner, VllmRunner


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the `cuda` tests without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_runner() -> type[HfRunner]:
    """The transformers reference runner class."""
    return HfRunner


@pytest.fixture(scope="session")
def vllm_runner() -> type[VllmRunner]:
    """The engine runner class."""
    return VllmRunner


@pytest.fixture(scope="session")
def example_token_prompts() -> list[list[int]]:
    """Eight token-id prompts of 1 to 131 tokens, from a fixed seed."""
    return make_prompts()
