"""How the server reads a choice (`chat_output.py`): the reasoning parser, then the tool-call
parser, whole and streamed, on transcripts in each model family's real format; and the
required / named choices: their calls, streamed as generated, cut short by max_tokens, or an
error when the output ended otherwise unfinished or malformed; where their grammars start."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from vllm_mamba.entrypoints.openai.chat_output import (
    OutputParsing,
    StreamPiece,
    ToolOutputError,
)
from vllm_mamba.entrypoints.openai.reasoning import ReasoningParserManager
from vllm_mamba.entrypoints.openai.tool_calls import NamedFunction, NamedToolChoice
from vllm_mamba.entrypoints.openai.tool_parsers import ToolParserManager

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
PARIS = {"city": "Paris", "days": 3}

# (tool parser, reasoning parser, prompt end, output text, reasoning, content, calls)
CASES: list[tuple[str, str | None, str, str, str | None, str | None, list[tuple[str, dict]]]] = [
    (
        "hermes",
        "qwen3",
        "<|im_start|>assistant\n",
        '<think>\nParis, three days.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "now", '
        '"arguments": {}}\n</tool_call>',
        "\nParis, three days.\n",
        "\n\nChecking.\n\n",  # all text outside the calls (the newline between them too)
        [("get_weather", PARIS), ("now", {})],
    ),
    (
        "qwen3_coder",
        "qwen3",
        "<|im_start|>assistant\n<think>\n",
        "The user wants Paris.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "The user wants Paris.\n",
        None,
        [("get_weather", PARIS)],
    ),
    (
        "llama3_json",
        None,
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        None,
        [("get_weather", PARIS)],
    ),
    (
        "pythonic",
        None,
        "assistant\n",
        '[get_weather(city="Paris", days=3), now()]',
        None,
        None,
        [("get_weather", PARIS), ("now", {})],
    ),
    (
        "granite",
        "granite",
        "<|start_of_role|>assistant<|end_of_role|>",
        'Here is my thought process: a lookup.\nHere is my response: <|tool_call|>[{"name": '
        '"get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        " a lookup.\n",
        None,
        [("get_weather", PARIS)],
    ),
    (
        "nemotron_json",
        "nemotron_v3",
        "<SPECIAL_11>Assistant\n<think>\n",
        'Use the tool.</think><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}]</TOOLCALL>',
        "Use the tool.",
        None,
        [("get_weather", PARIS)],
    ),
    (
        "hermes",
        None,
        "",
        "No tools needed: it is sunny.",
        None,
        "No tools needed: it is sunny.",
        [],
    ),
]


def parsing(tool: str | None, reasoning: str | None, prompt: str, mode: str = "auto") -> Any:
    p = OutputParsing(tool_mode=mode)
    if tool is not None:
        p.tool_parser = ToolParserManager.get(tool)(TOOLS)
    if reasoning is not None:
        p.reasoning = ReasoningParserManager.get(reasoning)(None)
        p.in_reasoning = p.reasoning.starts_in_reasoning(prompt)
    return p


def streamed(p: OutputParsing, text: str, rng: random.Random) -> tuple[StreamPiece, str | None]:
    stream = p.stream()
    total = StreamPiece()
    i = 0
    while i < len(text):
        j = min(len(text), i + rng.choice([1, 2, 3, 7, 20]))
        piece = stream.feed(text[i:j])
        total = StreamPiece(
            total.reasoning + piece.reasoning,
            total.content + piece.content,
            total.tool_calls + piece.tool_calls,
        )
        i = j
    rest = stream.finish("stop")
    total = StreamPiece(
        total.reasoning + rest.reasoning,
        total.content + rest.content,
        total.tool_calls + rest.tool_calls,
    )
    return total, stream.finish_reason("stop")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_whole_and_streamed_choices_agree(case: tuple) -> None:
    tool, reasoning, prompt, text, want_reasoning, want_content, want_calls = case
    p = parsing(tool, reasoning, prompt)
    whole = p.parse(text, "stop")
    assert whole.reasoning == want_reasoning
    assert whole.content == want_content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == (
        want_calls
    )
    assert whole.finish_reason == ("tool_calls" if want_calls else "stop")
    assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)
    rng = random.Random(7)
    for _ in range(20):
        piece, finish = streamed(p, text, rng)
        assert piece.reasoning == (want_reasoning or "")
        assert piece.content == (want_content or "")
        assert [d.index for d in piece.tool_calls] == list(range(len(want_calls)))
        assert all(d.id and d.type == "function" for d in piece.tool_calls)
        got = [(d.function.name, json.loads(d.function.arguments)) for d in piece.tool_calls]
        assert got == want_calls and finish == whole.finish_reason


def test_reasoning_can_be_left_out() -> None:
    p = parsing(None, "deepseek_r1", "<think>\n")
    p.include_reasoning = False
    out = p.parse("thinking...</think>The answer.", "stop")
    assert out.reasoning is None and out.content == "The answer."
    piece, _ = streamed(p, "thinking...</think>The answer.", random.Random(1))
    assert piece.reasoning == "" and piece.content == "The answer."


@pytest.mark.parametrize("mode", ["required", "named"])
def test_required_and_named_choices_are_calls_cut_calls_or_errors(mode: str) -> None:
    p = parsing(None, None, "", mode)
    p.named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    whole = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    if mode == "named":
        whole = '{"city": "Paris"}'
    out = p.parse(whole, "stop")
    assert out.content is None and [c.function.name for c in out.tool_calls] == ["get_weather"]
    assert out.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert out.finish_reason == ("tool_calls" if mode == "required" else "stop")
    piece, _ = streamed(p, whole, random.Random(3))
    assert piece.content == "" and [d.index for d in piece.tool_calls] == [0]
    # cut by max_tokens: `length` and the call so far (OpenAI's contract)
    cut = p.parse(whole[: whole.index("Paris") + 3], "length")
    assert cut.content is None and cut.finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in cut.tool_calls] == [
        ("get_weather", '{"city": "Par')
    ]
    stream = p.stream()
    stream.feed(whole[: whole.index("Paris") + 3])
    rest = stream.finish("length")
    assert [d.function.arguments for d in rest.tool_calls] == ['{"city": "Par']
    assert stream.finish_reason("length") == "length"
    if mode == "required":  # cut before the name is complete: no call yet
        assert p.parse('[{"name": "get_wea', "length").tool_calls == []
    # ended otherwise without a complete, well-formed call: the server is at fault
    for bad in ('{"city": "Pa\x01ris"}', '{"city": "Pa'):
        text = bad if mode == "named" else f'[{{"name": "get_weather", "parameters": {bad}}}]'
        with pytest.raises(ToolOutputError) as err:
            p.parse(text, "stop")
        assert err.value.status == 500


@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_calls_stream_as_generated(mode: str) -> None:
    """In chat streams a call's first piece has its index, id, type, name and the arguments
    so far, the later pieces only index and argument text; together they are the whole
    answer's calls, whatever the split."""
    p = parsing(None, None, "", mode)
    p.named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    args = ['{"city": "P\\"a}r,is", "days": 3}', "{}"]
    whole = (
        args[0]
        if mode == "named"
        else (
            f'[{{"name": "get_weather", "parameters": {args[0]}}}, '
            f'{{"parameters": {args[1]}, "name": "now"}}]'
        )
    )
    want = (
        [("get_weather", args[0])]
        if mode == "named"
        else [
            ("get_weather", args[0]),
            ("now", args[1]),
        ]
    )
    assert [(c.function.name, c.function.arguments) for c in p.parse(whole, "stop").tool_calls] == (
        want
    )
    rng = random.Random(5)
    for _ in range(30):
        stream = p.stream(incremental=True)
        pieces, i = [], 0
        while i < len(whole):
            j = min(len(whole), i + rng.choice([1, 2, 5, 11]))
            pieces += stream.feed(whole[i:j]).tool_calls
            i = j
        pieces += stream.finish("stop").tool_calls
        calls: dict[int, list[str]] = {}
        for d in pieces:
            sent = d.model_dump()
            if d.index not in calls:
                assert sent.keys() == {"index", "id", "type", "function"}
                assert sent["function"].keys() == {"name", "arguments"}
                calls[d.index] = [d.function.name, ""]
            else:
                assert sent == {"index": d.index, "function": {"arguments": d.function.arguments}}
            calls[d.index][1] += d.function.arguments
        assert [tuple(calls[k]) for k in sorted(calls)] == want
        assert stream.finish_reason("stop") == ("tool_calls" if mode == "required" else "stop")


@pytest.mark.parametrize(
    ("reasoning", "kwargs", "prompt", "start_after"),
    [
        ("qwen3", None, "<|im_start|>assistant\n<think>\n", "</think>"),  # opened by the template
        # not opened: read as content from the first token, so no waiting for </think>
        ("qwen3", None, "<|im_start|>assistant\n", None),
        ("qwen3", {"enable_thinking": False}, "<|im_start|>assistant\n", None),
        ("qwen3", None, "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),
        ("deepseek_r1", {"enable_thinking": False}, "<|Assistant|>", "</think>"),  # ignored
        ("nemotron_v3", {"enable_thinking": False}, "<SPECIAL_11>Assistant\n", None),
        ("granite", None, "<|start_of_role|>assistant<|end_of_role|>", None),
        ("granite", {"thinking": True}, "<|start_of_role|>assistant<|end_of_role|>", None),
    ],
)
def test_grammars_start_where_the_parser_reads_the_answer(
    reasoning: str, kwargs: dict[str, Any] | None, prompt: str, start_after: str | None
) -> None:
    """One decision: a grammar waits for the reasoning's end exactly when the output is read
    as starting inside the reasoning; otherwise it applies from the first token, where the
    parser reads content."""
    p = OutputParsing(tool_mode="required")
    p.reasoning = ReasoningParserManager.get(reasoning)(kwargs)
    p.in_reasoning = p.reasoning.starts_in_reasoning(prompt)
    assert p.grammar_start_after() == start_after
    answer = '[{"name": "now", "parameters": {}}]'
    out = p.parse(answer if start_after is None else f"hm{start_after}{answer}", "stop")
    assert [c.function.name for c in out.tool_calls] == ["now"]
    assert out.reasoning == (None if start_after is None else "hm")


def test_required_after_reasoning_parses_only_the_answer() -> None:
    p = parsing(None, "qwen3", "<|im_start|>assistant\n<think>\n", "required")
    text = 'Need weather.</think>[{"name": "now", "parameters": {}}]'
    out = p.parse(text, "stop")
    assert out.reasoning == "Need weather." and out.tool_calls[0].function.name == "now"


def test_llm_chat_renders_tools_and_kwargs_as_transformers_and_caches_message_ends() -> None:
    """`LLM.chat` passes tools, earlier calls, tool results and template variables to the
    template exactly as transformers does, and with prefix caching a second conversation
    sharing the system message starts from its snapshot."""
    from transformers import AutoTokenizer

    from tests.entrypoints.test_agentic_served import TOOLS_TEMPLATE, WEATHER
    from tests.tiny_models import TOKENIZER_DIR, tiny_model_dir
    from vllm_mamba import LLM, SamplingParams

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "Weather desk. " * 40},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Paris?"}, {"type": "text", "text": "Now."}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    view = json.loads(json.dumps(messages))
    view[1]["content"] = "Paris?\nNow."
    view[2]["content"] = ""
    view[2]["tool_calls"][0]["function"]["arguments"] = {}
    want = tokenizer.apply_chat_template(
        view,
        tools=[WEATHER],
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    llm = LLM(tiny_model_dir("tied"), enable_prefix_caching=True, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=4)
    kwargs = dict(
        chat_template=TOOLS_TEMPLATE,
        tools=[WEATHER],
        chat_template_kwargs={"enable_thinking": False},
        use_tqdm=False,
    )
    first = llm.chat(messages, params, **kwargs)[0]
    assert first.prompt == want and '<tool_response id="c1">' in want
    other = messages[:1] + [{"role": "user", "content": "Oslo?"}]
    second = llm.chat(other, params, **kwargs)[0]
    system = tokenizer.apply_chat_template(
        view[:1], tools=[WEATHER], chat_template=TOOLS_TEMPLATE, tokenize=False
    )
    assert second.num_cached_tokens >= len(tokenizer.encode(system)) - 1
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(messages, params, chat_template=TOOLS_TEMPLATE, chat_template_kwargs={"tools": 1})
