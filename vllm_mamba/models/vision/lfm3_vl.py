"""LFM3-VL's image input: its image processor (engine side) and its vision encoder (worker side),
as transformers 5.24's `models/lfm3_vl` computes them.

- `Lfm3VlImageProcessor` owns the preprocessing of one image. LFM3-VL's processor
  (`Lfm3VlProcessor`, Qwen3-VL's) uses Qwen2-VL's image processor: the image is resized
  (`smart_resize`) so that both sides are multiples of `patch_size * merge_size` and its pixel
  count lies within `[min_pixels, max_pixels]` (`size.shortest_edge`, `size.longest_edge`),
  rescaled, normalised, and cut into `patch_size` patches listed block by block of
  `merge_size x merge_size` patches, the frame repeated `temporal_patch_size` times:
  `pixel_values (h * w, C * T * ps * ps)` and `image_grid_thw (3,) = (1, h, w)` in patches. The
  pixel math is transformers' own (`Qwen2VLImageProcessorPil`, the backend transformers picks
  without torchvision). No tiling. The processor replaces the prompt's one image token
  (`<|image_pad|>`) by `h * w / merge_size**2` image tokens and nothing else (the
  `<|vision_start|>` / `<|vision_end|>` around it come from the chat template), so `token_ids`
  is the image token repeated and every offset takes an encoder row.
- `Lfm3VlVisionEncoder` owns `vision_tower.*` (`Lfm3VlVisionModel`: a linear patch embedding
  and RMSNorm, then layers of a gated depthwise 2D convolution over each image's patch grid or
  bidirectional grouped-query attention within each image, with RMSNorm on the query and key
  heads and an axial 2D RoPE over the whole head, each followed by a SwiGLU MLP, pre-norm
  residuals) and `multi_modal_projector.*` (LayerNorm per patch, each `merge x merge` block
  concatenated into one row, Linear - activation - Linear to the text width).

The text model is LFM3's (`Lfm3Model`, as `Lfm3ForCausalLM`) with plain 1D positions: no M-RoPE,
so `ProcessedImage.grid` is None.

Checkpoint names: the parameters are named as `Lfm3VlForConditionalGeneration.state_dict()`
names them less the leading `model.`; the files transformers writes (and the released
checkpoints) spell three of them otherwise (`patchifier`, `q_layernorm`, `k_layernorm` for
`patch_embed`, `q_norm`, `k_norm`), which `load_state_dict` also takes (`checkpoint_name`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mlp import activation
from vllm_mamba.multimodal.inputs import ProcessedImage, VisionEncoder, content_hash
from vllm_mamba.ops.table import MambaOps

__all__ = ["Lfm3VlImageProcessor", "Lfm3VlVisionEncoder"]

# The `mm_processor_kwargs` LFM3-VL takes: its image processor's size settings, applied as
# transformers applies them at call time (`size` replaces the processor's, then `min_pixels` /
# `max_pixels` override its `shortest_edge` / `longest_edge`).
SIZE_KWARGS = ("min_pixels", "max_pixels", "size")
_SIZE_KEYS = ("shortest_edge", "longest_edge")
# Qwen2-VL's `smart_resize` refuses a longer side more than this many times the shorter one.
MAX_ASPECT_RATIO = 200
DEFAULT_IMAGE_TOKEN = "<|image_pad|>"


def _field(config: Any, name: str, default: Any = None) -> Any:
    """`config.name` or `config[name]` (configs may arrive as objects or dicts)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _pixel_count(value: Any, name: str) -> int:
    """`value` as a pixel count (a positive int), else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LFM3-VL {name} must be a positive integer, got {value!r}")
    return value


class Lfm3VlImageProcessor:
    """LFM3-VL's image processor (the `ImageProcessor` protocol): one image -> its patches, its
    grid and its image tokens, as transformers' `Lfm3VlProcessor` makes them."""

    def __init__(self, hf_image_processor: Any, image_token_id: int, size: dict[str, int]) -> None:
        """`hf_image_processor`: transformers' `Qwen2VLImageProcessorPil` as the checkpoint
        configures it; `size`: `{"shortest_edge": min_pixels, "longest_edge": max_pixels}`
        after the overrides."""
        self._hf = hf_image_processor
        self.placeholder_token_id = image_token_id
        self.size = dict(size)
        self.patch_size = int(hf_image_processor.patch_size)
        self.merge_size = int(hf_image_processor.merge_size)
        self.temporal_patch_size = int(hf_image_processor.temporal_patch_size)
        settings = dict(hf_image_processor.to_dict())
        settings["size"] = self.size
        settings["image_token_id"] = image_token_id
        self._settings = "lfm3_vl:" + json.dumps(settings, sort_keys=True, default=str)

    @classmethod
    def from_pretrained(
        cls, model_dir: str, tokenizer: Any, hf_config: Any, **mm_processor_kwargs: Any
    ) -> Lfm3VlImageProcessor:
        """The processor of the checkpoint in `model_dir` (its `processor_config.json`, whose
        `image_processor` entry `Lfm3VlProcessor.save_pretrained` writes, or a legacy
        `preprocessor_config.json`), with `mm_processor_kwargs` (`SIZE_KWARGS`) applied.

        The image token is `tokenizer.image_token` (else `<|image_pad|>`) and its id
        `tokenizer.image_token_id` (else the token's id), as `Lfm3VlProcessor` takes them;
        without a tokenizer, `hf_config.image_token_id`.

        Raises:
            ValueError: an unknown or invalid `mm_processor_kwargs` key (named), an image token
                the tokenizer lacks or that differs from `hf_config.image_token_id`, or patch
                settings that differ from the vision config's.
        """
        unknown = sorted(set(mm_processor_kwargs) - set(SIZE_KWARGS))
        if unknown:
            raise ValueError(
                f"unknown mm_processor_kwargs for LFM3-VL: {', '.join(unknown)} "
                f"(it takes {', '.join(SIZE_KWARGS)})"
            )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        hf = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        size = {key: _field(hf.size, key) for key in _SIZE_KEYS}
        if (override := mm_processor_kwargs.get("size")) is not None:
            extra = sorted(set(override) - set(_SIZE_KEYS)) if isinstance(override, dict) else []
            if not isinstance(override, dict) or extra or set(override) != set(_SIZE_KEYS):
                raise ValueError(
                    f"LFM3-VL mm_processor_kwargs size must be a dict with keys "
                    f"{', '.join(_SIZE_KEYS)}, got {override!r}"
                )
            size = dict(override)
        if (min_pixels := mm_processor_kwargs.get("min_pixels")) is not None:
            size["shortest_edge"] = min_pixels
        if (max_pixels := mm_processor_kwargs.get("max_pixels")) is not None:
            size["longest_edge"] = max_pixels
        size = {
            "shortest_edge": _pixel_count(size["shortest_edge"], "min_pixels (shortest_edge)"),
            "longest_edge": _pixel_count(size["longest_edge"], "max_pixels (longest_edge)"),
        }
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(
                f"LFM3-VL min_pixels {size['shortest_edge']} exceeds max_pixels "
                f"{size['longest_edge']}"
            )

        vision = _field(hf_config, "vision_config")
        if vision is not None:
            for ours, theirs in (
                ("patch_size", "patch_size"),
                ("merge_size", "spatial_merge_size"),
                ("temporal_patch_size", "temporal_patch_size"),
            ):
                want = _field(vision, theirs)
                if isinstance(want, int) and int(getattr(hf, ours)) != want:
                    raise ValueError(
                        f"LFM3-VL image processor {ours} {getattr(hf, ours)} differs from the "
                        f"vision config's {theirs} {want}"
                    )
        config_token_id = _field(hf_config, "image_token_id")
        image_token_id = cls._image_token_id(tokenizer, config_token_id)
        if config_token_id is not None and image_token_id != config_token_id:
            raise ValueError(
                f"LFM3-VL image token id {image_token_id} (tokenizer) differs from the config's "
                f"image_token_id {config_token_id}"
            )
        return cls(hf, image_token_id, size)

    @staticmethod
    def _image_token_id(tokenizer: Any, config_token_id: int | None) -> int:
        """The image token's id as `Lfm3VlProcessor.__init__` finds it."""
        if tokenizer is None:
            if config_token_id is None:
                raise ValueError("LFM3-VL needs a tokenizer or the config's image_token_id")
            return int(config_token_id)
        token_id = getattr(tokenizer, "image_token_id", None)
        if token_id:
            return int(token_id)
        token = getattr(tokenizer, "image_token", DEFAULT_IMAGE_TOKEN)
        token_id = tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if token_id is None or (token_id == unk and token != getattr(tokenizer, "unk_token", None)):
            raise ValueError(f"the tokenizer has no LFM3-VL image token {token!r}")
        return int(token_id)

    def process(self, image: Any) -> ProcessedImage:
        """`image` (a `PIL.Image.Image`) -> `features` `pixel_values (h * w, C * T * ps * ps)`
        float32 and `image_grid_thw (3,)` int64 (`(1, h, w)` patches), `token_ids` the image
        token `h * w / merge_size**2` times, all of them taking encoder rows.

        Raises:
            ValueError: not a PIL image, an empty one, a side more than 200 times the other,
                or one PIL cannot convert.
        """
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(f"LFM3-VL takes PIL images, got {type(image).__name__}")
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"LFM3-VL cannot take an empty image ({width}x{height})")
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise ValueError(
                f"LFM3-VL takes images whose sides are at most {MAX_ASPECT_RATIO} times each "
                f"other, got {width}x{height}"
            )
        try:
            out = self._hf.preprocess(image, size=self.size, return_tensors="pt")
        except (OSError, ValueError) as exc:
            raise ValueError(f"LFM3-VL cannot process the image: {exc}") from exc
        pixel_values = out["pixel_values"]  # (h * w, C * T * ps * ps) float32
        grid_thw = out["image_grid_thw"][0]  # (3,) int64: (1, h, w)
        n_tokens = int(grid_thw.prod()) // self.merge_size**2
        token_ids = [self.placeholder_token_id] * n_tokens
        return ProcessedImage(
            features={"pixel_values": pixel_values, "image_grid_thw": grid_thw},
            token_ids=token_ids,
            embed_offsets=list(range(n_tokens)),
            grid=None,
            content_hash=content_hash(image, self._settings),
        )


# --- vision encoder ---------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`(..., D)` -> `(..., D)`: `[-x2, x1]` of the halves `x1, x2`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Lfm3VlVisionRotary:
    """Axial 2D RoPE: one set of `D / 4` frequencies for the row and the column index, the
    angles `[row, col, row, col]` across the whole head (no partial rotation)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        # numbers, not tensors: the engine builds models on the meta device
        self.head_dim = head_dim
        self.theta = theta

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions (N, 2)` (row, column) -> `cos, sin (N, D)` float32."""
        spatial_dim = self.head_dim // 2
        exponents = (
            torch.arange(0, spatial_dim, 2, dtype=torch.float, device=positions.device)
            / spatial_dim
        )
        inv_freq = 1.0 / (self.theta**exponents)  # (D / 4,) float32
        freqs = positions[..., None].float() * inv_freq  # (N, 2, D / 4)
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # (N, D / 2)
        freqs = torch.cat([freqs, freqs], dim=-1)  # (N, D)
        return freqs.cos(), freqs.sin()


def _positions(grid: tuple[int, int, int], merge: int, device: torch.device) -> torch.Tensor:
    """The (row, column) of each patch of an image or video of `grid = (t, h, w)` patches, in
    the processor's merge-block order: `(t * h * w, 2)` long."""
    t, h, w = grid
    rows = torch.arange(h, device=device)[:, None].expand(h, w)  # (h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)  # (h, w)
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(1, 2).flatten()  # (h * w,)
    cols = cols.reshape(block).transpose(1, 2).flatten()  # (h * w,)
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)  # (t * h * w, 2)


class Lfm3VlVisionMLP(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, hidden: int, intermediate: int, ops: MambaOps) -> None:
        super().__init__()
        self.w1 = Linear(hidden, intermediate, False, ops)
        self.w3 = Linear(hidden, intermediate, False, ops)
        self.w2 = Linear(intermediate, hidden, False, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (N, hidden)` -> `(N, hidden)`."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm3VlVisionAttention(nn.Module):
    """Bidirectional grouped-query attention within each frame, RMSNorm on the query and key
    heads, axial RoPE."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hidden // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, False, ops)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, False, ops)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, False, ops)
        self.out_proj = Linear(self.num_heads * self.head_dim, hidden, False, ops)
        self.q_norm = RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        lengths: list[int],
    ) -> torch.Tensor:
        """`x (N, hidden)`, `rope` `cos, sin (N, D)`, `lengths` the frames' patch counts (sum
        `N`) -> `(N, hidden)`."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))  # (N, H, D)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))  # (N, KV, D)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (N, KV, D)
        cos, sin = (r[:, None, :] for r in rope)  # (N, 1, D) float32
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(q.dtype)  # (N, H, D)
        k = (kf * cos + _rotate_half(kf) * sin).to(k.dtype)  # (N, KV, D)
        q = q.transpose(0, 1).unsqueeze(0)  # (1, H, N, D)
        k = k.transpose(0, 1).unsqueeze(0)  # (1, KV, N, D)
        v = v.transpose(0, 1).unsqueeze(0)  # (1, KV, N, D)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)  # (1, H, N, D)
            v = v.repeat_interleave(groups, dim=1)  # (1, H, N, D)
        outs = [
            F.scaled_dot_product_attention(qs, ks, vs, scale=self.scaling)  # (1, H, n_i, D)
            for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]
        out = torch.cat(outs, dim=2)[0].transpose(0, 1)  # (N, H, D)
        return self.out_proj(out.reshape(n, self.num_heads * self.head_dim))


class Lfm3VlVisionShortConv(nn.Module):
    """Gated depthwise 2D convolution over each frame's patch grid:
    `out_proj(C * conv2d(B * x))` with `B, C, x = in_proj(h)`."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.merge = config.spatial_merge_size
        self.in_proj = Linear(hidden, 3 * hidden, False, ops)
        self.spatial_conv = nn.Conv2d(
            hidden,
            hidden,
            kernel_size=config.conv_kernel_size,
            padding=config.conv_kernel_size // 2,
            groups=hidden,
            bias=False,
        )
        self.out_proj = Linear(hidden, hidden, False, ops)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """`x (N, hidden)` in merge-block order, `grids` each item's `(t, h, w)` (sum of
        `t * h * w` is `N`) -> `(N, hidden)`."""
        input_gate, output_gate, conv_input = self.in_proj(x).chunk(3, dim=-1)  # 3 x (N, hid)
        gated = input_gate * conv_input  # (N, hidden)
        m, c = self.merge, gated.shape[-1]
        outs = []
        for frames, (t, h, w) in zip(gated.split([t * h * w for t, h, w in grids]), grids):
            frames = frames.view(t, h // m, w // m, m, m, c)  # blocks of m x m patches
            frames = frames.permute(0, 5, 1, 3, 2, 4).reshape(t, c, h, w)  # raster grid
            frames = self.spatial_conv(frames)  # (t, c, h, w)
            frames = frames.view(t, c, h // m, m, w // m, m)
            outs.append(frames.permute(0, 2, 4, 3, 5, 1).reshape(t * h * w, c))  # block order
        return self.out_proj(output_gate * torch.cat(outs, dim=0))


class Lfm3VlVisionLayer(nn.Module):
    """Pre-norm residual block: `operator_norm` -> conv or attention, `ffn_norm` -> MLP."""

    def __init__(self, config: Any, layer_idx: int, ops: MambaOps) -> None:
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] != "conv"
        if self.is_attention_layer:
            self.self_attn = Lfm3VlVisionAttention(config, ops)
        else:
            self.conv = Lfm3VlVisionShortConv(config, ops)
        self.feed_forward = Lfm3VlVisionMLP(config.hidden_size, config.intermediate_size, ops)
        self.operator_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        grids: list[tuple[int, int, int]],
        lengths: list[int],
    ) -> torch.Tensor:
        """`x (N, hidden)` -> `(N, hidden)`."""
        if self.is_attention_layer:
            x = x + self.self_attn(self.operator_norm(x), rope, lengths)
        else:
            x = x + self.conv(self.operator_norm(x), grids)
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm3VlVisionModel(nn.Module):
    """LFM3-VL's vision tower: patch embedding, RMSNorm, the conv / attention layers."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_dim = (
            config.in_channels * config.temporal_patch_size * config.patch_size**2
        )  # C * T * ps * ps
        rope_type = (config.rope_parameters or {}).get("rope_type", "axial")
        if rope_type != "axial":
            raise ValueError(f"LFM3-VL's vision RoPE is axial, the config asks for {rope_type!r}")
        self.patch_embed = Linear(self.patch_dim, config.hidden_size, False, ops)
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.layers = nn.ModuleList(
            Lfm3VlVisionLayer(config, i, ops) for i in range(config.num_hidden_layers)
        )
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = Lfm3VlVisionRotary(head_dim, config.rope_parameters["rope_theta"])

    def forward(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """`pixel_values (N, C * T * ps * ps)` of the items of `grids` (`(t, h, w)` each, in
        merge-block order) -> `(N, hidden)`."""
        positions = torch.cat(
            [_positions(g, self.spatial_merge_size, pixel_values.device) for g in grids]
        )  # (N, 2)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # one attention span per frame
        x = self.embedding_norm(self.patch_embed(pixel_values))  # (N, hidden)
        rope = self.rotary(positions)  # cos, sin (N, D)
        for layer in self.layers:
            x = layer(x, rope, grids, lengths)
        return x


class Lfm3VlMultiModalProjector(nn.Module):
    """LayerNorm per vision token, each `merge x merge` block concatenated into one row, then
    Linear - activation - Linear to the text width."""

    def __init__(self, config: Any, ops: MambaOps) -> None:
        super().__init__()
        vision = config.vision_config
        self.merged_hidden_size = vision.hidden_size * vision.spatial_merge_size**2
        self.layer_norm = nn.LayerNorm(vision.hidden_size, eps=1e-6)
        bias = config.projector_bias
        self.linear_1 = Linear(self.merged_hidden_size, config.projector_hidden_size, bias, ops)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = Linear(
            config.projector_hidden_size, config.text_config.hidden_size, bias, ops
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (N, vision_hidden)` in merge-block order -> `(N / merge**2, text_hidden)`."""
        x = self.layer_norm(x).reshape(-1, self.merged_hidden_size)  # (N / m^2, m^2 * hidden)
        return self.linear_2(self.act(self.linear_1(x)))


# Names the checkpoint files give to parameters the modules name otherwise (transformers'
# `conversion_mapping` for `lfm3_vl_vision`).
_CHECKPOINT_RENAMES = (
    (re.compile(r"(^|\.)vision_tower\.patchifier\."), r"\1vision_tower.patch_embed."),
    (re.compile(r"\.self_attn\.q_layernorm\."), ".self_attn.q_norm."),
    (re.compile(r"\.self_attn\.k_layernorm\."), ".self_attn.k_norm."),
)


class Lfm3VlVisionEncoder(VisionEncoder):
    """LFM3-VL's vision tower and projector: each image's `pixel_values` and `image_grid_thw`
    -> its `(h * w / merge**2, text_hidden)` rows, in the order of its image tokens."""

    def __init__(self, config: Any, ops: MambaOps, dtype: torch.dtype | None = None) -> None:
        """`config`: the top-level LFM3-VL config (`vision_config`, `text_config`, the
        projector's fields)."""
        super().__init__()
        self.vision_tower = Lfm3VlVisionModel(config.vision_config, ops)
        self.multi_modal_projector = Lfm3VlMultiModalProjector(config, ops)
        if dtype is not None:
            self.to(dtype)
        self.register_load_state_dict_pre_hook(self._rename_checkpoint_names)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint file's parameter name (less `model.`) -> this module's name for it."""
        for pattern, replacement in _CHECKPOINT_RENAMES:
            name = pattern.sub(replacement, name)
        return name

    @classmethod
    def _rename_checkpoint_names(
        cls, module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *args: Any
    ) -> None:
        """`load_state_dict` pre-hook: takes the checkpoint files' spellings too."""
        for key in list(state_dict):
            if key.startswith(prefix):
                renamed = prefix + cls.checkpoint_name(key[len(prefix) :])
                if renamed != key:
                    state_dict[renamed] = state_dict.pop(key)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the tower computes in."""
        return self.vision_tower.patch_embed.compute_dtype

    def encode(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `pixel_values (h * w, C * T * ps * ps)` and `image_grid_thw (3,)` (or
        `(1, 3)`) -> its `(h * w / merge**2, text_hidden)` rows.

        Raises:
            ValueError: pixel values whose shape does not match their grid or the tower.
        """
        if not images:
            return []
        tower = self.vision_tower
        device = tower.patch_embed.weight.device
        merge = tower.spatial_merge_size
        grids: list[tuple[int, int, int]] = []
        pixels = []
        for image in images:
            t, h, w = (int(v) for v in image["image_grid_thw"].reshape(-1).tolist())
            pv = image["pixel_values"]  # (t * h * w, C * T * ps * ps)
            if h % merge or w % merge or tuple(pv.shape) != (t * h * w, tower.patch_dim):
                raise ValueError(
                    f"LFM3-VL pixel_values {tuple(pv.shape)} do not fit grid {(t, h, w)} "
                    f"(patch dim {tower.patch_dim}, merge {merge})"
                )
            grids.append((t, h, w))
            pixels.append(pv.to(device=device, dtype=self.dtype))
        hidden = tower(torch.cat(pixels), grids)  # (sum t * h * w, vision_hidden)
        rows = self.multi_modal_projector(hidden)  # (sum t * h * w / m^2, text_hidden)
        return list(rows.split([t * h * w // merge**2 for t, h, w in grids]))
