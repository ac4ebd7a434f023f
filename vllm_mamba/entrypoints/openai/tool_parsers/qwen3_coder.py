"""`qwen3_coder` / `qwen3_xml` (Qwen3-Coder, Qwen3.5/3.6): XML-style calls inside free text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A region opens at `<tool_call>` (ends at `</tool_call>`) or, as vLLM accepts, at a bare
`<function=` (ends at `</function>`). While inside a `<parameter=...>` value the end markers
are literal text, so code that mentions `</tool_call>` does not cut the call. A region still
open at the end of the output is parsed with what is there.

Parameter values are raw text (one leading and one trailing newline stripped), converted by
the type the request's tool schema gives the parameter, following vLLM's rules: a parameter
the schema does not list (or no schema) stays a string; string types stay strings; integer /
number types become numbers and booleans bools (a bad value stays a string, a bad boolean is
false); object / array types are decoded with json (then `ast.literal_eval`); "null"/"None"
is null for non-string or nullable types; other types try `ast.literal_eval`. A value that
cannot be strict JSON (too deep, NaN, a lone surrogate) stays the raw string.
"""

from __future__ import annotations

import ast
import math
from typing import Any, ClassVar

from .base import (
    EndScanner,
    MarkerToolParser,
    ParsedCall,
    ToolParseError,
    ToolParserManager,
    find_tool_properties,
    json_text,
    loads_json,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_FORBIDDEN_NAME_CHARS = set("{}<>\"' \t\r\n")


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the parameter's primary type, whether null is allowed) from its JSON schema."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        t = schema["type"]
        if isinstance(t, list):
            names = [str(x).strip().lower() for x in t]
            non_null = [x for x in names if x != "null"]
            return (non_null[0] if non_null else "null"), "null" in names
        t = str(t).strip().lower()
        return t, t == "null"
    if isinstance(schema.get("anyOf"), list):
        primary, nullable = None, False
        for option in schema["anyOf"]:
            if isinstance(option, dict) and "type" in option:
                t = str(option["type"]).strip().lower()
                if t == "null":
                    nullable = True
                elif primary is None:
                    primary = t
        return primary or "string", nullable
    return "string", False


def _json_safe(value: Any, raw: str) -> Any:
    """`value` if it can be written as strict JSON (`json_text`), else the raw text."""
    try:
        json_text(value, "a parameter")
    except ToolParseError:
        return raw
    return value


def convert_value(raw: str, name: str, properties: dict[str, Any]) -> Any:
    """A parameter's raw text converted by its schema type (see the module docstring)."""
    if name not in properties:
        return raw
    ptype, nullable = _schema_type(properties[name])
    if nullable and raw.lower() in ("null", "none"):
        return None
    if ptype in _STRING_TYPES:
        return raw
    if raw.lower() in ("null", "none"):
        return None
    if ptype.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if ptype.startswith(("num", "float")):
        try:
            f = float(raw)
        except ValueError:
            return raw
        if not math.isfinite(f):
            return raw
        return int(f) if f.is_integer() else f
    if ptype in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    container = ptype in ("object", "array", "arr") or ptype.startswith(("dict", "list"))
    if container:
        try:
            value = loads_json(raw, "a parameter")
            if isinstance(value, str):
                try:
                    value = ast.literal_eval(value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    pass
            return _json_safe(value, raw)
        except ToolParseError:
            pass
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw
    return _json_safe(value, raw)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


@ToolParserManager.register("qwen3_xml")
@ToolParserManager.register("qwen3_coder")
class Qwen3CoderToolParser(MarkerToolParser):
    """`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`."""

    start_markers: ClassVar[tuple[str, ...]] = (TOOL_CALL_START, FUNCTION_PREFIX)

    def end_scanner(self, start: str) -> EndScanner:
        end = TOOL_CALL_END if start == TOOL_CALL_START else FUNCTION_END
        return EndScanner(end, PARAMETER_PREFIX, PARAMETER_END)

    def parse_region(self, start: str, body: str, closed: bool) -> list[ParsedCall]:
        if start == FUNCTION_PREFIX:
            return [self._parse_function(body)]
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i = body.find(FUNCTION_PREFIX, pos)
            if i < 0:
                break
            fn_body, pos = self._function_span(body, i + len(FUNCTION_PREFIX))
            calls.append(self._parse_function(fn_body))
        if not calls:
            raise ToolParseError(f"no {FUNCTION_PREFIX}NAME> in the {TOOL_CALL_START} region")
        return calls

    @staticmethod
    def _function_span(body: str, pos: int) -> tuple[str, int]:
        """The function body from `pos` (after `<function=`) to its `</function>` (or the
        end), skipping parameter values; and the offset after it."""
        n = len(body)
        i = pos
        while i < n:
            p = body.find(PARAMETER_PREFIX, i)
            e = body.find(FUNCTION_END, i)
            if e < 0:
                return body[pos:], n
            if 0 <= p < e:
                close = body.find(PARAMETER_END, p)
                if close < 0:
                    # Value never closed: the last </function> ends the function.
                    last = body.rfind(FUNCTION_END)
                    return body[pos:last], last + len(FUNCTION_END)
                i = close + len(PARAMETER_END)
                continue
            return body[pos:e], e + len(FUNCTION_END)
        return body[pos:], n

    def _parse_function(self, text: str) -> ParsedCall:
        """One call from the text after `<function=` (its end marker excluded)."""
        gt = text.find(">")
        if gt < 0:
            raise ToolParseError(f"{FUNCTION_PREFIX}NAME has no closing '>'")
        name = text[:gt]
        if not name or any(c in _FORBIDDEN_NAME_CHARS for c in name):
            raise ToolParseError(f"invalid function name {name!r}")
        properties = find_tool_properties(self.tools, name)
        args: dict[str, Any] = {}
        rest = text[gt + 1 :]
        pos = 0
        while True:
            p = rest.find(PARAMETER_PREFIX, pos)
            if p < 0:
                break
            name_start = p + len(PARAMETER_PREFIX)
            name_end = rest.find(">", name_start)
            if name_end < 0:
                raise ToolParseError(f"{PARAMETER_PREFIX}NAME has no closing '>'")
            pname = rest[name_start:name_end]
            if not pname or any(c in _FORBIDDEN_NAME_CHARS for c in pname):
                raise ToolParseError(f"invalid parameter name {pname!r}")
            value_start = name_end + 1
            close = rest.find(PARAMETER_END, value_start)
            if close >= 0:
                value, pos = rest[value_start:close], close + len(PARAMETER_END)
            else:
                # A missing </parameter>: the next parameter on its own line, or the end.
                nxt = rest.find("\n" + PARAMETER_PREFIX, value_start)
                end = nxt + 1 if nxt >= 0 else len(rest)
                value, pos = rest[value_start:end], end
            args[pname] = convert_value(_strip_one_newline(value), pname, properties)
        return ParsedCall(name=name, arguments=json_text(args, f"the arguments of {name!r}"))
