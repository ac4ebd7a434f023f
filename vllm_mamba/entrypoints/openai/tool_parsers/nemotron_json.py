"""`nemotron_json` (Nemotron-H, Llama-Nemotron): `<TOOLCALL>[{"name": ..., "arguments":
{...}}, ...]</TOOLCALL>` regions inside free text.

As in vLLM the payload may omit its list brackets (a single object or comma-separated
objects are accepted) and the markers need skip_special_tokens=False. A region still open at
the end of the output is parsed like a closed one (the end marker may be the stop token).
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

TOOLCALL_START = "<TOOLCALL>"
TOOLCALL_END = "</TOOLCALL>"


@ToolParserManager.register("nemotron_json")
class NemotronJsonToolParser(MarkerToolParser):
    """`<TOOLCALL>` JSON list `</TOOLCALL>` regions."""

    needs_special_tokens: ClassVar[bool] = True
    start_markers: ClassVar[tuple[str, ...]] = (TOOLCALL_START,)

    def end_scanner(self, start: str) -> EndScanner:
        return EndScanner(TOOLCALL_END)

    def parse_region(self, start: str, body: str, closed: bool) -> list[ParsedCall]:
        payload = body.strip()
        if not payload:
            raise ToolParseError(f"empty {TOOLCALL_START} region")
        if not payload.startswith("["):
            payload = "[" + payload
        if not payload.endswith("]"):
            payload += "]"
        items = loads_json(payload, f"the {TOOLCALL_START} payload")
        if not isinstance(items, list) or not items:
            raise ToolParseError(f"the {TOOLCALL_START} payload must be a non-empty list")
        return [call_from_object(item, ("arguments",)) for item in items]
