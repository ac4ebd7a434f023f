"""vllm_mamba: a vLLM-style inference and serving engine for state-space language models."""

from vllm_mamba.llm import LLM
from vllm_mamba.models.registry import ModelRegistry
from vllm_mamba.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_mamba.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "ModelRegistry",
    "__version__",
]
