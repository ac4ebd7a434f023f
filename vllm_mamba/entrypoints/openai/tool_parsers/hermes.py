"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 calls, `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, any number of them inside free text.

A region ends at the first `</tool_call>` (as vLLM's regex does). A `<tool_call>` still open
at the end of the output is parsed too, as vLLM does: a complete JSON object there is a call,
anything else is content. The markers are special tokens in some Hermes tokenizers, so the
server detokenizes with skip_special_tokens=False (vLLM's `adjust_request` does the same).
"""

from __future__ import annotations

from typing import ClassVar

from .base import (
    EndScanner,
    MarkerToolParser,
    ParsedCall,
    ToolParseError,
    ToolParserManager,
    call_from_object,
    loads_json,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@ToolParserManager.register("hermes")
class HermesToolParser(MarkerToolParser):
    """`<tool_call>` JSON `</tool_call>` regions; one JSON object per region."""

    needs_special_tokens: ClassVar[bool] = True
    start_markers: ClassVar[tuple[str, ...]] = (TOOL_CALL_START,)

    def end_scanner(self, start: str) -> EndScanner:
        return EndScanner(TOOL_CALL_END)

    def parse_region(self, start: str, body: str, closed: bool) -> list[ParsedCall]:
        payload = body.strip()
        if not payload:
            raise ToolParseError(f"empty {TOOL_CALL_START} region")
        return [call_from_object(loads_json(payload, f"the {TOOL_CALL_START} body"))]
