"""Agents against a real server with the `openai` client: tools rendered into the prompt,
calls parsed out of the output (`tool_choice="auto"`, the hermes format), the reasoning part
split off (the granite format), multi-turn tool loops through chat completions and the
Responses API, streamed and not, and the prefix cache hitting on the second chat request.

The tiny random model cannot write a tool call by itself: each test makes it write a chosen
text with vLLM's `structured_outputs.choice`, which the server then parses exactly as it
parses a real model's output. The rendered prompts are compared with transformers'
`apply_chat_template` on the same messages and template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server
from tests.entrypoints.forced_calls import check_forced_calls_over_seeds
from tests.tiny_models import TOKENIZER_DIR

# A ChatML template with hermes-style tools (the shape of Qwen2.5's, written for the tests):
# tools in the system turn, earlier calls in assistant turns, results in tool turns.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call functions. Signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}(no thinking)
{% endif %}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
CALL_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 2}}\n</tool_call>'
)
THOUGHT_TEXT = "Here is my thought process: rain is likely. Here is my response: Take an umbrella."
WEATHER_NAME = {"name": "get_weather"}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with launch_server(
        "--chat-template",
        TOOLS_TEMPLATE,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "granite",
        "--enable-prefix-caching",
    ) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def forced(text: str) -> dict[str, Any]:
    """`extra_body` that makes the model write exactly `text`."""
    return {"structured_outputs": {"choice": [text]}}


def reference_prompt(messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers' rendering of the conversation (tool-call arguments as objects, as vLLM
    passes them to templates), tokenized."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    view = json.loads(json.dumps(messages))
    for message in view:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(
        view, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def server_prompt(server: RunningServer, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    reply = httpx.post(
        f"{server.url}/tokenize",
        json={"model": MODEL_NAME, "messages": messages, **body},
        headers=server.headers,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_agent_loop(server: RunningServer, stream: bool) -> None:
    """Tools in, a call out (auto), its result back, a final answer; the second prompt holds
    the call and its result exactly as transformers renders them."""
    api = client(server)
    messages: list[dict[str, Any]] = list(QUESTION)
    assert server_prompt(server, messages, tools=[WEATHER]) == reference_prompt(
        messages, tools=[WEATHER]
    )
    if stream:
        with api.chat.completions.stream(
            model=MODEL_NAME,
            messages=messages,
            tools=[WEATHER],
            max_tokens=80,
            extra_body=forced(CALL_TEXT),
        ) as events:
            for _ in events:
                pass
            first = events.get_final_completion()
    else:
        first = api.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=[WEATHER],
            max_tokens=80,
            extra_body=forced(CALL_TEXT),
        )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    [call] = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    messages += [
        {
            "role": "assistant",
            "content": choice.message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "rain"}'},
    ]
    prompt = server_prompt(server, messages, tools=[WEATHER])
    assert prompt == reference_prompt(messages, tools=[WEATHER])
    text = AutoTokenizer.from_pretrained(TOKENIZER_DIR).decode(prompt)
    assert '"city": "Paris"' in text and f'id="{call.id}"' in text and '"sky": "rain"' in text
    final = api.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[WEATHER],
        max_tokens=160,
        extra_body=forced(THOUGHT_TEXT),
    )
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content.strip() == "Take an umbrella."
    assert answer.message.reasoning.strip() == "rain is likely."


def test_streamed_deltas_carry_index_and_add_up(server: RunningServer) -> None:
    """Raw chunks: each call piece has its index; content and reasoning deltas add up to the
    non-streamed message."""
    two_calls = CALL_TEXT + '\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    api = client(server)
    body = dict(model=MODEL_NAME, messages=QUESTION, tools=[WEATHER], max_tokens=120)
    whole = api.chat.completions.create(**body, extra_body=forced(two_calls)).choices[0]
    content, calls, finish = "", {}, None
    for chunk in api.chat.completions.create(**body, stream=True, extra_body=forced(two_calls)):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                assert piece.index is not None
                entry = calls.setdefault(piece.index, {"id": piece.id, "args": ""})
                if piece.function.name:
                    entry["name"] = piece.function.name
                entry["args"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert content == whole.message.content
    assert sorted(calls) == [0, 1]
    assert [calls[i]["name"] for i in (0, 1)] == ["get_weather"] * 2
    assert [json.loads(calls[i]["args"]) for i in (0, 1)] == [{"city": "Paris", "days": 2}, {}]
    thought = api.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        max_tokens=160,
        stream=True,
        extra_body=forced(THOUGHT_TEXT),
    )
    reasoning, answer = "", ""
    for chunk in thought:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            answer += choice.delta.content or ""
    assert reasoning.strip() == "rain is likely." and answer.strip() == "Take an umbrella."


def test_auto_text_without_a_call_is_content_and_chat_template_kwargs_reach_the_template(
    server: RunningServer,
) -> None:
    api = client(server)
    reply = api.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=[WEATHER],
        max_tokens=20,
        extra_body=forced("<tool_call> not json"),
    ).choices[0]
    assert reply.finish_reason == "stop" and not reply.message.tool_calls
    assert reply.message.content == "<tool_call> not json"
    off = server_prompt(server, QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert (
        off == reference_prompt(QUESTION, enable_thinking=False) != server_prompt(server, QUESTION)
    )
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": QUESTION, "chat_template_kwargs": {"messages": []}},
        headers=server.headers,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_required_and_named_calls_over_many_seeds(server: RunningServer) -> None:
    """Sampled at temperature 1, streamed and not: always a complete call whose arguments are
    valid JSON under the schema, or a `length` finish with the call cut short; never an
    error (`forced_calls.py`)."""
    check_forced_calls_over_seeds(server.url, [WEATHER], seeds=3)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": WEATHER_NAME}])
def test_forced_call_when_the_prompt_does_not_open_the_reasoning(
    server: RunningServer, choice: Any
) -> None:
    """Thinking on, but the generation prompt does not open the reasoning: the output is read
    as content from its first token, so the tool grammar applies from there too (it used to
    wait for the reasoning to end, and the call was never generated)."""
    api = client(server)
    for seed in range(3):
        reply = api.chat.completions.create(
            model=MODEL_NAME,
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body={"chat_template_kwargs": {"thinking": True}},
        )
        answer = reply.choices[0]
        assert answer.finish_reason in ("tool_calls", "stop"), answer
        assert answer.message.reasoning is None and answer.message.content is None
        arguments = json.loads(answer.message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_responses_agent_loop(server: RunningServer) -> None:
    """`responses.create` and `responses.stream`: a function call out, its output back
    through `previous_response_id`, a final answer with a reasoning item."""
    api = client(server)
    tool = {"type": "function", **WEATHER["function"]}
    first = api.responses.create(
        model=MODEL_NAME,
        input="Weather in Paris?",
        instructions="Be brief.",
        tools=[tool],
        max_output_tokens=80,
        extra_body=forced(CALL_TEXT),
    )
    assert first.status == "completed"
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert first.output_text == "Let me look.\n"
    assert api.responses.retrieve(first.id).id == first.id
    with api.responses.stream(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
        tools=[tool],
        max_output_tokens=160,
        extra_body=forced(THOUGHT_TEXT),
    ) as stream:
        kinds_seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds_seen[:2] == ["response.created", "response.in_progress"]
    assert kinds_seen[-1] == "response.completed"
    for kind in (
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_item.done",
    ):
        assert kind in kinds_seen
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text.strip() == "Take an umbrella."
    assert final.output[0].content[0].text.strip() == "rain is likely."
    assert final.usage.input_tokens > first.usage.input_tokens
    # The follow-up prompt held the first turn, its call and the call's output.
    streamed_call = api.responses.create(
        model=MODEL_NAME,
        input="again",
        tools=[tool],
        max_output_tokens=80,
        stream=True,
        extra_body=forced(CALL_TEXT),
    )
    events = list(streamed_call)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] == "Paris"
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_structured_text_and_errors(server: RunningServer) -> None:
    api = client(server)
    tool = {"type": "function", **WEATHER["function"]}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = api.responses.create(
        model=MODEL_NAME,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "json please"}]}],
        text={"format": {"type": "json_schema", "name": "r", "schema": schema}},
        max_output_tokens=20,
        temperature=0,
    )
    assert reply.status in ("completed", "incomplete")
    if reply.status == "completed":
        jsonschema.validate(json.loads(reply.output_text), schema)
    for body, param in (
        ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "background": True}, "background"),
        ({"input": [{"type": "image"}]}, "input"),
        ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        (
            {"input": "x", "tools": [tool], "tool_choice": "required", "stop": ["}"]},
            "stop",
        ),
    ):
        response = httpx.post(f"{server.url}/v1/responses", json=body, headers=server.headers)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["param"] == param, response.json()


def test_second_chat_request_hits_the_shared_system_prompt(server: RunningServer) -> None:
    """Two requests sharing a long system prompt: the second is served from the snapshot
    the first left where the system message ends, with the tokens of a cache-off run."""
    system = {"role": "system", "content": "You answer questions about the weather. " * 30}
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    system_len = len(
        tokenizer.encode(
            tokenizer.apply_chat_template([system], chat_template=TOOLS_TEMPLATE, tokenize=False),
            add_special_tokens=False,
        )
    )
    api = client(server)
    outputs, cached = [], []
    for question in ("Is it cold in Oslo?", "Will it rain in Lima?"):
        reply = api.chat.completions.create(
            model=MODEL_NAME,
            messages=[system, {"role": "user", "content": question}],
            max_tokens=12,
            temperature=0,
        )
        outputs.append(reply.choices[0].message.content)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] >= system_len - 1, (cached, system_len)
    with launch_server("--chat-template", TOOLS_TEMPLATE) as plain:
        reference = []
        for question in ("Is it cold in Oslo?", "Will it rain in Lima?"):
            reply = client(plain).chat.completions.create(
                model=MODEL_NAME,
                messages=[system, {"role": "user", "content": question}],
                max_tokens=12,
                temperature=0,
            )
            reference.append(reply.choices[0].message.content)
    assert outputs == reference


def test_response_store_is_bounded_in_count_and_bytes() -> None:
    """The `previous_response_id` store drops the least recently used responses beyond its
    count and byte bounds, and an unknown or dropped id is a 404 naming the field."""
    from vllm_mamba.entrypoints.openai.errors import APIError
    from vllm_mamba.entrypoints.openai.serving_responses import ResponseStore

    def put(store: ResponseStore, rid: str, text: str) -> None:
        conversation = json.dumps([{"role": "user", "content": text}]).encode()
        store.put(rid, conversation, json.dumps({"id": rid}).encode())

    def body(store: ResponseStore, rid: str) -> Any:
        return json.loads(store.get(rid)[1])

    store = ResponseStore(max_items=3, max_bytes=10_000)
    for rid in ("a", "b", "c"):
        put(store, rid, "x")
    store.get("a")  # now the most recently used
    put(store, "d", "x")
    with pytest.raises(APIError) as gone:
        store.get("b")
    assert gone.value.status == 404 and gone.value.param == "previous_response_id"
    assert body(store, "a") == {"id": "a"} and body(store, "d") == {"id": "d"}
    put(store, "big", "y" * 6_000)
    put(store, "big2", "y" * 6_000)  # the two together exceed the bytes: the older goes
    with pytest.raises(APIError):
        store.get("big")
    put(store, "huge", "z" * 20_000)  # larger than the whole store: not kept
    with pytest.raises(APIError):
        store.get("huge")
    assert body(store, "big2") == {"id": "big2"}
