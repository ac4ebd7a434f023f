"""vllm_mamba: a vLLM-style inference and serving engine for state-space language models."""

from vllm_mamba.logger import init_logger
from vllm_mamba.ops.cpu_isa import cap_libraries

init_logger()
cap_libraries()  # a forced VLLM_MAMBA_CPU_ISA caps torch's libraries before they start

from vllm_mamba.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_mamba.llm import LLM  # noqa: E402
from vllm_mamba.models.registry import ModelRegistry  # noqa: E402
from vllm_mamba.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from vllm_mamba.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

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
