"""Pydantic models of the OpenAI API subset the server speaks, and their `SamplingParams`.

Requests follow the OpenAI field names; `top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`repetition_penalty`, `stop_token_ids`, `include_stop_str_in_output` and
`skip_special_tokens` are extensions with vLLM's meanings (send them in `extra_body` with the
`openai` client), and so are the output constraints `allowed_token_ids`, `bad_words`,
`structured_outputs` and `guided_*` (`output_constraints.py`); chat's `tools` are in
`tool_calls.py`. Fields that would change the output but are not implemented are refused
(`SamplingRequest.unsupported_field`); other unknown fields are ignored. Values are checked
by `SamplingParams`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from vllm_mamba.entrypoints.chat_utils import ImageRef, conversation_message
from vllm_mamba.entrypoints.openai.output_constraints import (
    ResponseFormat,
    StructuredOutputsRequest,
    logit_bias_ids,
)
from vllm_mamba.entrypoints.openai.tool_calls import (
    ChatTool,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
)
from vllm_mamba.sampling_params import SamplingParams, StructuredOutputsParams

_PATH_PART_CHARS = 64


def lone_surrogate_path(data: Any) -> str | None:
    """The dotted path (`messages.0.content`) of the first string of decoded JSON `data`, or
    dict key, that holds a lone surrogate (`"\\ud800"` decodes to one; it is not Unicode
    text and cannot be encoded); None when every string is valid. Iterative: any depth."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _has_lone_surrogate(value):
                return ".".join(path)
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                part = str(key)[:_PATH_PART_CHARS]
                if isinstance(key, str) and _has_lone_surrogate(key):
                    return ".".join((*path, part))
                if isinstance(item, (str, dict, list)):
                    stack.append(((*path, part), item))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                if isinstance(value[i], (str, dict, list)):
                    stack.append(((*path, str(i)), value[i]))
    return None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class ClientRequest(BaseModel):
    """A request body. Every string the client sent (dict keys too) must be valid Unicode:
    a lone surrogate is refused before any field is read, and so before the model runs, as
    a `lone_surrogate` validation error whose `param` names the field (`errors.py`)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "{param} is not valid Unicode text (it holds a lone surrogate)",
                {"param": path or "body"},
            )
        return data


def random_id(prefix: str) -> str:
    """A fresh OpenAI-style object id such as `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a final chunk with token counts."""

    include_usage: bool = False


# Fields of OpenAI's or vLLM's API that would change the output and are not implemented here:
# a request that sets one gets a 400 naming it, never a silent success.
# (`tools` and `tool_choice` are chat fields: a completion request that sets them is refused.)
_UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "use_beam_search",
    "logits_processors",
    "prompt_embeds",
    "truncate_prompt_tokens",
    "guided_whitespace_pattern",
)
_NO_EFFECT_VALUES: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("none", "auto"),
}


class SamplingRequest(ClientRequest):
    """The sampling and stopping fields shared by completions and chat completions.

    Other fields are accepted and ignored unless they would change the output
    (`unsupported_field`).
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM's names and meanings).
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # Output constraints (OpenAI's logit_bias and response_format; the others are vLLM's).
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported_field(self) -> str | None:
        """The first field that is set, would change the output, and is not implemented."""
        extra = self.model_extra or {}
        for name in _UNSUPPORTED_FIELDS:
            value = extra.get(name)
            if value in (None, False, "", [], {}):
                continue
            if value not in _NO_EFFECT_VALUES.get(name, ()):
                return name
        return None

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def check_prompt_logprobs(self) -> None:
        """`prompt_logprobs` is answered in whole responses only (vLLM's shape).

        Raises:
            ValueError: `prompt_logprobs` with `stream`.
        """
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("SamplingParams.prompt_logprobs is not supported with stream=true")

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine parameters of this request (`structured_outputs` from
        `output_constraints.structured_source` or the tools).

        Raises:
            ValueError: a value out of range (the message names the field).
        """
        self.check_prompt_logprobs()
        own = self.prompt_logprobs
        if own is not None:  # a negative value goes on to SamplingParams, which refuses it
            alone = own < 0 or prompt_logprobs is None
            prompt_logprobs = own if alone else max(own, prompt_logprobs)
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=logit_bias_ids(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured_outputs,
        )


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`: prompt is a string, strings, token ids or lists of token ids.

    `max_tokens: 0` is allowed with `echo: true`: the prompt comes back (with its logprobs when
    `logprobs` is set) and nothing is generated.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    """One message: content is text or a list of `{"type": "text", "text": ...}` parts (and,
    for an image-text model, `image_url` parts); an
    assistant message may carry its earlier `tool_calls` (and reasoning), a tool message the
    `tool_call_id` it answers."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def conversation(
        self, images: list[ImageRef] | None = None, field: str = "messages"
    ) -> dict[str, Any]:
        """The message as the chat template sees it (`chat_utils.conversation_message`); its
        image parts' references go to `images` (None refuses them).

        Raises:
            ValueError: a part that is not text (or an image, with `images`), or a malformed
                tool call.
        """
        return conversation_message(self.model_dump(exclude_none=True), images, field)

    def text(self) -> str:
        """The message's text, its text parts joined with newlines.

        Raises:
            ValueError: a part that is not text.
        """
        return self.conversation()["content"]


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    reasoning_effort: str | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """`chat_template_kwargs`, with `reasoning_effort` added as a template variable (as
        vLLM passes it)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class TokenizeCompletionRequest(ClientRequest):
    """`POST /tokenize` of a text (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ClientRequest):
    """`POST /tokenize` of chat messages rendered with the chat template (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """The token ids of a text, how many, and the server's longest prompt plus output."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(ClientRequest):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The text of some token ids."""

    prompt: str


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens served by the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a response (`prompt_tokens_details` when prefix caching is on)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, finals: list[Any], completion_tokens: int) -> UsageInfo:
        """The usage of final `RequestOutput`s: each prompt once, the cached share of them
        when the engine caches prefixes, and `completion_tokens`."""
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        cached = [out.num_cached_tokens for out in finals]
        details = None
        if cached and all(c is not None for c in cached):
            details = PromptTokensDetails(cached_tokens=sum(cached))
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists over the choice's tokens."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (or one delta of a streamed one)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token at a chat position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The chosen token at a chat position and its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message: its answer, its reasoning (vLLM's `reasoning`, and the older
    name `reasoning_content`, when a reasoning parser runs) and its tool calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatDelta(BaseModel):
    """A streamed piece of the assistant's message; each tool call piece has its `index`
    (the openai SDK's stream helpers index the calls by it)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict] | None] | None = None


class ChatChunkChoice(BaseModel):
    """One choice's delta in a streamed chat completion."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm-mamba"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """The body of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, OpenAI's error shape."""

    error: ErrorInfo
