"""Turns a request's prompt into validated token ids, and checks its parameters against the
model: everything a request must pass before it enters the engine.

It holds its own tokenizer reference, so a server can run one on a worker thread (with its own
tokenizer copy) and keep tokenisation off both the event loop and the engine thread.

A prompt dict may also carry `"cache_points"`: token offsets inside the prompt where the prefix
cache should save a state snapshot while prefilling (where each chat message ends, say), so the
next request sharing that prefix hits even when this request was alone in the cache
(`cache_points`).

An image-text model's prompt dict may carry `"multi_modal_data": {"image": PIL image or list}`
(vLLM's field): each image is preprocessed by the model's image processor and the prompt's
placeholder token for it expanded (`multimodal.prompt`); `process` returns the
`MultiModalPrompt`, which rides on the request from then on. Those four are the only fields a
prompt dict may have: any other (`mm_processor_kwargs` per prompt, ...) is refused by name
rather than dropped, and images sent to a model served text-only are refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from vllm_mamba.multimodal.inputs import ImageProcessor, ProcessedImage
from vllm_mamba.multimodal.media import MediaConfig, image_from_pil
from vllm_mamba.multimodal.prompt import MultiModalPrompt, expand_prompt
from vllm_mamba.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]

# The most cache points one prompt may carry: each may cut a prefill chunk and take a snapshot
# slot, so the count is bounded (a chat conversation needs a handful).
MAX_CACHE_POINTS = 64
# The fields of a prompt dict the engine uses.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "cache_points", "multi_modal_data")
# The most images one prompt may carry unless the engine says otherwise (`limit_mm_per_prompt`).
DEFAULT_IMAGE_LIMIT = 16


@dataclass(frozen=True)
class ImageInputs:
    """What the input processor needs to take images for an image-text model.

    Attributes:
        processor: the model's image processor.
        limit: the most images per prompt (`limit_mm_per_prompt`).
        mrope: image tokens take M-RoPE positions (Qwen3.5).
        media: the pixel budget of a decoded image (and how URLs are read: `media`).
    """

    processor: ImageProcessor
    limit: int = DEFAULT_IMAGE_LIMIT
    mrope: bool = False
    media: MediaConfig = field(default_factory=MediaConfig)


_longest: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (at least 1), computed once per
    tokenizer object (engines of one process share a tokenizer: `tokenizer.cached_tokenizer`)."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)
    try:
        _longest[tokenizer] = longest
    except TypeError:  # not weakly referenceable
        pass
    return longest


class InputProcessor:
    """Validates prompts and sampling parameters for one model.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the model's embedding; token ids must be below it.
        max_model_len: the longest prompt plus output.
        images: how to take images (an image-text model served with images); None refuses
            them.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        images: ImageInputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No token spans more characters than the longest vocabulary entry, so a text longer
        # than this cannot fit in max_model_len tokens: it is refused before tokenising it.
        self.max_prompt_chars = max_model_len * longest_token(tokenizer)

    def process(self, prompt: PromptInput) -> tuple[str | None, list[int], MultiModalPrompt | None]:
        """Returns `(text or None, token ids, images or None)` of a prompt, validated; with
        images, the ids have each image's placeholder expanded.

        Raises:
            ValueError: empty, too long (after expanding images), not encodable, with token
                ids outside the vocabulary, a dict with a field the engine does not use
                (naming it; only `PROMPT_FIELDS` are used), or bad images (naming
                `multi_modal_data`).
        """
        text, ids = _split_prompt(prompt)
        raw_images = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if ids is None:
            ids = self.encode(text)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        self.check_token_ids("prompt_token_ids", ids)
        mm = None
        if isinstance(raw_images, MultiModalPrompt):  # processed already (the server's thread)
            mm = raw_images
        elif raw_images is not None:
            ids, mm = self._expand_images(ids, raw_images)
        if len(ids) > self.max_model_len:
            more = " with its images' tokens" if mm is not None else ""
            raise ValueError(
                f"prompt is {len(ids)} tokens long{more}, more than max_model_len "
                f"({self.max_model_len})"
            )
        return text, ids, mm

    def _expand_images(self, ids: list[int], data: Any) -> tuple[list[int], MultiModalPrompt]:
        """`ids` with the images of `multi_modal_data` expanded (see `process`)."""
        images = check_image_data(data)
        if self.images is None:
            raise ValueError(
                "multi_modal_data: this model is served text-only (a text model, or an "
                "image-text model started with language_model_only): images are not accepted"
            )
        if len(images) > self.images.limit:
            raise ValueError(
                f"multi_modal_data: {len(images)} images, more than the {self.images.limit} "
                "one prompt may carry (limit_mm_per_prompt)"
            )
        processed = [
            image if isinstance(image, ProcessedImage)  # `preprocess_images` did it
            else self.process_image(image, f"multi_modal_data.image[{i}]")
            for i, image in enumerate(images)
        ]  # fmt: skip
        proc = self.images.processor
        return expand_prompt(ids, processed, proc.placeholder_token_id, self.images.mrope)

    def preprocess_images(self, prompt: PromptInput) -> PromptInput:
        """`prompt` with its `multi_modal_data` images run through the image processor (the
        rest of `process` is left to it): the server does this on a thread of its own, so
        preprocessing never holds the tokenizer thread.

        Raises:
            ValueError: as `process` for the images.
        """
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return prompt
        data = prompt["multi_modal_data"]
        if isinstance(data, MultiModalPrompt) or self.images is None:
            return prompt  # processed already; or refused by `process`
        images = check_image_data(data)
        if len(images) > self.images.limit:
            return prompt  # refused by `process`, before any work
        processed = [self.process_image(image, f"multi_modal_data.image[{i}]")
                     for i, image in enumerate(images)]  # fmt: skip
        return {**prompt, "multi_modal_data": {"image": processed}}

    def process_image(self, image: Any, field: str) -> ProcessedImage:
        """One decoded image through the model's image processor.

        Raises:
            ValueError: naming `field`: not an image, too many pixels, or refused by the
                processor.
        """
        assert self.images is not None
        rgb = image_from_pil(image, self.images.media, field)
        try:
            return self.images.processor.process(rgb)
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from err

    def cache_points(
        self, prompt: PromptInput, num_tokens: int, mm: MultiModalPrompt | None = None
    ) -> list[int]:
        """The validated `"cache_points"` of a prompt dict of `num_tokens` tokens: sorted,
        without duplicates; `[]` when the prompt is not a dict or has none (or None).

        Each point is a token offset `p` with `0 < p < num_tokens`: the prefix
        `prompt_token_ids[:p]` is registered in the prefix cache as a node boundary while the
        request is live, so its prefill is cut there and a snapshot is saved there (when prefix
        caching is off they are accepted and ignored). At most `MAX_CACHE_POINTS` distinct
        points.

        Raises:
            ValueError: naming `cache_points`: not a list of integers, a point outside
                `(0, num_tokens)`, or more than `MAX_CACHE_POINTS` distinct points.

        With images (`mm`, from `process`), the points are offsets into the prompt as given
        (one placeholder per image) and are moved past each image's expansion; a prompt whose
        images came processed already (`MultiModalPrompt`) has expanded offsets.
        """
        if mm is None or not isinstance(prompt, dict):
            return check_cache_points(prompt, num_tokens)
        if isinstance(prompt.get("multi_modal_data"), MultiModalPrompt):
            return check_cache_points(prompt, num_tokens)
        given = num_tokens - mm.expansion
        points = check_cache_points(prompt, given)
        return [mm.expanded_offset(p) for p in points]

    def encode(self, text: Any, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Raises:
            ValueError: not a string, far too long, or text the tokenizer cannot encode
                (such as lone surrogates).
        """
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt is {len(text)} characters long: more than max_model_len "
                f"({self.max_model_len}) tokens can hold"
            )
        check_encodable("prompt", text)
        if not text:
            return []
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError, UnicodeError) as err:
            raise ValueError(f"prompt cannot be tokenized: {err}") from err

    def check_token_ids(self, name: str, ids: list[Any]) -> None:
        """Every id an integer in `[0, vocab_size)`.

        Raises:
            ValueError: naming `name` and the first bad ids.
        """
        vocab = self.vocab_size
        bad = [
            t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")

    def check_params(self, params: SamplingParams) -> None:
        """The parts of `params` that depend on the model.

        Raises:
            ValueError: `top_k` above the vocabulary, or stop token ids, logit bias or allowed
                token ids outside it.
        """
        if params.top_k > self.vocab_size:
            raise ValueError(
                f"SamplingParams.top_k must be at most the vocabulary size ({self.vocab_size}), "
                f"got {params.top_k}"
            )
        self.check_token_ids("stop_token_ids", params.stop_token_ids or [])
        self.check_token_ids("SamplingParams.logit_bias", list(params.logit_bias or {}))
        self.check_token_ids("SamplingParams.allowed_token_ids", params.allowed_token_ids or [])


def check_encodable(name: str, text: str) -> None:
    """Refuses text that is not valid Unicode (lone surrogates cannot be UTF-8 encoded).

    Raises:
        ValueError: naming `name`.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} is not valid Unicode text (position {err.start}: {err.reason})"
        ) from err


def check_cache_points(prompt: PromptInput, num_tokens: int) -> list[int]:
    """See `InputProcessor.cache_points`."""
    if not isinstance(prompt, dict):
        return []
    points = prompt.get("cache_points")
    if points is None:
        return []
    if not isinstance(points, (list, tuple)) or any(
        isinstance(p, bool) or not isinstance(p, int) for p in points
    ):
        raise ValueError("cache_points must be a list of integer token offsets")
    bad = [p for p in points if not 0 < p < num_tokens]
    if bad:
        raise ValueError(
            f"cache_points {bad[:5]} are outside the prompt: each must be in (0, {num_tokens})"
        )
    unique = sorted(set(points))
    if len(unique) > MAX_CACHE_POINTS:
        raise ValueError(
            f"cache_points has {len(unique)} distinct offsets, more than {MAX_CACHE_POINTS}"
        )
    return unique


def check_image_data(data: Any) -> list[Any]:
    """The images of a prompt's `multi_modal_data` (`{"image": image or list of images}`).

    Raises:
        ValueError: not a dict, a modality other than `image`, or no images.
    """
    if not isinstance(data, dict):
        raise ValueError('multi_modal_data must be a dict such as {"image": image}')
    other = [key for key in data if key != "image"]
    if other:
        raise ValueError(
            f"multi_modal_data: {', '.join(repr(k) for k in other)} not supported (only 'image')"
        )
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images or any(image is None for image in images):
        raise ValueError("multi_modal_data: 'image' needs at least one image")
    return images


def _split_prompt(prompt: PromptInput) -> tuple[Any, list[Any] | None]:
    """`(text, ids or None)` of the accepted prompt shapes."""
    if isinstance(prompt, dict):
        unused = [key for key in prompt if key not in PROMPT_FIELDS]
        if unused:
            names = ", ".join(repr(key) for key in unused)
            raise ValueError(
                f"prompt field(s) {names} not supported: the engine uses only "
                f"{', '.join(repr(f) for f in PROMPT_FIELDS)}"
            )
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of token ids")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string or token ids, got {type(prompt).__name__}")
