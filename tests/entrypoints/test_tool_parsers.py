"""Tool-call parsers (`vllm_mamba/entrypoints/openai/tool_parsers/`): hand-written transcripts
in each model family's format, extracted against hand-written calls; strict-mode errors; the
stream fed random splits of every transcript gives what `extract` gives; the registry."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from vllm_mamba.entrypoints.openai.tool_parsers import (
    ParsedCall,
    ToolParseError,
    ToolParser,
    ToolParseResult,
    ToolParserManager,
)
from vllm_mamba.entrypoints.openai.tool_parsers.base import (
    EndScanner,
    MarkerToolParser,
    StreamDelta,
)

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "opts": {"type": "object"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "limit": {"type": ["integer", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_code",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    },
]

# (parser name, text, expected content, expected [(name, arguments dict)])
Case = tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]

CASES: list[Case] = [
    # ---- hermes (Qwen2.5 / Qwen3 / Hermes 2 Pro)
    (
        "hermes",
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run_code", "arguments": '
        '{"code": "print(\\"hi\\")\\nx = \'\\u00e9\'"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Zürich"}), ("run_code", {"code": "print(\"hi\")\nx = 'é'"})],
    ),
    (
        "hermes",
        '\n\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n',
        None,
        [("now", {})],
    ),
    (  # arguments given as a JSON string holding an object; no "arguments" at all
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
        ' and <tool_call>{"name": "g"}</tool_call> done',
        " and  done",
        [("f", {"a": [1, 2]}), ("g", {})],
    ),
    (  # unclosed at EOS with complete JSON: a call
        "hermes",
        'Sure <tool_call>\n{"name": "f", "arguments": {"x": "<tool"}}\n',
        "Sure ",
        [("f", {"x": "<tool"})],
    ),
    (  # unclosed at EOS, incomplete JSON: content
        "hermes",
        'Sure <tool_call>\n{"name": "f", "argu',
        'Sure <tool_call>\n{"name": "f", "argu',
        [],
    ),
    (  # malformed JSON: that region stays content, the good call stands
        "hermes",
        '<tool_call>{"name": f}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        '<tool_call>{"name": f}</tool_call>\n',
        [("g", {})],
    ),
    (  # arguments not an object
        "hermes",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a marker.", None, []),
    ("hermes", "  \n", None, []),
    ("hermes", "", None, []),
    # ---- granite4 (hermes-like; unclosed is content)
    (
        "granite4",
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        " Done.",
        "Checking. Done.",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "granite4",
        '<tool_call>{"name": "f", "arguments": {}}',
        '<tool_call>{"name": "f", "arguments": {}}',
        [],
    ),
    # ---- qwen3_coder (Qwen3-Coder, Qwen3.5)
    (
        "qwen3_coder",
        "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        '<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "<parameter=opts>\n{'deep': {'x': 1}}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
        "<parameter=limit>\nNone\n</parameter>\n</function>\n</tool_call>",
        "I'll look it up.\n",
        [
            (
                "get_weather",
                {
                    "city": "São Paulo",
                    "days": 3,
                    "metric": True,
                    "ratio": 0.5,
                    "tags": ["a", "b"],
                    "opts": {"deep": {"x": 1}},
                    "note": None,
                    "limit": None,
                },
            )
        ],
    ),
    (  # a value holding the end markers literally; multi-line value; two calls
        "qwen3_coder",
        "<tool_call>\n<function=run_code>\n<parameter=code>\nprint('</tool_call>')\n"
        's = "</function>"\n\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n"
        "two\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>",
        None,
        [
            ("run_code", {"code": "print('</tool_call>')\ns = \"</function>\"\n"}),
            ("get_weather", {"city": "Rome", "days": "two", "extra": "42"}),
        ],
    ),
    (  # bare <function=...> without the wrapper; no parameters
        "qwen3_coder",
        "Calling:\n<function=now>\n</function>\nok",
        "Calling:\n\nok",
        [("now", {})],
    ),
    (  # unclosed at EOS: parsed with what is there
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n",
        None,
        [("get_weather", {"city": "Lyon"})],
    ),
    (  # no <function= inside the wrapper: content
        "qwen3_coder",
        "<tool_call>\nnothing here\n</tool_call> after",
        "<tool_call>\nnothing here\n</tool_call> after",
        [],
    ),
    (  # a template-looking name is not a call
        "qwen3_coder",
        "<function={{ tc.name }}></function>",
        "<function={{ tc.name }}></function>",
        [],
    ),
    ("qwen3_xml", "Plain answer with a <b>tag</b>.", "Plain answer with a <b>tag</b>.", []),
    # ---- llama3_json (Llama 3.x / 4)
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "llama3_json",
        ' <|python_tag|>{"name": "f", "arguments": {"q": "a \\"quoted\\" ☃\\n"}}; '
        '{"name": "g", "parameters": {}}\n',
        None,
        [("f", {"q": 'a "quoted" ☃\n'}), ("g", {})],
    ),
    ("llama4_json", '{"name": "f", "parameters": {"x": 1}} trailing', None, []),
    ("llama3_json", '{"answer": 42}', None, []),
    ("llama3_json", "The answer is {42}.", None, []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": ', None, []),
    # ---- pythonic (Llama 3.2 / 4)
    (
        "pythonic",
        '[get_weather(city="Paris", days=3), now()]',
        None,
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    (
        "llama4_pythonic",
        "<|python_start|>[f(s='it\\'s \"ok\"\\n', n=-1.5, b=True, z=None, l=[1, (2, 3)],"
        " d={'k': 'ü'})]<|python_end|>",
        None,
        [
            (
                "f",
                {
                    "s": 'it\'s "ok"\n',
                    "n": -1.5,
                    "b": True,
                    "z": None,
                    "l": [1, [2, 3]],
                    "d": {"k": "ü"},
                },
            )
        ],
    ),
    ("pythonic", "[1] A footnote-style answer.", None, []),
    ("pythonic", '[f("positional")]', None, []),
    ("pythonic", "[f(x=os.getcwd())]", None, []),
    ("pythonic", "Sure, here you go: [f(x=1)]", None, []),
    # ---- granite (Granite 3.x)
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]',
        None,
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    (
        "granite",
        ' <tool_call> [{"name": "f", "arguments": {"s": "line1\\nline2 \\u00e9"}}]',
        None,
        [("f", {"s": "line1\nline2 é"})],
    ),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {}}', None, []),
    ("granite", "Hello! How can I help?", None, []),
    # ---- nemotron_json
    (
        "nemotron_json",
        'Let me see.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]</TOOLCALL>',
        "Let me see.",
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    (
        "nemotron_json",
        '<TOOLCALL>{"name": "f", "arguments": "{\\"x\\": \\"\\u2603\\"}"}</TOOLCALL>\n',
        None,
        [("f", {"x": "☃"})],
    ),
    (
        "nemotron_json",
        '<TOOLCALL>[{"name": "f", "arguments": {"x": 1}}',
        None,
        [("f", {"x": 1})],
    ),
    (
        "nemotron_json",
        "<TOOLCALL>[not json]</TOOLCALL> sorry",
        "<TOOLCALL>[not json]</TOOLCALL> sorry",
        [],
    ),
    ("nemotron_json", "No <TOOL calls here.", None, []),
]


def _fill_defaults(case: Case) -> Case:
    """`None` content with no calls means "the whole text" (None for "")."""
    name, text, content, calls = case
    if content is None and not calls:
        content = text or None
    return name, text, content, calls


CASES = [_fill_defaults(c) for c in CASES]


def _parser(name: str) -> ToolParser:
    return ToolParserManager.get(name)(WEATHER_TOOLS)


def _calls(result_calls: list[ParsedCall]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for c in result_calls:
        args = json.loads(c.arguments)
        assert isinstance(args, dict)
        out.append((c.name, args))
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_extract(case: Case) -> None:
    name, text, content, calls = case
    result = _parser(name).extract(text)
    assert result.content == content
    assert _calls(result.calls) == calls


def _random_splits(text: str, rng: random.Random) -> list[list[str]]:
    splits = [list(text), [text]]
    for _ in range(25):
        pieces, i = [], 0
        while i < len(text):
            n = rng.choice((1, 1, 2, 3, 5, 8, 13, 40))
            pieces.append(text[i : i + n])
            i += n
        splits.append(pieces)
    return splits


def _run_stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    stream = parser.stream()
    content, calls = "", []
    deltas: list[StreamDelta] = [stream.feed(p) for p in pieces] + [stream.finish()]
    for d in deltas:
        content += d.content
        for index, call in d.calls:
            assert index == len(calls)
            calls.append(call)
    return content, calls


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_stream_matches_extract(case: Case) -> None:
    name, text, _, _ = case
    expected = _parser(name).extract(text)
    rng = random.Random(hash(text) & 0xFFFF)
    for pieces in _random_splits(text, rng):
        content, calls = _run_stream(_parser(name), pieces)
        assert content == (expected.content or ""), pieces
        assert calls == expected.calls, pieces


def test_stream_sends_content_early_and_calls_once() -> None:
    stream = _parser("hermes").stream()
    d = stream.feed("Hello <tool")
    assert d.content == "Hello " and not d.calls  # "<tool" may open a marker: held back
    d = stream.feed('_call>{"name": "f", "arguments": {"a": 1}}')
    assert d.content == "" and not d.calls  # inside the region: buffered
    d = stream.feed("</tool_call> bye")
    assert d.content == " bye"
    assert d.calls == [(0, ParsedCall("f", '{"a": 1}'))]
    assert stream.finish() == StreamDelta()


def test_stream_holds_back_leading_whitespace() -> None:
    stream = _parser("hermes").stream()
    assert stream.feed("\n\n").content == ""
    assert stream.feed('<tool_call>{"name": "f"}</tool_call>\n').calls == [
        (0, ParsedCall("f", "{}"))
    ]
    assert stream.finish().content == ""  # only whitespace around calls: never sent
    stream = _parser("hermes").stream()
    assert stream.feed("\n\n").content == ""
    assert stream.feed("Hi").content == "\n\nHi"


def test_whole_output_stream_passes_content_through() -> None:
    stream = _parser("pythonic").stream()
    assert stream.feed("  ").content == ""
    assert stream.feed("Sure").content == "  Sure"
    stream = _parser("llama3_json").stream()
    assert stream.feed('{"name": "f", ').content == ""
    d = stream.finish()
    assert d.content == '{"name": "f", ' and not d.calls


STRICT_ERRORS = [
    ("hermes", '<tool_call>{"name": f}</tool_call>', "not valid JSON"),
    ("hermes", '<tool_call>{"name": "f", "arguments": 3}</tool_call>', "JSON object"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ("granite4", '<tool_call>{"name": "f"}', "not closed"),
    ("qwen3_coder", "<tool_call>\nhello\n</tool_call>", "<function="),
    ("qwen3_coder", "<function=bad name></function>", "invalid function name"),
    ("llama3_json", '{"name": "f"} {"name": "g"}', "';'"),
    ("llama3_json", '{"name": "f", "parameters": {', "not valid JSON"),
    ("pythonic", '[f("x")]', "positional"),
    ("pythonic", "[f(x=y)]", "literals"),
    ("pythonic", "[f(x=1)", "Python list"),
    ("granite", "<|tool_call|>{}", "JSON list"),
    ("nemotron_json", "<TOOLCALL>[]</TOOLCALL>", "non-empty"),
]


@pytest.mark.parametrize("name,text,message", STRICT_ERRORS)
def test_strict_raises(name: str, text: str, message: str) -> None:
    with pytest.raises(ToolParseError, match=message) as e:
        _parser(name).extract(text, strict=True)
    assert name.split("_")[0] in str(e.value)  # the message names the parser
    assert not _parser(name).extract(text).calls  # non-strict: content, no call


def test_strict_accepts_well_formed_and_plain_text() -> None:
    for name, text, content, calls in CASES:
        if calls and "<tool_call>" not in (content or ""):  # skip the half-malformed case
            result = _parser(name).extract(text, strict=True)
            assert _calls(result.calls) == calls and result.content == content
    assert _parser("hermes").extract("just text", strict=True) == ToolParseResult("just text", [])


BIG_INT = "1" * 5000  # past Python's int digit limit (4300)
# Model text that looks like a call but cannot give strict JSON arguments: (parser, text,
# what the strict error says). Non-strict, each is content, verbatim, streamed or not.
NOT_A_CALL = [
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + '{"a":' * 2000, "deeper than"),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 900 + "]" * 900 + "}", "deeper"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>', "surrogate"),
    ("hermes", '<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>', "surrogate"),
    ("hermes", f'<tool_call>{{"name": "f", "arguments": {{"a": {BIG_INT}}}}}', "digits"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": -Infinity}}</tool_call>', "JSON"),
    ("granite4", '<tool_call>{"name": "f", "arguments": ' + "[" * 3000 + "</tool_call>", "deep"),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": ' + '{"a":' * 2000, "deeper than"),
    ("granite", f'[{{"name": "f", "arguments": {{"a": {BIG_INT}}}}}]', "digits"),
    ("nemotron_json", "<TOOLCALL>" + "[" * 2000 + "</TOOLCALL>", "deeper than"),
    ("nemotron_json", '<TOOLCALL>[{"name": "f", "arguments": {"a": "\\ud800"}}]', "surrogate"),
    ("llama3_json", '{"name": "f", "parameters": ' + '{"a":' * 2000, "deeper than"),
    ("llama3_json", f'{{"name": "f", "parameters": {{"a": {BIG_INT}}}}}', "digits"),
    ("llama3_json", '{"name": "f", "parameters": {"a": "\\ud800"}}', "surrogate"),
    ("pythonic", "[f(x=-1e999)]", "inf"),
    ("pythonic", "[f(x=+1e999, y=1)]", "inf"),
    ("pythonic", '[f(x="\\ud800")]', "surrogate"),
    ("pythonic", f"[f(x={BIG_INT})]", "digits"),
    ("pythonic", "[f(x=" + "-" * 100_000 + "1)]", "not a Python expression"),
    ("pythonic", "[f(x=" + "[" * 150 + "]" * 150 + ")]", "deeper than"),
]


@pytest.mark.parametrize(
    "name,text,message", NOT_A_CALL, ids=[f"{c[0]}-{i}" for i, c in enumerate(NOT_A_CALL)]
)
def test_model_text_that_cannot_be_arguments_is_content(name: str, text: str, message: str) -> None:
    """Nesting past the bound, huge integers, non-finite numbers and escaped lone surrogates
    never raise out of a parser (a 500, or a cut stream): the region is content."""
    with pytest.raises(ToolParseError, match=message):
        _parser(name).extract(text, strict=True)
    assert _parser(name).extract(text) == ToolParseResult(text, [])
    for pieces in ([text], [text[i : i + 7] for i in range(0, len(text), 7)]):
        assert _run_stream(_parser(name), pieces) == (text, [])


def test_qwen3_values_that_cannot_be_json_stay_strings() -> None:
    """A typed parameter whose value would be too deep, a huge integer or hold a lone
    surrogate is its raw text (vLLM's rule for a value that does not convert); within the
    bound, it converts."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "deep": {"type": "array"},
                        "near": {"type": "array"},
                        "count": {"type": "integer"},
                        "list": {"type": "array"},
                        "odd": {"type": "array"},
                    },
                },
            },
        }
    ]
    values = {
        "deep": "[" * 1000,
        "near": "[" * 60 + "]" * 60,
        "count": BIG_INT,
        "list": f"[{BIG_INT}]",
        "odd": '["\\ud800"]',
    }
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"
    [call] = ToolParserManager.get("qwen3_coder")(tools).extract(text, strict=True).calls
    args = json.loads(call.arguments)
    assert args == {**values, "near": json.loads(values["near"])}


def test_qwen3_without_tools_keeps_strings() -> None:
    text = "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>"
    result = ToolParserManager.get("qwen3_coder")(None).extract(text)
    assert _calls(result.calls) == [("get_weather", {"days": "3"})]


def test_end_scanner_is_incremental() -> None:
    scanner = EndScanner("</tool_call>", "<parameter=", "</parameter>")
    body = "<parameter=a>x</tool_call></parameter>\n</tool_call>tail"
    found = None
    for i, ch in enumerate(body):
        found = scanner.scan(ch)
        if found:
            assert i == body.index("tail") - 1
            break
        assert len(scanner.tail) < len("</tool_call>")  # never more than a marker held
    assert found is not None and body[found[0] : found[1]] == "</tool_call>"
    assert found[0] == body.rindex("</tool_call>")


def test_long_stream_is_linear() -> None:
    """A long output fed one character at a time stays fast (no rescans of the whole)."""
    calls = "".join(
        f'<tool_call>{{"name": "f{i}", "arguments": {{"x": "{"y" * 200}"}}}}</tool_call>\n'
        for i in range(100)
    )
    text = ("word <tool " * 2000) + calls + ("end " * 4000)
    stream = _parser("hermes").stream()
    content, got = "", []
    for ch in text:
        d = stream.feed(ch)
        content += d.content
        got += d.calls
        assert len(stream.held) < len("<tool_call>")  # content held back: under a marker
    content += stream.finish().content
    assert content == ("word <tool " * 2000) + "\n" * 100 + ("end " * 4000)
    assert [i for i, _ in got] == list(range(100))
    result = _parser("hermes").extract(text)  # one long feed, cut into bounded pieces
    assert result.content == content and result.calls == [c for _, c in got]


def test_registry() -> None:
    names = ToolParserManager.names()
    for n in (
        "hermes",
        "qwen3_coder",
        "qwen3_xml",
        "llama3_json",
        "llama4_json",
        "pythonic",
        "llama4_pythonic",
        "granite",
        "granite4",
        "nemotron_json",
    ):
        assert n in names
    with pytest.raises(ValueError, match="hermes") as e:
        ToolParserManager.get("no_such_parser")
    assert "no_such_parser" in str(e.value) and "qwen3_coder" in str(e.value)
    assert ToolParserManager.get("qwen3_xml") is ToolParserManager.get("qwen3_coder")
    assert ToolParserManager.get("granite").needs_special_tokens
    assert ToolParserManager.get("nemotron_json").needs_special_tokens
    assert not ToolParserManager.get("pythonic").needs_special_tokens


def test_register_custom_parser() -> None:
    @ToolParserManager.register("test_bracket_calls")
    class BracketParser(MarkerToolParser):
        """`[[name]]` calls with no arguments."""

        start_markers = ("[[",)

        def end_scanner(self, start: str) -> EndScanner:
            return EndScanner("]]")

        def parse_region(self, start: str, body: str, closed: bool) -> list[ParsedCall]:
            if not body.isidentifier():
                raise ToolParseError(f"bad name {body!r}")
            return [ParsedCall(body, "{}")]

    try:
        assert BracketParser.name == "test_bracket_calls"
        assert "test_bracket_calls" in ToolParserManager.names()
        parser = ToolParserManager.get("test_bracket_calls")()
        result = parser.extract("a [[ping]] b [[no way]]")
        assert result == ToolParseResult("a  b [[no way]]", [ParsedCall("ping", "{}")])
        content, calls = _run_stream(ToolParserManager.get("test_bracket_calls")(), list("x[[y]]"))
        assert (content, calls) == ("x", [ParsedCall("y", "{}")])
    finally:
        ToolParserManager._parsers.pop("test_bracket_calls", None)


def test_register_module_lazily() -> None:
    ToolParserManager.register_module(
        "test_lazy_hermes", "vllm_mamba.entrypoints.openai.tool_parsers.hermes:HermesToolParser"
    )
    try:
        assert "test_lazy_hermes" in ToolParserManager.names()
        cls = ToolParserManager.get("test_lazy_hermes")
        assert cls.name == "hermes"  # the class keeps its own name
    finally:
        ToolParserManager._parsers.pop("test_lazy_hermes", None)
        ToolParserManager._lazy.pop("test_lazy_hermes", None)


FUZZ_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "</tool",
    "<function=f>",
    "</function>",
    "<parameter=city>",
    "</parameter>",
    "<TOOLCALL>",
    "</TOOLCALL>",
    "<|tool_call|>",
    "<|python_tag|>",
    "<|python_start|>",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g"}',
    "[f(x=1)]",
    "[",
    "]",
    "{",
    ";",
    " ",
    "\n",
    "hi",
    "é",
    "<",
]


@pytest.mark.parametrize("name", sorted(set(c[0] for c in CASES)))
def test_fuzz_stream_matches_extract(name: str) -> None:
    rng = random.Random(name)
    for _ in range(60):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(0, 12)))
        expected = _parser(name).extract(text)
        if expected.calls:  # whitespace-only content around calls is None
            assert expected.content is None or expected.content.strip()
        else:  # no call: the whole text, verbatim
            assert expected.content == (text or None)
        for pieces in _random_splits(text, rng)[:6]:
            content, calls = _run_stream(_parser(name), pieces)
            assert (content, calls) == (expected.content or "", expected.calls), (text, pieces)
