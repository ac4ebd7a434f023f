"""The Qwen3-VL vision tower of Qwen3.5 / Qwen3.6 image-text checkpoints, and their image
processor.

`Qwen3VisionEncoder` (checkpoint names under `model.visual.`):

    patch_embed.proj      Conv3d (C, T, P, P) -> D with stride = kernel: one linear map of each
                          flattened patch `(C * T * P * P)`, run as such
    pos_embed             learned (S * S, D) grid, resampled bilinearly (corners aligned) to
                          each image's (h, w) patch grid and added
    blocks.i              pre-norm LayerNorm blocks: attention with 2-D rotary embedding (the
                          first half of each head's frequencies turn with the patch row, the
                          second with its column), every patch attending to every patch of its
                          own image; a GELU (tanh) MLP
    merger                LayerNorm, then each 2 x 2 block of patches (consecutive in the
                          processor's order) concatenated and mapped by a GELU MLP to the
                          language model's width

Patches come from the processor grouped by merge block (`merge x merge` consecutive patches
form one LLM token), which is the order every tensor here keeps. The encoder runs the images
of a step together: the linear layers over all patches at once (the engine's linear op),
attention per image.

`QwenImageProcessor` turns a decoded image into those patches with the checkpoint's processor
settings (`preprocessor_config.json`: smart resize to multiples of `patch_size * merge_size`
within `min_pixels` / `max_pixels`, CLIP normalisation; transformers' PIL image processor does
the pixel arithmetic, so the patches are transformers' own) and expands the prompt's one
`<|image_pad|>` into one per merged patch. Text positions after an image follow M-RoPE
(`layers.rotary_embedding`): the image's tokens sit at `(t, start + row, start + col)` and the
text after it at `start + max(rows, cols)`.

Glossary: N patches of the step's images, D vision width, P patch size, M merge size, Hd head
dim.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.linear import Linear
from vllm_mamba.multimodal.inputs import ProcessedImage, VisionEncoder, content_hash
from vllm_mamba.ops.table import MambaOps

_ACTS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


def _act(name: str) -> Any:
    if name not in _ACTS:
        raise ValueError(f"vision hidden_act {name!r} is not supported ({', '.join(_ACTS)})")
    return _ACTS[name]


class _PatchEmbed(nn.Module):
    """`proj`: the checkpoint's Conv3d, applied as one linear map of each flattened patch."""

    def __init__(self, channels: int, temporal: int, patch: int, width: int) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, width, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels (N, C * T * P * P)` -> `(N, D)`."""
        weight = self.proj.weight.flatten(1)  # (D, C T P P)
        return F.linear(pixels.to(weight.dtype), weight, self.proj.bias)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, ops: MambaOps) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = width // heads
        self.qkv = Linear(width, 3 * width, True, ops)
        self.proj = Linear(width, width, True, ops)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """`x (N, D)`, rotary `cos`, `sin (N, Hd)`; each image's `lengths` patches attend
        among themselves."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.heads, self.head_dim)  # (N, 3, h, Hd)
        qk = _rotate(qkv[:, :2], cos[:, None, None], sin[:, None, None])  # (N, 2, h, Hd)
        # (1, h, N, Hd) each: 4-D, so the CPU takes its flash-attention kernel
        q, k = (t.transpose(0, 1)[None] for t in qk.unbind(1))
        v = qkv[:, 2].transpose(0, 1)[None]
        if len(lengths) == 1:  # no mask: every patch sees its whole image
            out = F.scaled_dot_product_attention(q, k, v)  # (1, h, N, Hd)
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(qi, ki, vi)
                    for qi, ki, vi in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))
                ],
                dim=2,
            )
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of `x (..., Hd)` by `cos`, `sin` (broadcast to it), in float32 (as
    transformers)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str, ops: MambaOps) -> None:
        super().__init__()
        self.linear_fc1 = Linear(width, hidden, True, ops)
        self.linear_fc2 = Linear(hidden, width, True, ops)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        width = config.hidden_size
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.attn = _Attention(width, config.num_heads, ops)
        self.mlp = _MLP(width, config.intermediate_size, config.hidden_act, ops)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, width: int, merge: int, out: int, ops: MambaOps) -> None:
        super().__init__()
        self.merged = width * merge * merge
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.linear_fc1 = Linear(self.merged, self.merged, True, ops)
        self.linear_fc2 = Linear(self.merged, out, True, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (N, D)` -> `(N / M^2, out)`."""
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionEncoder(VisionEncoder):
    """The vision tower of a Qwen3.5 image-text checkpoint (see the module docstring).

    Args:
        config: the checkpoint's `vision_config`.
        ops: the engine's op table (its linear op runs every projection).
    """

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        width = config.hidden_size
        self.head_dim = width // config.num_heads
        self.patch_embed = _PatchEmbed(
            config.in_channels, config.temporal_patch_size, config.patch_size, width
        )
        self.pos_embed = nn.Embedding(config.num_position_embeddings, width)
        self.side = int(config.num_position_embeddings**0.5)
        self.theta = float(
            (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        )
        self.blocks = nn.ModuleList(_Block(config, ops) for _ in range(config.depth))
        self.merger = _Merger(width, self.merge, config.out_hidden_size, ops)

    def encode(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `pixel_values (n, C T P P)` and `image_grid_thw (3,)` -> its
        `(n / M^2, out_hidden)` rows."""
        grids = [tuple(int(v) for v in image["image_grid_thw"].tolist()) for image in images]
        pixels = torch.cat([image["pixel_values"] for image in images])  # (N, C T P P)
        lengths = [t * h * w for t, h, w in grids]
        if pixels.shape[0] != sum(lengths):
            raise ValueError(f"{pixels.shape[0]} patches for image grids {grids}")
        x = self.patch_embed(pixels)  # (N, D)
        index, weight = self._pos_taps(grids, x.device)  # (N, 4) each
        pos = (self.pos_embed(index) * weight[..., None].to(x.dtype)).sum(1)  # (N, D)
        x = x + pos.to(x.dtype)
        cos, sin = self._rotary(grids, x.device)  # (N, Hd) each
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        merged = self.merger(x)  # (N / M^2, out)
        return list(merged.split([n // self.merge**2 for n in lengths]))

    def _rows_cols(self, grids: list[tuple[int, int, int]], device: torch.device):  # noqa: ANN202
        """Each patch's `(row, col)` in its image, in merge-block order: `(N,)` each, and
        each patch's image height and width in patches."""
        m = self.merge
        rows, cols, heights, widths = [], [], [], []
        for t, h, w in grids:
            r = torch.arange(h, device=device)[:, None].expand(h, w)
            c = torch.arange(w, device=device)[None, :].expand(h, w)
            # (h / M, M, w / M, M) -> blocks row-major, patches within a block row-major
            r = r.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)
            c = c.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)
            rows.append(r)
            cols.append(c)
            heights.append(torch.full_like(r, h))
            widths.append(torch.full_like(c, w))
        return torch.cat(rows), torch.cat(cols), torch.cat(heights), torch.cat(widths)

    def _pos_taps(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The four rows of the learned `(S, S)` grid each patch reads, and their bilinear
        weights (corners aligned): `(N, 4)` each."""
        rows, cols, heights, widths = self._rows_cols(grids, device)
        side = self.side

        def taps(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            src = index.float() * (side - 1) / (size - 1).clamp(min=1).float()  # (N,)
            low = src.floor()
            at = (low.long()[:, None] + torch.arange(2, device=device)).clamp(0, side - 1)
            dist = (src[:, None] - low[:, None] - torch.arange(2, device=device)).abs()
            return at, (1 - dist).clamp(min=0)  # (N, 2) each

        h_at, h_w = taps(rows, heights)
        w_at, w_w = taps(cols, widths)
        index = (h_at[:, :, None] * side + w_at[:, None, :]).flatten(1)  # (N, 4)
        weight = (h_w[:, :, None] * w_w[:, None, :]).flatten(1)  # (N, 4)
        return index, weight

    def _rotary(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)`, `(N, Hd)` float32: the row's angles then the column's, twice."""
        rows, cols, _, _ = self._rows_cols(grids, device)
        half = self.head_dim // 2  # rotary frequencies over half a head: (Hd / 4,)
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, half, 2, dtype=torch.float, device=device) / half
        )
        angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], -1)  # (N, Hd/2)
        angles = torch.cat([angles, angles], -1)  # (N, Hd)
        return angles.cos(), angles.sin()


# ----- the processor (engine side) ------------------------------------------------------------

# The settings `mm_processor_kwargs` may override, and what they mean to transformers.
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


class QwenImageProcessor:
    """Qwen3.5's image preprocessing (see the module docstring).

    Args:
        settings: the checkpoint's image-processor settings (`preprocessor_config.json`).
        placeholder_token_id: `<|image_pad|>` (the config's `image_token_id`).
        overrides: `mm_processor_kwargs` (`min_pixels`, `max_pixels`).
    """

    def __init__(
        self,
        settings: dict[str, Any],
        placeholder_token_id: int,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(PROCESSOR_KWARGS))
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: {', '.join(unknown)} not supported by this model's "
                f"image processor (it takes {', '.join(PROCESSOR_KWARGS)})"
            )
        for key, value in overrides.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"mm_processor_kwargs: {key} must be a positive integer")
        keep = {k: v for k, v in settings.items() if not k.startswith("_")}
        keep.pop("image_processor_type", None)
        keep.pop("processor_class", None)
        size = dict(keep.pop("size", None) or {})
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = overrides.get(key, keep.pop(key, None))
            if value is not None:
                size[edge] = value
        self._hf = Qwen2VLImageProcessorPil(size=size or None, **keep)
        self.placeholder_token_id = placeholder_token_id
        self.merge = int(self._hf.merge_size)
        self.factor = int(self._hf.patch_size) * self.merge
        self.settings = (tuple(sorted(keep.items())), tuple(sorted(size.items())))

    @classmethod
    def from_pretrained(
        cls, model_dir: str, hf_config: Any, overrides: dict[str, Any] | None = None
    ) -> QwenImageProcessor:
        """From the checkpoint's `preprocessor_config.json` (or the `image_processor` entry of
        `processor_config.json`); transformers' defaults when it has neither."""
        settings: dict[str, Any] = {}
        for name, key in (
            ("preprocessor_config.json", None),
            ("processor_config.json", "image_processor"),
        ):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path) as f:
                    data = json.load(f)
                data = data.get(key, {}) if key else data
                if data:
                    settings = data
                    break
        vision = hf_config.vision_config
        settings.setdefault("patch_size", vision.patch_size)
        settings.setdefault("temporal_patch_size", vision.temporal_patch_size)
        settings.setdefault("merge_size", vision.spatial_merge_size)
        return cls(settings, int(hf_config.image_token_id), overrides)

    def process(self, image: Any) -> ProcessedImage:
        """`image` (RGB `PIL.Image.Image`) -> its patches, grid and `<|image_pad|>` tokens.

        Raises:
            ValueError: an aspect ratio over 200 (transformers' limit).
        """
        width, height = image.size
        if min(width, height) < 1 or max(width, height) / min(width, height) > 200:
            raise ValueError(
                f"image of {width}x{height} pixels: the aspect ratio must be under 200"
            )
        out = self._hf.preprocess([image], return_tensors="pt")
        pixels = out["pixel_values"]  # (n, C T P P) float32
        grid = out["image_grid_thw"][0]  # (3,) int64: patches in time, rows, columns
        t, h, w = (int(v) for v in grid.tolist())
        count = t * h * w // self.merge**2
        return ProcessedImage(
            features={"pixel_values": pixels, "image_grid_thw": grid},
            token_ids=[self.placeholder_token_id] * count,
            embed_offsets=list(range(count)),
            grid=(t, h // self.merge, w // self.merge),
            content_hash=content_hash(image, self.settings),
        )


__all__ = ["QwenImageProcessor", "Qwen3VisionEncoder"]
