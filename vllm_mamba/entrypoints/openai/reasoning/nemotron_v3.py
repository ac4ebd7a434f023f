"""`nemotron_v3`: NVIDIA Nemotron 3 (Nano) and Nemotron-H reasoning models.

`<think>...</think>` read as `deepseek_r1` (reasoning from the first character up to
`</think>`, all reasoning when it never closes), but honouring `enable_thinking: false`
as vLLM's nemotron_v3 parser does: the template then closes the block in the prompt
("<think></think>") and the output is all content (unless it begins with `<think>`).

`needs_special_tokens` is True: the think markers may be special tokens in NVIDIA's
tokenizers, and the parser must see them in the text.
"""

from __future__ import annotations

from typing import ClassVar

from vllm_mamba.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningParserManager
from vllm_mamba.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@ReasoningParserManager.register("nemotron_v3")
class NemotronV3ReasoningParser(DeepSeekR1ReasoningParser):
    """`deepseek_r1` with the `enable_thinking` switch."""

    needs_special_tokens: ClassVar[bool] = True

    thinking_enabled = ReasoningParser.thinking_enabled  # honours `enable_thinking`

    def starts_in_reasoning(self, prompt: str) -> bool:
        return self.thinking_enabled and super().starts_in_reasoning(prompt)
