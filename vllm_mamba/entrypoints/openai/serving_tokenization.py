"""vLLM's tokenizer routes: `POST /tokenize` (a text, or chat messages rendered with the chat
template), `POST /detokenize` and `GET /tokenizer_info`.

Clients that tokenize on the server, such as lm-evaluation-harness's `local-completions` with
its default tokenizer backend, need no tokenizer files of their own: they send the token ids
back as prompts, so what they score is exactly what the model sees.

`/tokenize` renders chat messages with the chat template (a request's own `chat_template` with
`--trust-request-chat-template`, in the same bounded sandbox as chat completions), so with
`--api-key` such a request needs the key, as `/v1/*` does (`middleware.has_api_key`, checked
in its route); plain text and `/detokenize` stay open, as in vLLM.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.entrypoints.chat_utils import IMAGE_PARTS
from vllm_mamba.entrypoints.openai.errors import APIError
from vllm_mamba.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm_mamba.entrypoints.openai.served_model import ServedModel
from vllm_mamba.entrypoints.openai.serving_chat import OpenAIServingChat

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class OpenAIServingTokenization:
    """Answers the tokenizer routes with the engine's own tokenizer.

    Args:
        engine: the served engine; its tokenizer is only touched on the tokenizer thread.
        model: the served model (requests naming another model get a 404).
        chat: renders chat messages exactly as chat completions do.
    """

    def __init__(self, engine: AsyncLLMEngine, model: ServedModel, chat: OpenAIServingChat) -> None:
        self.engine = engine
        self.model = model
        self.chat = chat
        self.vocab_size = engine.model_config.vocab_size

    @property
    def _tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """The token ids of a text, or of chat messages after the chat template.

        Raises:
            APIError: an unknown model (404) or messages the template cannot render (400).
        """
        self.model.resolve(req.model)
        if isinstance(req, TokenizeChatRequest):
            args = (
                req.messages, req.add_generation_prompt, req.chat_template, req.tools,
                req.documents, req.chat_template_kwargs, req.continue_final_message,
            )  # fmt: skip
            if self.engine.inputs.images is not None and _has_images(req.messages):
                ids = await self._image_prompt_ids(await self.chat.render_prompt(*args))
            else:
                text = await self.chat.render(*args)
                ids = await self._encode(text, req.add_special_tokens)
        else:
            ids = await self._encode(req.prompt, req.add_special_tokens)
        strs = None
        if req.return_token_strs:
            strs = await self.engine.run_tokenizer(self._tokenizer.convert_ids_to_tokens, ids)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.model.max_model_len, tokens=ids, token_strs=strs
        )

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        encode = functools.partial(
            self.engine.inputs.encode, text, add_special_tokens=add_special_tokens
        )
        return await self.engine.run_tokenizer(encode)

    async def _image_prompt_ids(self, prompt: dict[str, Any]) -> list[int]:
        """The ids the engine would run for a chat prompt with images: each image's
        placeholder expanded as the model's processor expands it.

        Raises:
            APIError: an image the processor refuses (400).
        """
        try:
            prompt = await self.engine.preprocess_images(prompt)
            _, ids, _ = await self.engine.run_tokenizer(self.engine.inputs.process, prompt)
        except ValueError as err:
            raise APIError(str(err), 400, "messages") from err
        return ids

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of some token ids (special tokens kept, as vLLM does).

        Raises:
            APIError: an unknown model (404) or ids outside the vocabulary (400).
        """
        self.model.resolve(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                f"tokens {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", 400, "tokens"
            )
        text = await self.engine.run_tokenizer(self._tokenizer.decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    def info(self) -> dict[str, Any]:
        """`GET /tokenizer_info`: the tokenizer's class, special tokens, length limit and the
        chat template the server renders messages with."""
        tokenizer = self._tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for name in _SPECIAL_TOKENS:
            token = getattr(tokenizer, name, None)
            info[name] = None if token is None else str(token)
        info["model_max_length"] = getattr(tokenizer, "model_max_length", None)
        info["chat_template"] = self.chat.template.template
        return info


def _has_images(messages: list[Any]) -> bool:
    """Whether a message has an image part."""
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
    )
