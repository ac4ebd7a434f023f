"""`llama3_json` / `llama4_json` (Llama 3.1-3.3, Llama 4 with the JSON tool template): the
whole output, after optional whitespace and an optional `<|python_tag|>`, is one or more JSON
objects `{"name": ..., "parameters": {...}}` (or `"arguments"`) separated by `;`.

Anything else is content (stricter than vLLM's non-streaming parser, which picks JSON objects
out of surrounding prose, and the same as its streaming one). The calls end at the end of the
output, so a stream that starts with `{` or `<|python_tag|>` sends nothing until `finish()`.
"""

from __future__ import annotations

import json
from typing import ClassVar

from .base import (
    MAX_JSON_DEPTH,
    ParsedCall,
    ToolParseError,
    ToolParserManager,
    WholeOutputToolParser,
    call_from_object,
    json_depth,
)

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register("llama4_json")
@ToolParserManager.register("llama3_json")
class Llama3JsonToolParser(WholeOutputToolParser):
    """`;`-separated JSON call objects, the whole output."""

    call_prefixes: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "{")

    def parse_output(self, text: str) -> list[ParsedCall]:
        text = text.removeprefix(PYTHON_TAG)
        if json_depth(text) > MAX_JSON_DEPTH:
            raise ToolParseError(f"the calls are nested deeper than {MAX_JSON_DEPTH} levels")
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos, n = 0, len(text)
        while True:
            while pos < n and text[pos].isspace():
                pos += 1
            if pos >= n or text[pos] != "{":
                raise ToolParseError(f"expected a JSON call object at offset {pos}")
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                raise ToolParseError(f"a call is not valid JSON: {e}") from None
            calls.append(call_from_object(obj, ("arguments", "parameters")))
            while pos < n and text[pos].isspace():
                pos += 1
            if pos >= n:
                return calls
            if text[pos] != ";":
                raise ToolParseError(f"expected ';' or the end after a call at offset {pos}")
            pos += 1
