"""`qwen3`: Qwen3 (hybrid thinking), Qwen3-2507 thinking, Qwen3-Next, Qwen3.5 / 3.6.

The reasoning part is `<think>...</think>`, then the answer. Two template styles:

- Qwen3 hybrid models emit `<think>` themselves (the generation prompt ends with
  "<|im_start|>assistant\\n"): the output starts outside reasoning and a leading `<think>`
  opens it;
- Qwen3.5 and the 2507 thinking models get "<think>\\n" at the end of the generation
  prompt: the output starts inside reasoning and only `</think>` appears.

`enable_thinking: false` (the template then closes the block in the prompt,
"<think>\\n\\n</think>\\n\\n") makes the output start outside reasoning, so it is all
content unless it begins with `<think>`. Rules, as vLLM's qwen3 parser:

- `</think>` ends the reasoning; a leading `<think>` is dropped;
- started in reasoning (or opened by `<think>`) and never closed (cut by max_tokens): all
  reasoning;
- Qwen3.5 may open a tool call inside the reasoning without closing it: `<tool_call>`
  followed (after at most 32 whitespace characters) by `<function=` or `<function ` ends
  the reasoning too, and the content starts at `<tool_call>` (kept, for the tool parser).
  A bare `<tool_call>` mention is reasoning text. Whichever of `</think>` and such a tool
  call comes first ends the reasoning (vLLM's streaming order; its non-streaming path
  prefers a later `</think>`).

`<think>` / `</think>` are ordinary added tokens in Qwen tokenizers (not special): they
survive `skip_special_tokens=True`.
"""

from __future__ import annotations

import re
from typing import ClassVar

from vllm_mamba.entrypoints.openai.reasoning.base import (
    Boundary,
    MarkerParser,
    Markers,
    ReasoningParserManager,
)

_TOOL_CALL = "<tool_call>"
_FUNCTION = "<function"
_MAX_GAP = 32  # whitespace allowed between <tool_call> and <function


class ToolCallStart(Boundary):
    """A `<tool_call>` that really opens a call: `<tool_call>`, up to 32 whitespace
    characters, then `<function` and `=` or whitespace. The tag stays in the content."""

    _FULL = re.compile(rf"{re.escape(_TOOL_CALL)}\s{{0,{_MAX_GAP}}}{_FUNCTION}[=\s]")
    _GAP = re.compile(r"\s*")
    # the longest text that can still be an unfinished occurrence
    _WINDOW = len(_TOOL_CALL) + _MAX_GAP + len(_FUNCTION)

    def find(self, text: str) -> tuple[int, int] | None:
        match = self._FULL.search(text)
        return None if match is None else (match.start(), match.start())

    def hold_from(self, text: str) -> int:
        n = len(text)
        lo = max(0, n - self._WINDOW)
        at = text.find(_TOOL_CALL, lo)
        while at >= 0:
            gap = self._GAP.match(text, at + len(_TOOL_CALL))
            assert gap is not None
            rest = text[gap.end() :]
            if gap.end() - at - len(_TOOL_CALL) <= _MAX_GAP and _FUNCTION.startswith(rest):
                return at
            at = text.find(_TOOL_CALL, at + 1)
        for k in range(min(len(_TOOL_CALL) - 1, n), 0, -1):
            if _TOOL_CALL.startswith(text[n - k :]):
                return n - k
        return n


@ReasoningParserManager.register("qwen3")
class Qwen3ReasoningParser(MarkerParser):
    """`<think>...</think>` with Qwen's `enable_thinking` switch and tool-call end."""

    end_marker: ClassVar[str] = "</think>"
    start_markers: ClassVar[tuple[str, ...]] = ("<think>",)

    def starts_in_reasoning(self, prompt: str) -> bool:
        return self.thinking_enabled and prompt.rstrip().endswith("<think>")

    def boundaries(self) -> tuple[Boundary, ...]:
        return (Markers(self.end_marker), ToolCallStart())
