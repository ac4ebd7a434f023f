"""Models that ship inside the package, reachable by name (`vllm-mamba/tiny-stdlib`).

Each is a Hugging Face model directory beside this file; `LLM(model="vllm-mamba/NAME")`
loads it without any hub.
"""

from __future__ import annotations

import os

PREFIX = "vllm-mamba/"
DEFAULT_MODEL = "vllm-mamba/tiny-stdlib"
_ROOT = os.path.dirname(os.path.abspath(__file__))


def shipped_model_path(model: str) -> str | None:
    """The directory of shipped model `model` (`vllm-mamba/NAME`), or None if it is not one."""
    if not model.startswith(PREFIX):
        return None
    path = os.path.join(_ROOT, model[len(PREFIX) :])
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def list_shipped_models() -> list[str]:
    """Names of the shipped models."""
    return sorted(
        PREFIX + name
        for name in os.listdir(_ROOT)
        if os.path.isfile(os.path.join(_ROOT, name, "config.json"))
    )
