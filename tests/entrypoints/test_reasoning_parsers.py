"""The reasoning parsers (`vllm_mamba/entrypoints/openai/reasoning/`): vLLM's names, the
split of whole outputs (expected values written by hand), `starts_in_reasoning` for each
template style, and streaming: any split of an output, 1-character deltas included,
gives the same reasoning and content as the whole, holding back only a bounded tail."""

from __future__ import annotations

import random

import pytest

from vllm_mamba.entrypoints.openai.reasoning import (
    ReasoningParser,
    ReasoningParserManager,
    ReasoningStream,
)
from vllm_mamba.entrypoints.openai.reasoning.base import MarkerStream


def parser(name: str, **kwargs: object) -> ReasoningParser:
    return ReasoningParserManager.get(name)(kwargs or None)


# ---------------------------------------------------------------- registry


def test_registered_names() -> None:
    assert ReasoningParserManager.names() == ["deepseek_r1", "granite", "nemotron_v3", "qwen3"]
    for name in ReasoningParserManager.names():
        cls = ReasoningParserManager.get(name)
        assert cls.name == name
        assert isinstance(cls.end_marker, str) and cls.end_marker


def test_unknown_name_lists_known_parsers() -> None:
    with pytest.raises(ValueError, match="known parsers: deepseek_r1, granite, nemotron_v3"):
        ReasoningParserManager.get("nope")


def test_register_twice_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        ReasoningParserManager.register("qwen3")(ReasoningParserManager.get("granite"))


def test_special_tokens_and_end_markers() -> None:
    get = ReasoningParserManager.get
    assert (get("qwen3").end_marker, get("qwen3").needs_special_tokens) == ("</think>", False)
    assert (get("deepseek_r1").end_marker, get("deepseek_r1").needs_special_tokens) == (
        "</think>",
        False,
    )
    assert (get("nemotron_v3").end_marker, get("nemotron_v3").needs_special_tokens) == (
        "</think>",
        True,
    )
    assert get("granite").end_marker == "Here is my response:"
    assert get("granite").needs_special_tokens is False


# ---------------------------------------------------------------- starts_in_reasoning

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN35_PROMPT = QWEN3_PROMPT + "<think>\n"
QWEN_OFF_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"


def test_qwen3_starts_in_reasoning() -> None:
    assert parser("qwen3").starts_in_reasoning(QWEN35_PROMPT) is True
    assert parser("qwen3").starts_in_reasoning(QWEN3_PROMPT) is False  # model emits <think>
    assert parser("qwen3").starts_in_reasoning(QWEN_OFF_PROMPT) is False
    assert parser("qwen3", enable_thinking=True).starts_in_reasoning(QWEN35_PROMPT) is True
    assert parser("qwen3", enable_thinking=False).starts_in_reasoning(QWEN35_PROMPT) is False
    assert parser("qwen3", enable_thinking=None).starts_in_reasoning(QWEN35_PROMPT) is True


def test_deepseek_r1_starts_in_reasoning() -> None:
    r1 = parser("deepseek_r1")
    assert r1.starts_in_reasoning("<｜User｜>hi<｜Assistant｜><think>\n") is True
    assert r1.starts_in_reasoning("<｜User｜>hi<｜Assistant｜>") is True  # <think> optional
    assert r1.starts_in_reasoning("<｜Assistant｜><think>\n\n</think>\n\n") is False
    # R1 has no switch: enable_thinking is not its kwarg
    assert parser("deepseek_r1", enable_thinking=False).starts_in_reasoning("x") is True


def test_nemotron_v3_starts_in_reasoning() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    assert parser("nemotron_v3").starts_in_reasoning(prompt) is True
    assert parser("nemotron_v3", enable_thinking=True).starts_in_reasoning(prompt) is True
    assert parser("nemotron_v3", enable_thinking=False).starts_in_reasoning(prompt) is False
    off = "<|im_start|>assistant\n<think></think>"
    assert parser("nemotron_v3").starts_in_reasoning(off) is False


def test_granite_starts_in_reasoning() -> None:
    prompt = "<|start_of_role|>assistant<|end_of_role|>"
    assert parser("granite").starts_in_reasoning(prompt) is False
    assert parser("granite", thinking=True).starts_in_reasoning(prompt) is False
    opened = prompt + "Here is my thought process:\n"
    assert parser("granite", thinking=True).starts_in_reasoning(opened) is True
    assert parser("granite", thinking=False).starts_in_reasoning(opened) is False
    assert parser("granite").starts_in_reasoning(opened) is False


# ---------------------------------------------------------------- whole outputs

# (parser, kwargs, in_reasoning, output, reasoning, content)
CASES: list[tuple[str, dict[str, object], bool, str, str | None, str | None]] = [
    # qwen3: hybrid models emit <think> themselves
    (
        "qwen3",
        {},
        False,
        "<think>\nLet me see.\n</think>\n\nIt is 4.",
        "\nLet me see.\n",
        "\n\nIt is 4.",
    ),
    ("qwen3", {}, False, "<think>\nstill thinking", "\nstill thinking", None),
    ("qwen3", {}, False, "Just an answer.", None, "Just an answer."),
    ("qwen3", {}, False, "No <think> here</think>", None, "No <think> here</think>"),
    ("qwen3", {}, False, "<think></think>Answer", None, "Answer"),
    ("qwen3", {}, False, "<think>", None, None),
    ("qwen3", {}, False, "", None, None),
    # Qwen3.5 / 2507 thinking: the prompt opened <think>
    ("qwen3", {}, True, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "\n\n4"),
    ("qwen3", {}, True, "cut short by max_tokens", "cut short by max_tokens", None),
    ("qwen3", {}, True, "<think>again</think>ok", "again", "ok"),
    ("qwen3", {}, True, "</think>", None, None),
    ("qwen3", {}, True, "a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", {}, True, "x <think> y</think>z", "x <think> y", "z"),
    # Qwen3.5: a tool call opened inside the reasoning ends it; the tag stays content
    (
        "qwen3",
        {},
        True,
        "I should call f.\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        "I should call f.\n",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    ),
    (
        "qwen3",
        {},
        True,
        'plan<tool_call><function name="f">',
        "plan",
        '<tool_call><function name="f">',
    ),
    (
        "qwen3",
        {},
        True,
        "use a <tool_call> tag later</think>ok",
        "use a <tool_call> tag later",
        "ok",
    ),
    ("qwen3", {}, True, "<tool_call>\n<functional", "<tool_call>\n<functional", None),
    (
        "qwen3",
        {},
        True,
        "<tool_call>" + " " * 33 + "<function=f>",
        "<tool_call>" + " " * 33 + "<function=f>",
        None,
    ),
    ("qwen3", {}, True, "t</think>a<tool_call>\n<function=f>", "t", "a<tool_call>\n<function=f>"),
    # thinking disabled: all content (a leading <think> is still parsed)
    ("qwen3", {"enable_thinking": False}, False, "Sure: 4.", None, "Sure: 4."),
    ("qwen3", {"enable_thinking": False}, False, "4</think>", None, "4</think>"),
    ("qwen3", {"enable_thinking": False}, False, "<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
    # unicode
    (
        "qwen3",
        {},
        True,
        "Überlegung 🤔 — ja\n</think>\n\n答案是 4 ✅",
        "Überlegung 🤔 — ja\n",
        "\n\n答案是 4 ✅",
    ),
    # deepseek_r1
    ("deepseek_r1", {}, True, "<think>\nR\n</think>\n\nA", "\nR\n", "\n\nA"),
    ("deepseek_r1", {}, True, "R\n</think>\n\nA", "R\n", "\n\nA"),
    ("deepseek_r1", {}, True, "no end marker", "no end marker", None),
    ("deepseek_r1", {}, True, "R</think>", "R", None),
    ("deepseek_r1", {}, True, "R<tool_call>\n<function=f>", "R<tool_call>\n<function=f>", None),
    ("deepseek_r1", {}, False, "after a closed prompt", None, "after a closed prompt"),
    ("deepseek_r1", {}, False, "<think>R</think>A", "R", "A"),
    ("deepseek_r1", {}, True, "思考…</think>回答", "思考…", "回答"),
    # nemotron_v3
    ("nemotron_v3", {}, True, "R</think>A", "R", "A"),
    ("nemotron_v3", {}, True, "<think>R", "R", None),
    ("nemotron_v3", {"enable_thinking": False}, False, "Plain answer", None, "Plain answer"),
    ("nemotron_v3", {"enable_thinking": False}, False, "<think>R</think>A", "R", "A"),
    # granite
    (
        "granite",
        {"thinking": True},
        False,
        "Here is my thought process:\nAdd them.\nHere is my response:\n4",
        "\nAdd them.\n",
        "\n4",
    ),
    (
        "granite",
        {"thinking": True},
        False,
        "Here's my thought process: t Here's my response: r",
        " t ",
        " r",
    ),
    (
        "granite",
        {"thinking": True},
        False,
        "Here is my thought process: t Here's my response: r",
        " t ",
        " r",
    ),
    ("granite", {"thinking": True}, False, "Here is my thought process: cut", " cut", None),
    (
        "granite",
        {"thinking": True},
        False,
        "Here is my thought process:t Here is my response:",
        "t ",
        None,
    ),
    ("granite", {"thinking": True}, False, "Just 4.", None, "Just 4."),
    ("granite", {"thinking": True}, False, "Here is my answer: 4", None, "Here is my answer: 4"),
    (
        "granite",
        {"thinking": True},
        False,
        "Here is my response: 4",
        None,
        "Here is my response: 4",
    ),
    (
        "granite",
        {"thinking": True},
        False,
        "x Here is my thought process: y",
        None,
        "x Here is my thought process: y",
    ),
    ("granite", {"thinking": True}, False, "Here is my thought", None, "Here is my thought"),
    ("granite", {}, False, "Here is my thought process: a Here is my response: b", " a ", " b"),
    ("granite", {"thinking": True}, True, "t Here is my response: r", "t ", " r"),
    (
        "granite",
        {"thinking": True},
        False,
        "Here is my thought process: Here is my plan. Here is my response: ünïcödé 🎉",
        " Here is my plan. ",
        " ünïcödé 🎉",
    ),
]


def _id(case: tuple[str, dict[str, object], bool, str, str | None, str | None]) -> str:
    return f"{case[0]}-{case[2]}-{case[3][:24]!r}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_extract(case: tuple[str, dict[str, object], bool, str, str | None, str | None]) -> None:
    name, kwargs, in_reasoning, text, reasoning, content = case
    assert parser(name, **kwargs).extract(text, in_reasoning) == (reasoning, content)


# ---------------------------------------------------------------- streaming


def _run(stream: ReasoningStream, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content)


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    out = [list(text), [text], ["", text, ""]]
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 8))))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_stream_matches_extract(
    case: tuple[str, dict[str, object], bool, str, str | None, str | None],
) -> None:
    name, kwargs, in_reasoning, text, reasoning, content = case
    p = parser(name, **kwargs)
    want = (reasoning or "", content or "")
    rng = random.Random(text)
    for pieces in _splits(text, rng):
        assert _run(p.stream(in_reasoning), pieces) == want, pieces


def test_random_transcripts_every_parser() -> None:
    """Random outputs built from markers, marker fragments, whitespace and unicode: every
    split agrees with the whole."""
    rng = random.Random(1234)
    atoms = [
        "<think>",
        "</think>",
        "</thi",
        "<",
        "/",
        "think>",
        "<tool_call>",
        "<tool_call>\n",
        "<function=f>",
        "<function",
        " ",
        "\n\n",
        "Here is my thought process:",
        "Here's my response:",
        "Here is my response:",
        "Here",
        "Here is my",
        " response:",
        "abc",
        "é",
        "🤔",
        "答案",
        ":",
    ]
    for name in ReasoningParserManager.names():
        for kwargs in ({}, {"enable_thinking": False}, {"thinking": True}):
            p = parser(name, **kwargs)
            for _ in range(60):
                text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
                for in_reasoning in (False, True):
                    r, c = p.extract(text, in_reasoning)
                    want = (r or "", c or "")
                    # nothing is lost but the markers
                    assert len(want[0]) + len(want[1]) <= len(text)
                    for pieces in _splits(text, rng)[:12]:
                        assert _run(p.stream(in_reasoning), pieces) == want, (name, pieces)


def test_stream_sends_reasoning_promptly() -> None:
    s = parser("qwen3").stream(True)
    assert s.in_reasoning
    assert s.feed("I think") == ("I think", "")
    assert s.feed(" so <") == (" so ", "")  # "<" may start </think>
    assert s.feed("/thi") == ("", "")
    assert s.feed("nk>\n\nYes") == ("", "\n\nYes")
    assert not s.in_reasoning
    assert s.feed(" <think>") == ("", " <think>")
    assert s.finish() == ("", "")


def test_stream_false_alarm_is_released() -> None:
    s = parser("qwen3").stream(True)
    assert s.feed("a </thi") == ("a ", "")
    assert s.feed("ng") == ("</thing", "")
    assert s.feed("<tool_call>") == ("", "")
    assert s.feed("\n") == ("", "")
    assert s.feed("<func") == ("", "")
    assert s.feed("tion=f>") == ("", "<tool_call>\n<function=f>")
    assert s.finish() == ("", "")


def test_stream_leading_start_marker() -> None:
    s = parser("qwen3").stream(False)
    assert not s.in_reasoning
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>\nhm") == ("\nhm", "")
    assert s.in_reasoning
    s = parser("qwen3").stream(False)
    assert s.feed("<th") == ("", "")
    assert s.feed("e answer") == ("", "<the answer")
    s = parser("granite", thinking=True).stream(False)
    assert s.feed("Here") == ("", "")
    assert s.finish() == ("", "Here")


def test_stream_cut_short_flushes_held_tail() -> None:
    s = parser("deepseek_r1").stream(True)
    assert s.feed("thinking </th") == ("thinking ", "")
    assert s.finish() == ("</th", "")
    s = parser("granite").stream(False)
    assert s.feed("Here is my thought process: a Here is my resp") == (" a ", "")
    assert s.finish() == ("Here is my resp", "")


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "nemotron_v3", "granite"])
def test_stream_holds_only_a_bounded_tail(name: str) -> None:
    """A long reasoning in 1-character deltas full of marker-like fragments: the held text
    never exceeds the longest marker pattern (Qwen's tool-call opener: 52 characters)."""
    p = parser(name, thinking=True)
    body = "Here is my <tool_call>   <functio </thin <think> é🤔 " * 400
    text = body + p.end_marker + " done"
    s = p.stream(True)
    assert isinstance(s, MarkerStream)
    longest = 0
    reasoning, content = [], []
    for ch in text:
        r, c = s.feed(ch)
        reasoning.append(r)
        content.append(c)
        longest = max(longest, len(s._held))
    assert longest <= 52
    r, c = s.finish()
    assert "".join(reasoning) + r == body
    assert "".join(content) + c == " done"
