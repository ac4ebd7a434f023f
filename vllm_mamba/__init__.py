"""vllm_mamba: a vLLM-style inference and serving engine for state-space language models."""

import importlib
from typing import TYPE_CHECKING, Any

from vllm_mamba.logger import init_logger
from vllm_mamba.ops.cpu_isa import cap_libraries

init_logger()
cap_libraries()  # a forced VLLM_MAMBA_CPU_ISA caps torch's libraries before they start

__version__ = "0.1.0"

# The public names are imported when first used (PEP 562): `import vllm_mamba` and the
# `vllm-mamba --help` / `--version` paths load no torch.
_LAZY = {
    "EngineArgs": "vllm_mamba.engine.arg_utils",
    "LLM": "vllm_mamba.llm",
    "ModelRegistry": "vllm_mamba.models.registry",
    "CompletionOutput": "vllm_mamba.outputs",
    "Logprob": "vllm_mamba.outputs",
    "RequestOutput": "vllm_mamba.outputs",
    "SamplingParams": "vllm_mamba.sampling_params",
}

if TYPE_CHECKING:
    from vllm_mamba.engine.arg_utils import EngineArgs
    from vllm_mamba.llm import LLM
    from vllm_mamba.models.registry import ModelRegistry
    from vllm_mamba.outputs import CompletionOutput, Logprob, RequestOutput
    from vllm_mamba.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_mamba' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "ModelRegistry",
    "__version__",
]
