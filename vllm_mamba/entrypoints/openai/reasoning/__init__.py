"""Reasoning-output parsers (`--reasoning-parser NAME`), vLLM's names and behaviour.

Importing the package registers every parser: `qwen3`, `deepseek_r1`, `nemotron_v3`,
`granite`. The interface (`ReasoningParser`, `ReasoningStream`) and the registry
(`ReasoningParserManager`) are in `base.py`; each family has its module.
"""

from vllm_mamba.entrypoints.openai.reasoning.base import (
    ReasoningParser,
    ReasoningParserManager,
    ReasoningStream,
)
from vllm_mamba.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from vllm_mamba.entrypoints.openai.reasoning.granite import GraniteReasoningParser
from vllm_mamba.entrypoints.openai.reasoning.nemotron_v3 import NemotronV3ReasoningParser
from vllm_mamba.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "GraniteReasoningParser",
    "NemotronV3ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ReasoningStream",
]
