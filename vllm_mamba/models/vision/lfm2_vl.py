"""LFM2-VL's image processor and vision encoder (the SigLIP2 NaFlex tower and the projector of
Liquid AI's image-text checkpoints), matching transformers 5.24's `Lfm2VlImageProcessor`,
`Lfm2VlProcessor` and `Lfm2VlModel.get_image_features`.

`Lfm2VlImageProcessor` (engine side) turns a decoded image into crops of whole patches:

- an image small enough for one crop (`max_image_tokens * (patch * factor)^2` pixels, times
  `max_pixels_tolerance`) is resized ("smart resize") to multiples of `patch * factor` holding
  between `min_image_tokens` and `max_image_tokens` LLM tokens;
- a larger one, with `do_image_splitting`, is resized to a grid of `tile_size` tiles (the
  `min_tiles..max_tiles` grid closest to its aspect ratio) and cut into them, row by row, and
  with `use_thumbnail` the smart-resized whole image follows as one more crop;
- each crop is rescaled and normalised, cut into `patch x patch` patches (flattened row by row,
  `(py, px, channel)` within a patch) and padded with zero patches to `max_num_patches`
  (`pixel_attention_mask` marks the real ones, `spatial_shapes` is its `(rows, cols)` in
  patches).

Resizing is torchvision's (`transforms.v2.functional.resize`, which transformers calls; done
here with torch alone, as torchvision 0.28, the release for torch 2.13, does it: bilinear with
antialiasing, on the uint8 image on AVX2 / AVX512 and ARM CPUs and through float32, rounded, on
others), so the pixels are transformers' own. The prompt's one `<image>` becomes, as
`Lfm2VlProcessor` expands it:

    <|image_start|> [<|img_row_R_col_C|> <image> x tokens_per_tile] per tile
                    [<|img_thumbnail|> <image> x thumbnail tokens]     (with use_thumbnail)
                    <|image_end|>

or `<|image_start|> <image> x tokens <|image_end|>` for a single crop (the markers only with
`use_image_special_tokens`); every crop gives `(rows / factor) * (cols / factor)` tokens.

`Lfm2VlVisionEncoder` (worker side; checkpoint names under `model.`):

    vision_tower.embeddings      patch_embedding: Linear over each flattened patch; a learned
                                 (S, S) position grid resized to each crop's (rows, cols) with
                                 antialiased bilinear weights and added
    vision_tower.encoder.layers  pre-norm LayerNorm blocks: attention over the crop's real
                                 patches (padding masked out as keys), GELU (tanh) MLP
    vision_tower.post_layernorm  LayerNorm
    multi_modal_projector        pixel unshuffle (each factor x factor block of patches
                                 concatenated: row offset, then column offset, then channel),
                                 LayerNorm (`projector_use_layernorm`), linear_1, GELU, linear_2

transformers 5.24 runs every layer of `vision_config` and the post-layernorm (its LFM2-VL has
no `vision_feature_layer`); a checkpoint written with the older `vision_tower.vision_model.`
names loads too, and the unused pooling head (`vision_tower.head.*`) is skipped.

Glossary: T crops (tiles and thumbnails) of a step's images, L patches of the longest crop,
K = 3 * patch^2, D vision width, f downsample factor, H heads, Hd head dim.
"""

from __future__ import annotations

import json
import math
import os
import platform
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.linear import Linear
from vllm_mamba.multimodal.inputs import ProcessedImage, VisionEncoder, content_hash
from vllm_mamba.ops.table import MambaOps

# ----- the processor (engine side) ------------------------------------------------------------

# transformers 5.24's `Lfm2VlImageProcessor` class defaults (IMAGENET_STANDARD mean / std).
DEFAULT_SETTINGS: dict[str, Any] = {
    "downsample_factor": 2,
    "do_image_splitting": True,
    "min_tiles": 2,
    "max_tiles": 10,
    "use_thumbnail": True,
    "min_image_tokens": 64,
    "max_image_tokens": 256,
    "encoder_patch_size": 16,
    "tile_size": 512,
    "max_pixels_tolerance": 2.0,
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_pad": True,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
}

# The settings `mm_processor_kwargs` may override (transformers' per-call processor kwargs that
# keep the model's inputs valid), with their types. LFM2-VL has no min_pixels / max_pixels.
PROCESSOR_KWARGS: dict[str, type] = {
    "do_image_splitting": bool,
    "use_thumbnail": bool,
    "use_image_special_tokens": bool,
    "min_tiles": int,
    "max_tiles": int,
    "min_image_tokens": int,
    "max_image_tokens": int,
    "tile_size": int,
    "max_pixels_tolerance": float,
}

_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR


def _round_by_factor(number: float, factor: int) -> int:
    """The multiple of `factor` closest to `number` (Python's round: halves to even)."""
    return round(number / factor) * factor


def _target_ratios(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """The `(cols, rows)` grids of `min_tiles..max_tiles` tiles, by tile count; built exactly as
    transformers builds them, since ties in `_closest_aspect_ratio` follow this order."""
    ratios = [
        (w, h)
        for n in range(min_tiles, max_tiles + 1)
        for w in range(1, n + 1)
        for h in range(1, n + 1)
        if min_tiles <= w * h <= max_tiles
    ]
    return sorted(set(ratios), key=lambda x: x[0] * x[1])


def _closest_aspect_ratio(
    aspect_ratio: float, ratios: list[tuple[int, int]], width: int, height: int, tile: int
) -> tuple[int, int]:
    """transformers' `find_closest_aspect_ratio`: the `(cols, rows)` grid closest to `width /
    height`; on a tie the later grid wins if the image covers over half its pixels."""
    best_diff = float("inf")
    best = (1, 1)
    area = width * height
    for ratio in ratios:
        diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff = diff
            best = ratio
        elif diff == best_diff and area > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best


def _smart_resize(
    height: int, width: int, factor: int, min_tokens: int, max_tokens: int, patch: int
) -> tuple[int, int]:
    """transformers' `smart_resize`: `(height, width)` in multiples of `patch * factor` holding
    `min_tokens..max_tokens` LLM tokens, the aspect ratio kept as well as those allow."""
    total = patch * factor
    min_pixels = min_tokens * patch**2 * factor**2
    max_pixels = max_tokens * patch**2 * factor**2
    h_bar = max(total, _round_by_factor(height, total))
    w_bar = max(total, _round_by_factor(width, total))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(total, math.floor(height / beta / total) * total)
        w_bar = max(total, math.floor(width / beta / total) * total)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / total) * total
        w_bar = math.ceil(width * beta / total) * total
    return h_bar, w_bar


def _is_too_large(
    height: int, width: int, max_tokens: int, patch: int, factor: int, tolerance: float
) -> bool:
    """transformers' `_is_image_too_large`: whether the image is split into tiles."""
    total = patch * factor
    h_bar = max(patch, _round_by_factor(height, total))
    w_bar = max(patch, _round_by_factor(width, total))
    return h_bar * w_bar > max_tokens * patch**2 * factor**2 * tolerance


def _native_uint8_bilinear() -> bool:
    """torchvision 0.28's `_do_native_uint8_resize_on_cpu` for bilinear: torch's uint8 kernel on
    AVX2 / AVX512 and ARM CPUs, float32 and rounding on other ones."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


def _resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's tensor resize (bilinear, antialiased, corners not aligned) of `image (1, C,
    h, w)` uint8 -> `(1, C, height, width)` uint8."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    if _native_uint8_bilinear():
        return F.interpolate(
            image, size=[height, width], mode="bilinear", align_corners=False, antialias=True
        )
    out = F.interpolate(
        image.to(torch.float32),
        size=[height, width],
        mode="bilinear",
        align_corners=False,
        antialias=True,
    )
    return out.round_().to(torch.uint8)


def _to_rgb(image: Any) -> Any:
    """An RGB `PIL.Image.Image`: transparency composited on white, as transformers'
    `convert_to_rgb` (and the engine's media loader) do."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _check_value(key: str, value: Any, kind: type, where: str) -> Any:
    """`value` as a `kind` setting (bool, positive int, positive float), else ValueError."""
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
    if kind is int and not float(value).is_integer():
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{where}: {key} must be positive, got {value!r}")
    return int(value) if kind is int else float(value)


def _mean_std(value: Any, key: str) -> tuple[float, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    if len(values) != 3 or not all(isinstance(v, (int, float)) for v in values):
        raise ValueError(f"image processor: {key} must be 3 numbers, got {value!r}")
    return tuple(float(v) for v in values)


class Lfm2VlImageProcessor:
    """LFM2-VL's image preprocessing (see the module docstring).

    Args:
        settings: the checkpoint's image-processor settings (the `image_processor` entry of
            `processor_config.json`, or `preprocessor_config.json`); transformers' defaults
            for what they leave out or set to null.
        tokenizer: the checkpoint's tokenizer (`encode(text, add_special_tokens=False)`); its
            `image_token`, `image_start_token`, `image_end_token` and `image_thumbnail_token`
            attributes when it has them, else `<image>`, `<|image_start|>`, ... (as
            transformers' processor reads them).
        image_token_id: the config's `image_token_id` (the prompt's placeholder).
        overrides: `mm_processor_kwargs` (the keys of `PROCESSOR_KWARGS`).
        patch_size: the vision tower's patch size, when known, checked against the settings.
        downsample_factor: the model's downsample factor, when known, checked likewise.

    Raises:
        ValueError: an unknown or invalid override, settings transformers would not give the
            model consistent inputs with, or a tokenizer whose `<image>` is not the config's
            `image_token_id`.
    """

    def __init__(
        self,
        settings: dict[str, Any],
        tokenizer: Any,
        image_token_id: int,
        overrides: dict[str, Any] | None = None,
        *,
        patch_size: int | None = None,
        downsample_factor: int | None = None,
    ) -> None:
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(PROCESSOR_KWARGS))
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: {', '.join(unknown)} not supported by LFM2-VL's image "
                f"processor (it takes {', '.join(PROCESSOR_KWARGS)})"
            )
        s = dict(DEFAULT_SETTINGS)
        s.update({k: v for k, v in settings.items() if k in DEFAULT_SETTINGS and v is not None})
        where = "image processor"
        for key in ("do_image_splitting", "use_thumbnail", "do_rescale", "do_normalize", "do_pad"):
            s[key] = _check_value(key, s[key], bool, where)
        for key in (
            "downsample_factor",
            "min_tiles",
            "max_tiles",
            "min_image_tokens",
            "max_image_tokens",
            "encoder_patch_size",
            "tile_size",
        ):
            s[key] = _check_value(key, s[key], int, where)
        for key in ("max_pixels_tolerance", "rescale_factor"):
            s[key] = _check_value(key, s[key], float, where)
        s["image_mean"] = _mean_std(s["image_mean"], "image_mean")
        s["image_std"] = _mean_std(s["image_std"], "image_std")
        use_special = True  # transformers 5.24 takes it per call only (default True)
        for key, value in overrides.items():
            checked = _check_value(key, value, PROCESSOR_KWARGS[key], "mm_processor_kwargs")
            if key == "use_image_special_tokens":
                use_special = checked
            else:
                s[key] = checked
        if not s["do_pad"]:
            raise ValueError("image processor: do_pad false gives no spatial shapes or masks")
        if s["resample"] != _BILINEAR:
            raise ValueError(
                f"image processor: resample {s['resample']!r} is not supported (bilinear, 2)"
            )
        if not all(s["image_std"]):
            raise ValueError("image processor: image_std has a zero")
        if s["do_image_splitting"] and s["min_tiles"] > s["max_tiles"]:
            raise ValueError("image processor: min_tiles must be less than or equal to max_tiles")
        patch, factor = s["encoder_patch_size"], s["downsample_factor"]
        if patch_size is not None and patch != patch_size:
            raise ValueError(
                f"image processor: encoder_patch_size {patch} but the vision tower's patch "
                f"size is {patch_size}"
            )
        if downsample_factor is not None and factor != downsample_factor:
            raise ValueError(
                f"image processor: downsample_factor {factor} but the model's is "
                f"{downsample_factor}"
            )
        if s["do_image_splitting"] and s["tile_size"] % (patch * factor):
            raise ValueError(
                f"image processor: tile_size {s['tile_size']} is not a multiple of "
                f"encoder_patch_size * downsample_factor ({patch * factor}): the tiles' token "
                "counts would not match the encoder's"
            )
        self.settings = s
        self.use_image_special_tokens = use_special
        self.placeholder_token_id = int(image_token_id)
        # crops are padded to this many patches (transformers' `max_num_patches` of the call)
        tile_patches = (s["tile_size"] // patch) ** 2 if s["do_image_splitting"] else 0
        self.max_num_patches = max(s["max_image_tokens"] * factor**2, tile_patches)
        # the rescale folded into the mean and std, as transformers fuses them (float32)
        mean = torch.tensor(s["image_mean"])
        std = torch.tensor(s["image_std"])
        if s["do_rescale"] and s["do_normalize"]:
            mean = mean * (1.0 / s["rescale_factor"])
            std = std * (1.0 / s["rescale_factor"])
        self._mean = mean.view(-1, 1, 1)  # (3, 1, 1)
        self._std = std.view(-1, 1, 1)  # (3, 1, 1)
        self._tokenizer = tokenizer
        self._marker_ids: dict[str, list[int]] = {}
        self.image_token = getattr(tokenizer, "image_token", None) or "<image>"
        self.image_start_token = getattr(tokenizer, "image_start_token", None) or "<|image_start|>"
        self.image_end_token = getattr(tokenizer, "image_end_token", None) or "<|image_end|>"
        self.image_thumbnail_token = (
            getattr(tokenizer, "image_thumbnail_token", None) or "<|img_thumbnail|>"
        )
        if self._ids(self.image_token) != [self.placeholder_token_id]:
            raise ValueError(
                f"the tokenizer encodes {self.image_token!r} as {self._ids(self.image_token)}, "
                f"not the config's image_token_id {self.placeholder_token_id}"
            )
        self._hash_settings = (
            tuple(sorted(s.items())),
            ("use_image_special_tokens", use_special),
        )

    @classmethod
    def from_config(
        cls,
        settings: dict[str, Any],
        tokenizer: Any,
        hf_config: Any,
        **mm_processor_kwargs: Any,
    ) -> Lfm2VlImageProcessor:
        """From the image-processor settings dict and the top-level `Lfm2VlConfig`."""
        vision = getattr(hf_config, "vision_config", None)
        patch = getattr(vision, "patch_size", None)
        return cls(
            settings,
            tokenizer,
            int(hf_config.image_token_id),
            mm_processor_kwargs,
            patch_size=int(patch) if isinstance(patch, int) else None,
            downsample_factor=getattr(hf_config, "downsample_factor", None),
        )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str,
        tokenizer: Any,
        hf_config: Any,
        **mm_processor_kwargs: Any,
    ) -> Lfm2VlImageProcessor:
        """From the checkpoint directory, reading what transformers reads: the `image_processor`
        entry of `processor_config.json` (what 5.x `save_pretrained` writes), else
        `preprocessor_config.json`; transformers' defaults when it has neither."""
        settings: dict[str, Any] = {}
        nested = os.path.join(model_dir, "processor_config.json")
        legacy = os.path.join(model_dir, "preprocessor_config.json")
        if os.path.isfile(nested):
            with open(nested) as f:
                settings = json.load(f).get("image_processor") or {}
        if not settings and os.path.isfile(legacy):
            with open(legacy) as f:
                settings = json.load(f)
        return cls.from_config(settings, tokenizer, hf_config, **mm_processor_kwargs)

    def _ids(self, text: str) -> list[int]:
        """`text`'s token ids on its own (cached): each marker sits between added tokens in the
        expanded prompt, so the tokenizer encodes it as this segment alone."""
        ids = self._marker_ids.get(text)
        if ids is None:
            ids = [int(i) for i in self._tokenizer.encode(text, add_special_tokens=False)]
            self._marker_ids[text] = ids
        return ids

    def _crops(self, pixels: torch.Tensor) -> tuple[list[torch.Tensor], int, int, int]:
        """`pixels (1, 3, h, w)` uint8 -> the resized crops `(1, 3, H, W)` uint8 (tiles row by
        row, then the thumbnail), the grid's rows and columns (1, 1 unsplit) and the thumbnail's
        (or the single crop's) LLM token count."""
        s = self.settings
        height, width = pixels.shape[-2:]
        patch, factor = s["encoder_patch_size"], s["downsample_factor"]
        min_tiles, max_tiles = (
            (s["min_tiles"], s["max_tiles"]) if s["do_image_splitting"] else (1, 1)
        )
        splitting = not min_tiles == max_tiles == 1
        large = _is_too_large(
            height, width, s["max_image_tokens"], patch, factor, s["max_pixels_tolerance"]
        )
        new_h, new_w = _smart_resize(
            height, width, factor, s["min_image_tokens"], s["max_image_tokens"], patch
        )
        # transformers' `_compute_tokens_for_image`
        tokens = math.ceil((new_h // patch) / factor) * math.ceil((new_w // patch) / factor)
        if not (large and splitting):
            return [_resize(pixels, new_h, new_w)], 1, 1, tokens
        tile = s["tile_size"]
        cols, rows = _closest_aspect_ratio(
            width / height, _target_ratios(min_tiles, max_tiles), width, height, tile
        )
        if rows * cols == 1:
            raise ValueError(
                f"image of {width}x{height} pixels: its 1x1 tile grid (min_tiles 1) gets "
                "transformers' single-image token count for a tile_size crop"
            )
        grid = _resize(pixels, tile * rows, tile * cols)  # (1, 3, rows tile, cols tile)
        tiles = grid.reshape(1, 3, rows, tile, cols, tile).permute(0, 2, 4, 1, 3, 5)
        crops = list(tiles.reshape(rows * cols, 1, 3, tile, tile).unbind(0))
        if s["use_thumbnail"]:
            crops.append(_resize(pixels, new_h, new_w))
        return crops, rows, cols, tokens

    def _patches(self, crop: torch.Tensor) -> torch.Tensor:
        """A crop `(1, 3, H, W)` uint8 -> its normalised patches `(H / p * W / p, p * p * 3)`."""
        s = self.settings
        if s["do_normalize"]:
            x = crop.to(torch.float32).sub_(self._mean).div_(self._std)
        elif s["do_rescale"]:
            x = crop * s["rescale_factor"]
        else:
            x = crop
        p = s["encoder_patch_size"]
        _, channels, height, width = x.shape
        x = x.reshape(channels, height // p, p, width // p, p)  # (3, rows, p, cols, p)
        x = x.permute(1, 3, 2, 4, 0)  # (rows, cols, p, p, 3)
        return x.reshape((height // p) * (width // p), -1)

    def process(self, image: Any) -> ProcessedImage:
        """`image` (a `PIL.Image.Image`; other modes are made RGB, transparency on white) -> its
        crops' `pixel_values (n, max_num_patches, 3 p^2)` float32, `spatial_shapes (n, 2)`
        int64, `pixel_attention_mask (n, max_num_patches)` int32, and the prompt tokens.

        Raises:
            ValueError: not a PIL image, an empty one, or one so elongated that a crop has more
                patches than `max_num_patches` (transformers gives it inconsistent inputs).
        """
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(f"expected a PIL image, got {type(image).__name__}")
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"image of {width}x{height} pixels: it is empty")
        rgb = np.array(_to_rgb(image), dtype=np.uint8)  # (h, w, 3)
        pixels = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()[None]  # (1, 3, h, w)
        crops, rows, cols, image_tokens = self._crops(pixels)
        s = self.settings
        patch, factor = s["encoder_patch_size"], s["downsample_factor"]
        budget = self.max_num_patches
        values, shapes, masks = [], [], []
        for crop in crops:
            patches = self._patches(crop)  # (n_patches, 3 p^2)
            n = patches.shape[0]
            if n > budget:
                raise ValueError(
                    f"image of {width}x{height} pixels: a crop of {crop.shape[-1]}x"
                    f"{crop.shape[-2]} pixels has {n} patches, more than the processor's "
                    f"{budget} (aspect ratio too extreme)"
                )
            values.append(F.pad(patches, (0, 0, 0, budget - n)))  # (budget, 3 p^2)
            mask = torch.ones(budget, dtype=torch.int32)
            mask[n:] = 0
            masks.append(mask)
            shapes.append([crop.shape[-2] // patch, crop.shape[-1] // patch])

        token_ids, offsets = self._tokens(rows, cols, image_tokens)
        expected = sum((h // factor) * (w // factor) for h, w in shapes)
        if len(offsets) != expected:  # guarded by the settings checks; never silently wrong
            raise ValueError(
                f"image of {width}x{height} pixels: {len(offsets)} image tokens for "
                f"{expected} encoder rows"
            )
        features = {
            "pixel_values": torch.stack(values),  # (n, budget, 3 p^2)
            "spatial_shapes": torch.tensor(shapes, dtype=torch.int64),  # (n, 2)
            "pixel_attention_mask": torch.stack(masks),  # (n, budget)
        }
        return ProcessedImage(
            features=features,
            token_ids=token_ids,
            embed_offsets=offsets,
            grid=None,
            content_hash=content_hash(image, self._hash_settings),
            extra={"rows": rows, "cols": cols},
        )

    def _tokens(self, rows: int, cols: int, image_tokens: int) -> tuple[list[int], list[int]]:
        """transformers' `_build_image_tokens` as ids, and the offsets of its `<image>` ids."""
        s = self.settings
        special = self.use_image_special_tokens
        patch, factor = s["encoder_patch_size"], s["downsample_factor"]
        per_tile = math.ceil((s["tile_size"] // patch) / factor) ** 2
        ids: list[int] = []
        offsets: list[int] = []

        def images(count: int) -> None:
            offsets.extend(range(len(ids), len(ids) + count))
            ids.extend([self.placeholder_token_id] * count)

        if special:
            ids.extend(self._ids(self.image_start_token))
        if rows > 1 or cols > 1:
            for row in range(rows):
                for col in range(cols):
                    if special:
                        ids.extend(self._ids(f"<|img_row_{row + 1}_col_{col + 1}|>"))
                    images(per_tile)
            if s["use_thumbnail"]:
                if special:
                    ids.extend(self._ids(self.image_thumbnail_token))
                images(image_tokens)
        else:
            images(image_tokens)
        if special:
            ids.extend(self._ids(self.image_end_token))
        return ids, offsets


# ----- the encoder (worker side) --------------------------------------------------------------

_ACTS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def _act(name: str) -> Any:
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(_ACTS)})")
    return _ACTS[name]


class _Embeddings(nn.Module):
    """`patch_embedding` (Linear over a flattened patch) and `position_embedding` (the learned
    `(S, S)` grid, `num_patches = S^2` rows)."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        width = config.hidden_size
        patch_dim = config.num_channels * config.patch_size**2
        self.patch_embedding = Linear(patch_dim, width, True, ops)
        self.position_embedding = nn.Embedding(config.num_patches, width)
        self.side = int(config.num_patches**0.5)

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The grid resized to `(rows, cols)` -> `(rows * cols, D)`, float32: transformers' weights
        of `F.interpolate(bilinear, align_corners=False, antialias=True)` along each axis."""
        side = self.side
        table = self.position_embedding.weight.float().view(side, side, -1)  # (S, S, D)
        device = table.device
        source = torch.arange(side, device=device, dtype=torch.float32)

        def weights(size: int) -> torch.Tensor:
            scale = torch.tensor(float(side)) / size  # float32, as transformers divides
            support = scale.clamp(min=1)
            index = torch.arange(size, device=device, dtype=torch.float32)
            center = (index + 0.5) * scale - 0.5  # (size,)
            w = (1 - (source - center[:, None]).abs() / support).clamp(min=0)  # (size, S)
            return w / w.sum(-1, keepdim=True)

        resized = torch.einsum("ia,jb,abd->ijd", weights(rows), weights(cols), table)
        return resized.reshape(rows * cols, -1)  # (rows cols, D)


class _Attention(nn.Module):
    """`q_proj`, `k_proj`, `v_proj`, `out_proj`: every patch of a crop attends to its crop's
    real patches."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = width // self.heads
        if self.head_dim * self.heads != width:
            raise ValueError(f"vision hidden_size {width} is not a multiple of the head count")
        self.q_proj = Linear(width, width, True, ops)
        self.k_proj = Linear(width, width, True, ops)
        self.v_proj = Linear(width, width, True, ops)
        self.out_proj = Linear(width, width, True, ops)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`x (T, L, D)`, `mask (T, 1, 1, L)` bool (True: a real patch) or None -> `(T, L, D)`."""
        crops, length, width = x.shape
        flat = x.reshape(-1, width)  # (T L, D)

        def heads(proj: Linear) -> torch.Tensor:
            out = proj(flat).view(crops, length, self.heads, self.head_dim)
            return out.transpose(1, 2)  # (T, H, L, Hd)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (T, H, L, Hd)
        out = out.transpose(1, 2).reshape(-1, width)  # (T L, D)
        return self.out_proj(out).view(crops, length, width)


class _MLP(nn.Module):
    """`fc1`, the activation, `fc2`."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.act = _act(config.hidden_act)
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, True, ops)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, True, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (N, D)` -> `(N, D)`."""
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    """`layer_norm1`, `self_attn`, `layer_norm2`, `mlp`: a pre-norm residual block."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = _Attention(config, ops)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = _MLP(config, ops)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`x (T, L, D)` -> `(T, L, D)`."""
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x).flatten(0, 1)).view_as(x)


class _Encoder(nn.Module):
    """`layers`: the `num_hidden_layers` blocks."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            _EncoderLayer(config, ops) for _ in range(config.num_hidden_layers)
        )


class _VisionTower(nn.Module):
    """SigLIP2's NaFlex vision transformer: `embeddings`, `encoder`, `post_layernorm`."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config, ops)
        self.encoder = _Encoder(config, ops)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, patches: torch.Tensor, shapes: list[tuple[int, int]], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """`patches (T, L, K)`, each crop's `(rows, cols)`, `mask (T, L)` bool or None ->
        `(T, L, D)` (rows past a crop's `rows * cols` are padding)."""
        crops, length, _ = patches.shape
        embed = self.embeddings.patch_embedding
        x = embed(patches.to(embed.compute_dtype).flatten(0, 1)).view(crops, length, -1)
        pos = torch.zeros(crops, length, x.shape[-1], dtype=x.dtype, device=x.device)
        cache: dict[tuple[int, int], torch.Tensor] = {}
        for i, (rows, cols) in enumerate(shapes):
            if (rows, cols) not in cache:
                cache[(rows, cols)] = self.embeddings.positions(rows, cols).to(x.dtype)
            pos[i, : rows * cols] = cache[(rows, cols)]
        x = x + pos  # (T, L, D)
        attn_mask = None if mask is None else mask[:, None, None, :]  # (T, 1, 1, L)
        for layer in self.encoder.layers:
            x = layer(x, attn_mask)
        return self.post_layernorm(x)


class _Projector(nn.Module):
    """`layer_norm` (with `projector_use_layernorm`), `linear_1`, the activation, `linear_2`:
    unshuffled patch blocks `(N, D f^2)` -> the language model's width."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        in_width = config.vision_config.hidden_size * config.downsample_factor**2
        bias = config.projector_bias
        self.layer_norm = nn.LayerNorm(in_width) if config.projector_use_layernorm else None
        self.linear_1 = Linear(in_width, config.projector_hidden_size, bias, ops)
        self.act = _act(config.projector_hidden_act)
        self.linear_2 = Linear(
            config.projector_hidden_size, config.text_config.hidden_size, bias, ops
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (N, D f^2)` -> `(N, text_hidden)`."""
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


def _unshuffle(x: torch.Tensor, rows: int, cols: int, factor: int) -> torch.Tensor:
    """A crop's patch rows `x (rows * cols, D)` -> its LLM tokens `(rows / f * cols / f, f^2 D)`:
    each `f x f` block (row-major over the crop) concatenated by row offset, then column offset
    (a last odd row or column is dropped, as transformers drops it)."""
    width = x.shape[-1]
    out_rows, out_cols = rows // factor, cols // factor
    grid = x.view(rows, cols, width)[: out_rows * factor, : out_cols * factor]
    grid = grid.reshape(out_rows, factor, out_cols, factor, width)
    return grid.permute(0, 2, 1, 3, 4).reshape(out_rows * out_cols, factor * factor * width)


class Lfm2VlVisionEncoder(VisionEncoder):
    """LFM2-VL's vision tower and projector (see the module docstring); parameter names are the
    checkpoint's after its leading `model.`.

    Args:
        config: the top-level `Lfm2VlConfig` (`vision_config`, `text_config`, the projector's
            settings, `downsample_factor`).
        ops: the engine's op table (its linear op runs every projection).
        dtype: the parameters' dtype (float32 when None).
    """

    def __init__(self, config: Any, ops: MambaOps, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        vision = config.vision_config
        self.factor = int(config.downsample_factor)
        self.vision_tower = _VisionTower(vision, ops)
        self.multi_modal_projector = _Projector(config, ops)
        if dtype is not None:
            self.to(dtype)
        self._register_load_state_dict_pre_hook(_checkpoint_names)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name (after the leading `model.`) -> this module's parameter
        name: the older `vision_tower.vision_model.` spelling (transformers < 5, and the files
        it wrote) as `vision_tower.`; None for SigLIP2's pooling head (`vision_tower.head.`),
        which LFM2-VL never runs. `load_state_dict` applies it itself."""
        old = "vision_tower.vision_model."
        if name.startswith(old):
            name = "vision_tower." + name[len(old) :]
        if name.startswith("vision_tower.head."):
            return None
        return name

    def encode(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `pixel_values (n, P, K)`, `spatial_shapes (n, 2)` and
        `pixel_attention_mask (n, P)` -> its `(sum of (rows / f) * (cols / f), text_hidden)` rows:
        crop by crop, each row-major. All crops of all images run through the tower together,
        padded to the longest crop, padding masked out of attention."""
        if not images:
            return []
        shapes: list[tuple[int, int]] = []
        counts: list[int] = []
        for image in images:
            spatial = image["spatial_shapes"]
            pixels = image["pixel_values"]
            mask = image["pixel_attention_mask"]
            if pixels.dim() != 3 or spatial.shape != (pixels.shape[0], 2):
                raise ValueError(
                    f"pixel_values {tuple(pixels.shape)} and spatial_shapes "
                    f"{tuple(spatial.shape)} do not describe the same crops"
                )
            if mask.shape != pixels.shape[:2]:
                raise ValueError(f"pixel_attention_mask {tuple(mask.shape)} for {pixels.shape}")
            crop_shapes = [(int(h), int(w)) for h, w in spatial.tolist()]
            if any(h * w > pixels.shape[1] or h < 1 or w < 1 for h, w in crop_shapes):
                raise ValueError(f"spatial_shapes {crop_shapes} exceed {pixels.shape[1]} patches")
            shapes.extend(crop_shapes)
            counts.append(sum((h // self.factor) * (w // self.factor) for h, w in crop_shapes))
        length = max(h * w for h, w in shapes)

        def fit(t: torch.Tensor) -> torch.Tensor:
            """`(n, P, ...)` -> `(n, L, ...)`: trailing padding cut, or zeros added."""
            if t.shape[1] >= length:
                return t[:, :length]
            pad = [0, 0] * (t.dim() - 2) + [0, length - t.shape[1]]
            return F.pad(t, pad)

        patches = torch.cat([fit(image["pixel_values"]) for image in images])  # (T, L, K)
        mask = torch.cat([fit(image["pixel_attention_mask"]) for image in images]).bool()
        hidden = self.vision_tower(patches, shapes, None if bool(mask.all()) else mask)
        tokens = torch.cat(
            [_unshuffle(hidden[i, : h * w], h, w, self.factor) for i, (h, w) in enumerate(shapes)]
        )  # (N, f^2 D)
        out = self.multi_modal_projector(tokens)  # (N, text_hidden)
        return list(out.split(counts))


def _checkpoint_names(
    state_dict: dict[str, torch.Tensor],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """`load_state_dict` pre-hook: each key under `prefix` as `checkpoint_name` maps it (the
    older names renamed, the pooling head dropped)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = Lfm2VlVisionEncoder.checkpoint_name(key[len(prefix) :])
        if name is None:
            del state_dict[key]
        elif name != key[len(prefix) :]:
            state_dict[prefix + name] = state_dict.pop(key)
