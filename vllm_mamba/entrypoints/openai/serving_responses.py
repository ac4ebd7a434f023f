"""`POST /v1/responses` and `GET /v1/responses/{id}`: the OpenAI Responses API for text and
function tools, on the chat machinery.

A request becomes a chat request (`responses_protocol.py`): the conversation of
`previous_response_id` (kept in memory, bounded), then `instructions` as a system message,
then the input items. It is prepared, generated and read exactly as a chat completion
(`OpenAIServingChat.prepare`, `chat_output.py`: reasoning, tool calls), and answered as
output items. Streamed, it sends the standard events: `response.created`,
`response.in_progress`, then per item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` and
`response.output_text.delta`, `response.function_call_arguments.delta`) and their `.done`
events, `response.output_item.done`, and finally `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it; an `error` event when it failed).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_mamba.entrypoints.openai.chat_output import StreamPiece, ToolOutputError
from vllm_mamba.entrypoints.openai.errors import (
    ENGINE_ERRORS,
    APIError,
    engine_error_status,
    internal_error_message,
)
from vllm_mamba.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from vllm_mamba.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    ResponseUsage,
    function_call_item,
    history_messages,
    input_messages,
    message_item,
    new_id,
    output_items,
    output_text_part,
    reasoning_item,
    response_object,
)
from vllm_mamba.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
from vllm_mamba.entrypoints.openai.streaming import TextDeltas, unless_disconnected
from vllm_mamba.outputs import RequestOutput

MAX_STORED_RESPONSES = 1_024
MAX_STORED_BYTES = 64 * 2**20


# What one stored entry costs besides its two byte strings: the key, the entry's tuple and
# its node in the ordered dict.
_ENTRY_OVERHEAD = 256


class ResponseStore:
    """Finished responses by id, for `previous_response_id` and `GET /v1/responses/{id}`:
    least recently used first out, bounded in count and bytes, for the server's lifetime.

    Each is kept serialized (its conversation's JSON and the reply's own body), so the bytes
    counted against `max_bytes` are the memory held: parsed, the same JSON costs many times
    its length in Python objects."""

    def __init__(
        self, max_items: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[bytes, bytes, int]] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, conversation: bytes, body: bytes) -> None:
        """Keeps a response's body (the JSON of its reply) and the JSON of the conversation
        that continues from it."""
        size = (
            sys.getsizeof(response_id)
            + sys.getsizeof(conversation)
            + sys.getsizeof(body)
            + _ENTRY_OVERHEAD
        )
        if size > self.max_bytes:
            return
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= old[2]
        self._items[response_id] = (conversation, body, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, (_, _, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def get(self, response_id: str) -> tuple[bytes, bytes]:
        """The JSON of a stored response's conversation and of its body.

        Raises:
            APIError: 404 when it is unknown (never stored, or dropped).
        """
        if response_id not in self._items:
            raise APIError(
                f"Response with id {response_id!r} not found.",
                404,
                "previous_response_id",
                "response_not_found",
            )
        self._items.move_to_end(response_id)
        conversation, body, _ = self._items[response_id]
        return conversation, body


class OpenAIServingResponses:
    """Handles Responses API requests through the chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.engine = chat.engine
        self.store = ResponseStore()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}`."""
        return json.loads(self.store.get(response_id)[1])

    async def create(self, req: ResponsesRequest, raw: Request, defaults: Any) -> Response:
        """Runs a Responses request and answers it (a stream of events when `req.stream`)."""
        model_name = self.chat.model.resolve(req.model)
        unsupported = req.unsupported_field()
        if unsupported is not None:
            raise APIError(f"{unsupported} is not supported by this server", 400, unsupported)
        messages = await self._conversation(req)
        chat_req = self._chat_request(req, messages)
        chat_req = defaults(chat_req)
        prepared = await self.chat.prepare(chat_req)
        response_id = new_id("resp")
        created = time.time()
        stream = self.chat.metrics.track(
            await self.engine.add_request(response_id, prepared.prompt, prepared.params),
            time.monotonic(),
        )
        if req.stream:
            events = self._events(req, response_id, model_name, created, messages, stream, prepared)
            return StreamingResponse(events, media_type="text/event-stream")
        final = await unless_disconnected(raw, self.chat._last(stream, response_id))
        if final is None:
            return Response(status_code=499)
        comp = final.outputs[0]
        try:
            parsed = prepared.parsing.parse(comp.text, comp.finish_reason)
        except ToolOutputError as err:
            raise APIError(str(err), err.status, "tool_choice") from err
        status = "incomplete" if comp.finish_reason == "length" else "completed"
        items = output_items(parsed, status)
        usage = await self._usage(final, parsed.reasoning)
        body = response_object(req, response_id, model_name, status, items, usage, created)
        return await self._reply(req, response_id, messages, items, body)

    async def _conversation(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The stored conversation of `previous_response_id` (decoded on the tokenizer
        thread), then the input items."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)[0]
            history = await self.engine.run_tokenizer(json.loads, stored)
        try:
            return history + input_messages(req.input)
        except ValueError as err:
            raise APIError(str(err), 400, "input") from err

    @staticmethod
    def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> Any:
        """The chat request the Responses request amounts to.

        Raises:
            APIError: a 400 naming the field that cannot be translated.
        """
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        if not system + messages:
            raise APIError("input is empty", 400, "input")
        fields: dict[str, Any] = {"parallel_tool_calls": req.parallel_tool_calls}
        steps = (
            ("input", lambda: {"messages": [ChatMessage(**m) for m in system + messages]}),
            ("tools", lambda: {"tools": req.chat_tools()}),
            ("tool_choice", lambda: _unless_none("tool_choice", req.chat_tool_choice())),
            ("text", lambda: _unless_none("response_format", req.response_format())),
            ("reasoning", lambda: _unless_none("chat_template_kwargs", req.template_kwargs())),
        )
        for field, step in steps:
            try:
                fields.update(step())
            except ValueError as err:
                raise APIError(str(err), 400, field) from err
        return ChatCompletionRequest(**fields, **req.sampling_fields())

    async def _reply(
        self,
        req: ResponsesRequest,
        response_id: str,
        messages: list[dict[str, Any]],
        items: list[dict[str, Any]],
        body: dict[str, Any],
    ) -> JSONResponse:
        """The reply holding `body`, rendered first (on the tokenizer thread: a long
        conversation is serialized off the event loop) and only then stored, so that a
        response is never stored under an id whose reply failed."""

        def render() -> tuple[JSONResponse, bytes | None]:
            reply = JSONResponse(body)
            if not req.store:
                return reply, None
            conversation = messages + history_messages(items)
            return reply, json.dumps(conversation, ensure_ascii=False).encode("utf-8")

        reply, conversation = await self.engine.run_tokenizer(render)
        if conversation is not None:
            self.store.put(response_id, conversation, reply.body)
        return reply

    async def _usage(self, final: RequestOutput, reasoning: str | None) -> ResponseUsage:
        """Token counts; the reasoning's tokens counted by encoding its text."""
        comp = final.outputs[0]
        reasoning_tokens = 0
        if reasoning:
            encode = functools.partial(self.engine.inputs.encode, add_special_tokens=False)
            ids = await self.engine.run_tokenizer(encode, reasoning)
            reasoning_tokens = min(len(ids), len(comp.token_ids))
        prompt_tokens = len(final.prompt_token_ids)
        usage = ResponseUsage(
            input_tokens=prompt_tokens,
            output_tokens=len(comp.token_ids),
            total_tokens=prompt_tokens + len(comp.token_ids),
        )
        usage.input_tokens_details["cached_tokens"] = final.num_cached_tokens or 0
        usage.output_tokens_details["reasoning_tokens"] = reasoning_tokens
        return usage

    async def _events(
        self,
        req: ResponsesRequest,
        response_id: str,
        model_name: str,
        created: float,
        messages: list[dict[str, Any]],
        stream: AsyncIterator[RequestOutput],
        prepared: PreparedChat,
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed response."""
        writer = _EventWriter()
        final: RequestOutput | None = None
        shell = response_object(req, response_id, model_name, "in_progress", [], None, created)
        yield writer.event("response.created", response=shell)
        yield writer.event("response.in_progress", response=shell)
        reader = prepared.parsing.stream()
        deltas = TextDeltas(prepared.params.stop_list)
        reasoning: list[str] = []
        try:
            async for out in stream:
                final = out
                comp = out.outputs[0]
                piece = reader.feed(deltas.text(0, comp.text, comp.finished))
                for event in writer.piece(piece, reasoning):
                    yield event
                if comp.finished:
                    for event in writer.piece(reader.finish(comp.finish_reason), reasoning):
                        yield event
            assert final is not None
            comp = final.outputs[0]
            status = "incomplete" if comp.finish_reason == "length" else "completed"
            for event in writer.close(status):
                yield event
            usage = await self._usage(final, "".join(reasoning))
            body = response_object(
                req, response_id, model_name, status, writer.items, usage, created
            )
            kind = "response.completed" if status == "completed" else "response.incomplete"
            last = writer.event(kind, response=body)
            await self._reply(req, response_id, messages, writer.items, body)
            yield last
        except ToolOutputError as err:
            yield writer.error(str(err), err.status)
        except ENGINE_ERRORS as err:
            yield writer.error(str(err), engine_error_status(err))
        except Exception as err:  # a bug: the client gets an error event, not a cut stream
            yield writer.error(internal_error_message(err), 500)
        finally:
            if final is None or not final.finished:
                self.engine.abort(response_id)


def _unless_none(name: str, value: Any) -> dict[str, Any]:
    return {} if value is None else {name: value}


class _EventWriter:
    """Builds the event stream of one response: numbers the events and opens and closes
    the output items as reasoning, text and calls arrive."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def error(self, message: str, status: int) -> str:
        return self.event("error", code=str(status), message=message, param=None)

    def on_item(self, kind: str, item: dict[str, Any], index: int, **fields: Any) -> str:
        """An event about output item `item` at `index`."""
        return self.event(kind, item_id=item["id"], output_index=index, **fields)

    def piece(self, piece: StreamPiece, reasoning: list[str]) -> list[str]:
        """The events of one stream piece."""
        out: list[str] = []
        if piece.reasoning:
            reasoning.append(piece.reasoning)
            out += self._text("reasoning", piece.reasoning)
        if piece.content:
            out += self._text("message", piece.content)
        for call in piece.tool_calls:
            out += self.close("completed")
            name, arguments = call.function.name or "", call.function.arguments or ""
            call_id, index = call.id or new_id("call"), len(self.items)
            item = function_call_item(new_id("fc"), call_id, name, "", "in_progress")
            done = {**item, "arguments": arguments, "status": "completed"}
            self.items.append(done)
            out += [
                self.event("response.output_item.added", output_index=index, item=item),
                self.on_item(
                    "response.function_call_arguments.delta", item, index, delta=arguments
                ),
                self.on_item(
                    "response.function_call_arguments.done",
                    item,
                    index,
                    arguments=arguments,
                    name=name,
                ),
                self.event("response.output_item.done", output_index=index, item=done),
            ]
        return out

    def _text(self, kind: str, delta: str) -> list[str]:
        """Events adding `delta` to the open item of `kind` (opening it first)."""
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close("completed")
            out += self._open(kind)
        assert self.open is not None
        self.text.append(delta)
        index = len(self.items)
        if kind == "reasoning":
            name, extra = "response.reasoning_text.delta", {}
        else:
            name, extra = "response.output_text.delta", {"logprobs": []}
        out.append(self.on_item(name, self.open, index, content_index=0, delta=delta, **extra))
        return out

    def _open(self, kind: str) -> list[str]:
        index = len(self.items)
        if kind == "reasoning":
            self.open = reasoning_item(new_id("rs"), "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            self.open = message_item(new_id("msg"), None, "in_progress")
            part = output_text_part("")
        self.text = []
        return [
            self.event("response.output_item.added", output_index=index, item=self.open),
            self.on_item(
                "response.content_part.added", self.open, index, content_index=0, part=part
            ),
        ]

    def close(self, status: str) -> list[str]:
        """Events closing the open item, if any."""
        if self.open is None:
            return []
        item, text, index = self.open, "".join(self.text), len(self.items)
        self.open = None
        if item["type"] == "reasoning":
            name, extra = "response.reasoning_text.done", {}
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            final = reasoning_item(item["id"], text, status)
        else:
            name, extra = "response.output_text.done", {"logprobs": []}
            part = output_text_part(text)
            final = message_item(item["id"], text, status)
        self.items.append(final)
        return [
            self.on_item(name, item, index, content_index=0, text=text, **extra),
            self.on_item("response.content_part.done", item, index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=final),
        ]
