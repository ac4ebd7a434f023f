"""What an image becomes on its way into the engine, and the two interfaces every image-text
model provides: its image processor (engine side) and its vision encoder (worker side).

- An `ImageProcessor` turns one decoded image (`PIL.Image.Image`) into a `ProcessedImage`: the
  tensors its encoder reads (`features`), the token ids that replace the image's one
  placeholder token in the prompt (`token_ids`: Qwen's `<|image_pad|>` repeated once per merged
  patch; LFM2-VL's tile markers around its `<image>` tokens), which of those positions take the
  encoder's output rows (`embed_offsets`), and for M-RoPE models the image's grid in LLM tokens.
  It reproduces the checkpoint's own Hugging Face processor (same pixels, same token counts).
- A `VisionEncoder` (an `nn.Module` in the worker) turns a list of images' `features` into
  one `(n_i, text_hidden)` tensor per image, `n_i == len(embed_offsets)`, in that order.

An image is identified by `content_hash`: the decoded pixels and the processor settings, so
two requests with the same image share their encoder output and their prefix-cache entries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model takes it.

    Attributes:
        features: the encoder's inputs for this image, by name (Qwen: `pixel_values
            (P, C * T * ps * ps)`, `image_grid_thw (3,)`; LFM2-VL: `pixel_values`,
            `spatial_shapes`, `pixel_attention_mask` of its tiles).
        token_ids: the ids that replace the image's placeholder token in the prompt.
        embed_offsets: offsets into `token_ids` whose input embeddings are the encoder's
            output rows, in order (the other positions embed their token as usual).
        grid: `(t, h, w)` of the image in LLM tokens (after merging) for M-RoPE models, else
            None.
        content_hash: hex digest identifying the image and the processor settings.
        extra: what a processor reports beside (LFM2-VL: the tile rows and columns).
    """

    features: dict[str, torch.Tensor]
    token_ids: list[int]
    embed_offsets: list[int]
    grid: tuple[int, int, int] | None = None
    content_hash: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class ImageProcessor(Protocol):
    """A model's image preprocessing (engine side, no model weights)."""

    placeholder_token_id: int  # the one token a prompt marks each image with

    def process(self, image: Any) -> ProcessedImage:
        """`image` (a `PIL.Image.Image`) -> its `ProcessedImage`.

        Raises:
            ValueError: an image the processor cannot take (too small, too many pixels).
        """
        ...


class VisionEncoder(nn.Module):
    """A model's vision tower and projector (worker side)."""

    def encode(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `ProcessedImage.features` -> its `(n_i, text_hidden)` embeddings."""
        raise NotImplementedError


def content_hash(image: Any, settings: Any = None) -> str:
    """Hex digest of a decoded image's mode, size and pixels, and of `settings` (the
    processor's options that change its output)."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size}:{settings!r}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
