"""`granite`: IBM Granite 3.2+ with `thinking=True` in the chat template kwargs.

The model writes plain-text headings, not tokens: "Here is my thought process:" opens
the reasoning and "Here is my response:" opens the answer; "Here's ..." variants of both
are accepted (seen from quantized models), as in vLLM's granite parser. The opening
heading counts only at the very start of the output; the response heading only inside
the reasoning. No opening heading: all content. Opened but never answered (cut short):
all reasoning (vLLM's streaming behaviour; its non-streaming regex would call it
content). Text around the headings (the newlines after them) is kept.

The generation prompt never opens the reasoning, so `starts_in_reasoning` is False
unless the prompt itself ends with an opening heading (and `thinking` is on); the headings
are parsed whenever they appear, whatever `thinking` says.
"""

from __future__ import annotations

from typing import ClassVar

from vllm_mamba.entrypoints.openai.reasoning.base import (
    Boundary,
    MarkerParser,
    Markers,
    ReasoningParserManager,
)

THINK_STARTS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_STARTS = ("Here is my response:", "Here's my response:")


@ReasoningParserManager.register("granite")
class GraniteReasoningParser(MarkerParser):
    """Granite's "Here is my thought process:" / "Here is my response:" headings."""

    end_marker: ClassVar[str] = RESPONSE_STARTS[0]
    start_markers: ClassVar[tuple[str, ...]] = THINK_STARTS

    @property
    def thinking_enabled(self) -> bool:
        """Granite thinks only with `thinking: true` in the chat template kwargs."""
        return bool(self.chat_template_kwargs.get("thinking"))

    def starts_in_reasoning(self, prompt: str) -> bool:
        return self.thinking_enabled and prompt.rstrip().endswith(THINK_STARTS)

    def boundaries(self) -> tuple[Boundary, ...]:
        return (Markers(*RESPONSE_STARTS),)
