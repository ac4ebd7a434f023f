"""How the server reads a choice (`chat_output.py`): the reasoning parser, then the tool-call
parser, whole and streamed, on transcripts in each model family's real format; and the
required / named choices, whose unfinished or malformed output is an error."""

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
def test_required_and_named_choices_are_calls_or_errors(mode: str) -> None:
    p = parsing(None, None, "", mode)
    p.named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    whole = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    if mode == "named":
        whole = '{"city": "Paris"}'
    out = p.parse(whole, "stop")
    assert out.content is None and [c.function.name for c in out.tool_calls] == ["get_weather"]
    assert json.loads(out.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert out.finish_reason == ("tool_calls" if mode == "required" else "stop")
    piece, _ = streamed(p, whole, random.Random(3))
    assert piece.content == "" and [d.index for d in piece.tool_calls] == [0]
    with pytest.raises(ToolOutputError) as cut:
        p.parse(whole[:-3], "length")
    assert cut.value.status == 400 and "max_tokens" in str(cut.value)
    with pytest.raises(ToolOutputError) as bad:
        p.parse('{"city": "Pa\x01ris"}' if mode == "named" else "[{]", "stop")
    assert bad.value.status == 500
    stream = p.stream()
    stream.feed(whole[:-3])
    with pytest.raises(ToolOutputError):
        stream.finish("length")


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


@pytest.mark.parametrize(
    "name, kwargs, prompt, waits",
    [
        ("qwen3", None, "<|im_start|>assistant\n<think>\n", True),  # opened by the template
        ("qwen3", None, "<|im_start|>assistant\n", True),  # the model may open it
        ("qwen3", {"enable_thinking": False}, "<|im_start|>assistant\n", False),
        ("qwen3", None, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("deepseek_r1", {"enable_thinking": False}, "<|Assistant|>", True),  # R1 ignores it
        ("nemotron_v3", {"enable_thinking": False}, "<SPECIAL_11>Assistant\n", False),
        ("granite", None, "<|start_of_role|>assistant<|end_of_role|>", False),
        ("granite", {"thinking": True}, "<|start_of_role|>assistant<|end_of_role|>", True),
    ],
)
def test_grammars_wait_for_the_end_of_reasoning_only_when_it_may_come(
    name: str, kwargs: dict | None, prompt: str, waits: bool
) -> None:
    parser = ReasoningParserManager.get(name)(kwargs)
    assert parser.waits_for_end(prompt, parser.starts_in_reasoning(prompt)) is waits
