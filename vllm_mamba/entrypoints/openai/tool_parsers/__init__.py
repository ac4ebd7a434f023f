"""Tool-call parsers: vLLM's `--tool-call-parser` formats, pure text in, calls out.

`ToolParserManager.get(name)(tools)` gives a per-request parser: `extract(text)` for a whole
output, `stream()` for an incremental one (same results for any split of the text). Importing
this package registers the built-in formats; a model family or plugin adds its own with
`@ToolParserManager.register("name")` or `ToolParserManager.register_module(name,
"package.module:Class")`. See `base.py` for the content and fallback rules.
"""

from __future__ import annotations

from . import granite, hermes, llama3_json, nemotron_json, pythonic, qwen3_coder  # noqa: F401
from .base import (
    MarkerToolParser,
    ParsedCall,
    StreamDelta,
    ToolCallStream,
    ToolParseError,
    ToolParser,
    ToolParseResult,
    ToolParserManager,
    WholeOutputToolParser,
)

__all__ = [
    "MarkerToolParser",
    "ParsedCall",
    "StreamDelta",
    "ToolCallStream",
    "ToolParseError",
    "ToolParseResult",
    "ToolParser",
    "ToolParserManager",
    "WholeOutputToolParser",
]
