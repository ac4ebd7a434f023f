"""`deepseek_r1`: DeepSeek-R1 and its distills (`<think>...</think>`, then the answer).

As vLLM's deepseek_r1 parser: everything up to `</think>` is reasoning, whether or not
the output begins with `<think>` (the R1 template puts "<think>\\n" in the prompt; a
leading `<think>` is dropped); no `</think>` (cut short) means all reasoning. R1 has no
switch to turn thinking off, so the output starts in reasoning unless the prompt itself
ends by closing the block (a prompt ending with "</think>", whitespace aside): then it is
all content unless it begins with `<think>`.

`<think>` / `</think>` are ordinary added tokens in the R1 tokenizers (not special).
"""

from __future__ import annotations

from typing import ClassVar

from vllm_mamba.entrypoints.openai.reasoning.base import MarkerParser, ReasoningParserManager


@ReasoningParserManager.register("deepseek_r1")
class DeepSeekR1ReasoningParser(MarkerParser):
    """`<think>...</think>`, reasoning from the first character."""

    end_marker: ClassVar[str] = "</think>"
    start_markers: ClassVar[tuple[str, ...]] = ("<think>",)

    @property
    def thinking_enabled(self) -> bool:
        """Always: R1 ignores `enable_thinking` (as vLLM's parser)."""
        return True

    def starts_in_reasoning(self, prompt: str) -> bool:
        return not prompt.rstrip().endswith(self.end_marker)
