"""`pythonic` / `llama4_pythonic` (Llama 3.2, Llama 4, ToolACE): the whole output is a Python
list of calls, `[get_weather(city="Paris", days=3), f()]`, optionally wrapped in Llama 4's
`<|python_start|>` ... `<|python_end|>`.

Parsed with `ast`; keyword arguments with literal values only (strings, numbers, signed
numbers, booleans, None, lists, tuples as lists, dicts with string keys). Anything else
(positional arguments, expressions, prose) is content. The calls end at the end of the
output: a stream starting with `[` sends nothing until `finish()`.
"""

from __future__ import annotations

import ast
import math
from typing import Any, ClassVar

from .base import (
    ParsedCall,
    ToolParseError,
    ToolParserManager,
    WholeOutputToolParser,
    json_text,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal expression; ToolParseError for anything else."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
        raise ToolParseError(f"unsupported literal {v!r}")
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        v = _literal(node.operand)  # a finite number (`-1e999` is -inf: refused)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ToolParseError("dict arguments need string literal keys")
            out[k.value] = _literal(v)
        return out
    raise ToolParseError(f"arguments must be literals, got {ast.dump(node)[:60]}")


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call):
        raise ToolParseError("each list element must be a function call")
    if not isinstance(node.func, ast.Name):
        raise ToolParseError("a call's function must be a plain name")
    if node.args:
        raise ToolParseError(f"{node.func.id}(): positional arguments are not supported")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ToolParseError(f"{node.func.id}(): **kwargs is not supported")
        args[kw.arg] = _literal(kw.value)
    return ParsedCall(name=node.func.id, arguments=json_text(args, f"{node.func.id}()"))


@ToolParserManager.register("llama4_pythonic")
@ToolParserManager.register("pythonic")
class PythonicToolParser(WholeOutputToolParser):
    """A Python list of keyword-argument calls, the whole output."""

    call_prefixes: ClassVar[tuple[str, ...]] = (PYTHON_START, "[")

    def parse_output(self, text: str) -> list[ParsedCall]:
        src = text.strip()
        if src.startswith(PYTHON_START):
            src = src.removeprefix(PYTHON_START).strip().removesuffix(PYTHON_END).strip()
        if not (src.startswith("[") and src.endswith("]")):
            raise ToolParseError("the output must be a Python list of calls")
        try:
            tree = ast.parse(src, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise ToolParseError(f"not a Python expression: {e}") from None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            raise ToolParseError("the output must be a non-empty Python list of calls")
        return [_call(e) for e in tree.body.elts]
