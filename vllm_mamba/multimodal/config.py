"""`MultiModalConfig`: how an engine serving an image-text model takes images (vLLM's
`--limit-mm-per-prompt`, `--mm-processor-kwargs`, `--allowed-local-media-path`, and the media
fetching budgets), and `image_inputs`, which builds the model's image processor for the
engine's input processor.

An engine has a `MultiModalConfig` only when its model serves images: an image-text
architecture (`models.image_text.SupportsImages`) not started with `language_model_only`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_mamba.multimodal.media import MediaConfig

if TYPE_CHECKING:
    from vllm_mamba.config import EngineConfig
    from vllm_mamba.engine.input_processor import ImageInputs

# The most images a prompt may carry by default.
DEFAULT_IMAGES_PER_PROMPT = 16
MODALITIES = ("image",)


@dataclass(frozen=True)
class MultiModalConfig:
    """An image-text engine's image options.

    Attributes:
        limit_per_prompt: the most items per prompt, by modality (`{"image": N}`).
        processor_kwargs: overrides of the image processor's settings (Qwen: `min_pixels`,
            `max_pixels`), refused at startup when the processor does not take them.
        media: where image URLs may come from and the size budgets (`multimodal.media`).
    """

    limit_per_prompt: dict[str, int] = field(
        default_factory=lambda: {"image": DEFAULT_IMAGES_PER_PROMPT}
    )
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    media: MediaConfig = field(default_factory=MediaConfig)

    @property
    def image_limit(self) -> int:
        """The most images per prompt."""
        return self.limit_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)


def json_option(name: str, value: Any) -> dict[str, Any]:
    """A JSON-object option given as a dict or as its JSON text (the CLI's); `{}` for None.

    Raises:
        ValueError: naming `name`: not valid JSON, or not an object.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return dict(value)


def check_limits(limits: dict[str, Any]) -> dict[str, int]:
    """`limit_mm_per_prompt` checked: known modalities, integers >= 0.

    Raises:
        ValueError: naming `limit_mm_per_prompt`.
    """
    out = {"image": DEFAULT_IMAGES_PER_PROMPT}
    for key, value in limits.items():
        if key not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt: modality {key!r} is not supported (only 'image')"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt: {key} must be an integer >= 0, got {value!r}")
        out[key] = value
    return out


def image_inputs(config: EngineConfig, tokenizer: Any) -> ImageInputs | None:
    """The input processor's image side for `config`'s model; None when it serves no images.

    Raises:
        ValueError: `mm_processor_kwargs` the model's image processor does not take.
    """
    from vllm_mamba.engine.input_processor import ImageInputs
    from vllm_mamba.models.registry import ModelRegistry

    mm = config.multimodal
    if mm is None:
        return None
    mc = config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(mc.architecture)
    processor = cls.image_processor(mc.path, mc.hf_config, tokenizer, mm.processor_kwargs)
    return ImageInputs(processor, mm.image_limit, bool(cls.uses_mrope), mm.media)


__all__ = ["MultiModalConfig", "check_limits", "image_inputs", "json_option"]
