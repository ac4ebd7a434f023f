"""Structured outputs, tool calls and logit constraints through the OpenAI server: every way
of asking (response_format, structured_outputs, guided_*), streamed and not, batched with
free requests, and every malformed or uncompilable request a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer
from tests.entrypoints.forced_calls import read_stream
from tests.helpers.json_schemas import random_object_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)


async def chat(server: RunningServer, stream: bool, **kwargs: Any) -> tuple[str, str, Any]:
    """`(text, finish_reason, tool_calls)` of a one-choice chat, streamed or not."""
    args = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, **kwargs}
    async with client(server) as api:
        if not stream:
            resp = await api.chat.completions.create(**args)
            msg = resp.choices[0].message
            return msg.content or "", resp.choices[0].finish_reason, msg.tool_calls
        chunks = [c async for c in await api.chat.completions.create(stream=True, **args)]
        text, finish, calls = read_stream(chunks)
        return text, finish, [_call(c["id"], c["name"], c["arguments"]) for c in calls] or None


def _call(call_id: str, name: str, arguments: str) -> Any:
    from openai.types.chat import ChatCompletionMessageToolCall

    function = {"name": name, "arguments": arguments}
    return ChatCompletionMessageToolCall(id=call_id, type="function", function=function)


async def complete(server: RunningServer, stream: bool, prompt: str, **kwargs: Any) -> str:
    args = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, **kwargs}
    async with client(server) as api:
        if not stream:
            return (await api.completions.create(**args)).choices[0].text
        chunks = await api.completions.create(stream=True, **args)
        return "".join([c.choices[0].text async for c in chunks])


def test_random_schemas_validate_streamed_and_not_with_free_requests(
    server: RunningServer,
) -> None:
    """Random schemas through response_format (chat) and structured_outputs / guided_json
    (completions), concurrently with free requests that give their solo outputs."""
    rng = random.Random(99)
    schemas = [random_object_schema(rng) for _ in range(12)]
    free = {"max_tokens": 16, "extra_body": {"ignore_eos": True}}
    prompts = ["The history of", "def main():", "Once upon"]

    async def run() -> tuple[list[str], list[Any]]:
        solo = [await complete(server, False, p, **free) for p in prompts]
        jobs = []
        for i, schema in enumerate(schemas):
            stream = i % 2 == 1
            if i % 3 == 0:
                fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
                jobs.append(chat(server, stream, max_tokens=200, response_format=fmt, seed=i))
            else:
                field = {"structured_outputs": {"json": schema}} if i % 3 == 1 else {}
                field = field or {"guided_json": schema}
                jobs.append(
                    complete(server, stream, f"Item {i}:", max_tokens=200, extra_body=field)
                )
        jobs += [complete(server, i % 2 == 0, p, **free) for i, p in enumerate(prompts)]
        return solo, await asyncio.gather(*jobs)

    solo, results = asyncio.run(run())
    for schema, result in zip(schemas, results):
        text = result[0] if isinstance(result, tuple) else result
        jsonschema.validate(json.loads(text), schema)
    assert results[len(schemas) :] == solo


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_json_object(server: RunningServer, stream: bool) -> None:
    async def run() -> list[str]:
        return [
            await complete(
                server,
                stream,
                "Code:",
                max_tokens=30,
                extra_body={"guided_regex": r"[A-Z]{3}-\d{2,4}"},
            ),
            await complete(
                server,
                stream,
                "Pick:",
                extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}},
            ),
            (await chat(server, stream, extra_body={"guided_choice": ["yes", "no"]}))[0],
            (
                await chat(
                    server,
                    stream,
                    max_tokens=8,
                    extra_body={"guided_grammar": 'root ::= "a" | "bb"'},
                )
            )[0],
            (await chat(server, stream, max_tokens=30, response_format={"type": "json_object"}))[0],
        ]

    code, pick, yes_no, grammar, obj = asyncio.run(run())
    assert re.fullmatch(r"[A-Z]{3}-\d{2,4}", code)
    assert pick in ("alpha", "beta", "gamma delta")
    assert yes_no in ("yes", "no") and grammar in ("a", "bb")
    assert obj.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls(server: RunningServer, stream: bool) -> None:
    async def run() -> list[tuple[str, str, Any]]:
        return [
            await chat(
                server,
                stream,
                tools=[WEATHER, TIME],
                tool_choice="required",
                max_tokens=200,
                seed=s,
                temperature=1.0,
                parallel_tool_calls=s != 2,
                stop=["\n"],  # never in a call's compact JSON: allowed
            )
            for s in range(3)
        ] + [
            await chat(
                server,
                stream,
                tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": name}},
                max_tokens=100,
            )
            for name in ("get_weather", "get_time")
        ]

    results = asyncio.run(run())
    for i, (content, finish, calls) in enumerate(results):
        assert not content and calls, (content, finish)
        assert finish == ("tool_calls" if i < 3 else "stop")
        for call in calls:
            assert call.type == "function" and call.id
            jsonschema.validate(
                json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name]
            )
    assert [r[2][0].function.name for r in results[3:]] == ["get_weather", "get_time"]
    assert len(results[2][2]) == 1  # parallel_tool_calls=false
    assert all(len(r[2]) == 1 for r in results[3:])


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED_WEATHER])
def test_calls_cut_by_max_tokens_finish_with_length(server: RunningServer, choice: Any) -> None:
    """Cut by max_tokens, a required or named call is a 200 with `length` and the call so far
    (OpenAI's contract; it was a 400): streamed as generated, the same as the whole answer,
    and a prefix of what the same seed writes with room to finish."""
    base = {"tools": [WEATHER], "tool_choice": choice, "temperature": 1.0}
    base["parallel_tool_calls"] = False

    async def run() -> list[tuple[Any, list[tuple[str, str, Any]]]]:
        async with client(server) as api:
            full = await asyncio.gather(
                *[
                    api.chat.completions.create(
                        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, seed=seed, **base
                    )
                    for seed in range(3)
                ]
            )
        jobs = [
            chat(
                server,
                stream,
                max_tokens=max(1, reply.usage.completion_tokens - 3),
                seed=seed,
                **base,
            )
            for seed, reply in enumerate(full)
            for stream in (False, True)
        ]
        return list(zip(full, zip(*[iter(await asyncio.gather(*jobs))] * 2)))

    partial = 0
    for full, (whole, streamed) in asyncio.run(run()):
        assert full.choices[0].finish_reason in ("tool_calls", "stop")
        want = full.choices[0].message.tool_calls[0].function
        for content, finish, calls in (whole, streamed):
            assert not content and finish == "length", (content, finish)
            if calls:  # none when cut before the name was complete
                got = calls[0].function
                assert len(calls) == 1 and got.name == want.name
                assert want.arguments.startswith(got.arguments), (got, want)
        assert [c.function for c in whole[2]] == [c.function for c in streamed[2]]
        if whole[2] and whole[2][0].function.arguments not in ("", want.arguments):
            partial += 1
    assert partial, "no call was cut inside its arguments"


def test_length_limited_strings_hold_no_control_characters(server: RunningServer) -> None:
    """A string with maxLength used to let a raw tab (or any control character) in, which
    JSON forbids: the grammar ended, the call could not be read, and the answer was a 500.
    Tabs pushed up by logit_bias: the arguments are still JSON."""
    tab, tabs = 186, 623  # "\t", "\t\t"
    for stream in (False, True):
        content, finish, calls = asyncio.run(
            chat(
                server,
                stream,
                tools=[WEATHER],
                tool_choice=NAMED_WEATHER,
                max_tokens=100,
                logit_bias={str(tab): 100, str(tabs): 100},
            )
        )
        assert finish == "stop" and len(calls) == 1
        arguments = json.loads(calls[0].function.arguments)
        jsonschema.validate(arguments, TOOL_SCHEMAS["get_weather"])


def test_logit_bias_allowed_token_ids_and_bad_words(server: RunningServer) -> None:
    """Checked on space-led words (" cat" is token 5798), whose texts tokenize back the same."""
    words = {" cat": 5798, " dog": 4370, " fish": 6773}

    def tokens(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return post(server, "/tokenize", body).json()["tokens"]

    def text(path: str, body: dict[str, Any]) -> list[str]:
        response = post(server, path, {"max_tokens": 8, "temperature": 0, **body})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        return [c["text"] if "text" in c else c["message"]["content"] for c in choices]

    prompt = {"prompt": "The history of"}
    forced = text("/v1/completions", {**prompt, "temperature": 1.0, "logit_bias": {"5798": 100}})
    assert tokens(forced[0]) == [5798] * 8
    free = text("/v1/chat/completions", {"messages": MESSAGES})[0]
    first = tokens(free)[0]
    banned = text("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {str(first): -100}})
    assert tokens(banned[0])[0] != first
    allowed = {
        **prompt,
        "temperature": 1.5,
        "seed": 1,
        "n": 3,
        "allowed_token_ids": [*words.values()],
    }
    outs = text("/v1/completions", allowed)
    assert all(set(tokens(out)) <= set(words.values()) for out in outs)
    assert len({t for out in outs for t in tokens(out)}) >= 2
    cut = text("/v1/completions", {**allowed, "bad_words": ["dog"]})
    assert all(set(tokens(out)) <= {5798, 6773} for out in cut)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
        # no token both allowed and a JSON object's first (issue 46: an empty 200)
        (
            {"response_format": {"type": "json_object"}, "allowed_token_ids": [5798]},
            "allowed_token_ids",
        ),
        ({"bad_words": [""]}, "bad_words"),
        ({"guided_json": {}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        # a constraint that could end the output inside the call
        ({"tools": [WEATHER], "tool_choice": "required", "stop": "}"}, "stop"),
        ({"tools": [WEATHER], "tool_choice": NAMED_WEATHER, "stop": ["\n", "c"]}, "stop"),
        (
            {"tools": [WEATHER], "tool_choice": NAMED_WEATHER, "stop_token_ids": [9]},
            "stop_token_ids",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "bad_words": ["Paris"]}, "bad_words"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    server: RunningServer, body: dict[str, Any], param: str
) -> None:
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_tools_without_tool_choice_are_ignored_and_completions_refuse_tools(
    server: RunningServer,
) -> None:
    for choice in ({}, {"tool_choice": "none"}):
        body = {"messages": MESSAGES, "max_tokens": 4, "tools": [WEATHER], **choice}
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["tool_calls"] == []
    body = {"prompt": "x", "max_tokens": 4, "tools": [WEATHER], "tool_choice": "required"}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    response = post(
        server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "[a-"}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"


def test_tool_call_parsing_and_schema() -> None:
    from vllm_mamba.entrypoints.openai.tool_calls import (
        ChatTool,
        NamedToolChoice,
        parse_tool_calls,
        tool_structured_outputs,
    )

    tools = [ChatTool.model_validate(WEATHER), ChatTool.model_validate(TIME)]
    schema = tool_structured_outputs(tools, "required", parallel=False).json
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = parse_tool_calls('[{"name": "get_time", "parameters": {"zone": "utc"}}]', "required")
    assert calls is not None and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {"zone": "utc"}
    assert parse_tool_calls('[{"name": "get_time", "parame', "required") is None  # cut short
    named = NamedToolChoice.model_validate({"function": {"name": "get_time"}})
    assert tool_structured_outputs(tools, named).json == TOOL_SCHEMAS["get_time"]
    assert parse_tool_calls('{"zone": "u', named) is None


AMBIGUOUS = 'root ::= x\nx ::= x x x | x x | "a" | "aa" | "" | "b"'


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_over_its_matching_budget_is_a_400_and_others_go_on(
    server: RunningServer, stream: bool
) -> None:
    """Issue 46: an ambiguous grammar's matching work grows with every token, on the engine
    thread (8.2 s for 120 tokens, stalling every other request). It ends early with a 400
    (streamed: an error event) that says why; a request beside it is served in full."""
    heavy = {
        "model": MODEL_NAME,
        "prompt": "x",
        "max_tokens": 120,
        "temperature": 1,
        "seed": 3,
        "extra_body": {"ignore_eos": True, "structured_outputs": {"grammar": AMBIGUOUS}},
    }

    async def run_heavy(api: openai.AsyncOpenAI) -> None:
        if not stream:
            await api.completions.create(**heavy)
            return
        async for _ in await api.completions.create(stream=True, **heavy):
            pass

    async def run_light(api: openai.AsyncOpenAI) -> Any:
        return await api.completions.create(
            model=MODEL_NAME,
            prompt="The history of",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    async def both() -> list[Any]:
        async with client(server) as api:
            return await asyncio.gather(run_heavy(api), run_light(api), return_exceptions=True)

    err, light = asyncio.run(both())
    assert isinstance(err, openai.BadRequestError if not stream else openai.APIError), err
    assert "structured_outputs.grammar" in str(err) and "too ambiguous" in str(err)
    if stream:
        assert err.body["code"] == 400 and err.body["type"] == "invalid_request_error"
    assert light.usage.completion_tokens == 16


def test_allowed_tokens_the_grammar_cannot_continue_are_a_400(server: RunningServer) -> None:
    """`{` is allowed and starts a JSON object, but nothing allowed can follow it: a 400
    saying so, not a 200 with a cut output."""
    brace = post(server, "/tokenize", {"prompt": "{", "add_special_tokens": False}).json()
    body = {
        "prompt": "x",
        "max_tokens": 8,
        "response_format": {"type": "json_object"},
        "allowed_token_ids": [*brace["tokens"], 5798],
    }
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "allowed_token_ids: after 1 generated tokens" in response.json()["error"]["message"]
