"""LFM2-VL's image processor and vision encoder (`vllm_mamba.models.vision.lfm2_vl`) against
transformers 5.24's `Lfm2VlProcessor` and `Lfm2VlForConditionalGeneration` on tiny configs.

- processor: the same `pixel_values`, `spatial_shapes` and `pixel_attention_mask` (exactly), and
  the tokenised prompt with the one `<image>` replaced by `token_ids` equal to transformers'
  `input_ids`, for a small, a tiled (2 x 2 and 1 x 4), an exactly-sized, a tiny, a grayscale
  and a transparent image, under several `mm_processor_kwargs`; the tiled / untiled token
  counts; refusals and unknown kwargs are ValueErrors.
- encoder: loaded from the transformers model's state dict (and from the older
  `vision_tower.vision_model.` names with a pooling head), the same rows as
  `get_image_features` for one image and for two of different sizes and paddings in one call,
  within 1e-5 in float32; bfloat16 close.

transformers' LFM2-VL image processor exists only as a torchvision backend, and the venv has no
torchvision (PyPI's wheel is a CUDA build that does not import with the CPU torch). The
reference therefore runs in a child process (`tests.helpers.lfm2_vl_reference`): with
torchvision when it imports there, else with a stand-in package holding torchvision 0.28's
tensor `resize` and `normalize` (the two functions the LFM2-VL path calls), so everything else
(smart resize, tiling, thumbnails, patchification, padding, the token expansion) is
transformers' own code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.lfm2_vl_reference import run_reference
from tests.tiny_models import TOKENIZER_DIR
from vllm_mamba.models.vision.lfm2_vl import Lfm2VlImageProcessor, Lfm2VlVisionEncoder
from vllm_mamba.ops.dispatch import get_mamba_ops

transformers = pytest.importorskip("transformers")

# 16 to 64 LLM tokens per crop (patch 16, factor 2), tiles of 256 pixels (64 tokens), 2-4 tiles
SETTINGS = {
    "min_image_tokens": 16,
    "max_image_tokens": 64,
    "tile_size": 256,
    "min_tiles": 2,
    "max_tiles": 4,
    "use_thumbnail": True,
    "do_image_splitting": True,
    "encoder_patch_size": 16,
    "downsample_factor": 2,
    "do_convert_rgb": True,
}
MARKERS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)
]
PROMPT = "Describe <image> in a few words."


def rgb(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB image of `width x height` (noise: every resize rounding shows)."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def rgba(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGBA")


IMAGES = {
    "small": rgb(64, 48, 1),  # enlarged to 160 x 128: 20 tokens
    "tiled": rgb(640, 480, 2),  # 2 x 2 tiles of 256 and a 288 x 192 thumbnail
    "tall": rgb(200, 800, 3),  # 1 x 4 tiles (one column) and a thumbnail
    "exact": rgb(160, 128, 4),  # already a valid size: not resized
    "tiny": rgb(7, 5, 5),
    "wide": rgb(200, 90, 6),
    "gray": rgb(90, 70, 7).convert("L"),
    "alpha": rgba(80, 60, 8),
}
# mm_processor_kwargs, as transformers' per-call processor kwargs
VARIANTS = {
    "default": {},
    "unsplit": {"do_image_splitting": False},
    "fewer_tokens": {"min_image_tokens": 8, "max_image_tokens": 32},
    "plain": {"use_thumbnail": False, "use_image_special_tokens": False},
    "unsplit_small": {"do_image_splitting": False, "max_image_tokens": 32, "max_tiles": 3},
}


@pytest.fixture(scope="module")
def reference() -> dict:
    """transformers' outputs for every (variant, image), its backend and its saved files."""
    calls = {
        (variant, name): (PROMPT, [name], kwargs)
        for variant, kwargs in VARIANTS.items()
        for name in IMAGES
    }
    return run_reference(TOKENIZER_DIR, SETTINGS, calls, IMAGES, markers=MARKERS)


@pytest.fixture(scope="module")
def tokenizer(reference: dict):
    return transformers.AutoTokenizer.from_pretrained(reference["model_dir"])


def make_config(tokenizer, **overrides) -> transformers.Lfm2VlConfig:  # noqa: ANN001
    kwargs = {
        "vision_config": {
            "model_type": "siglip2_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 16,
            "num_patches": 16,
            "vision_use_head": False,
        },
        "text_config": {
            "model_type": "lfm2",
            "hidden_size": 24,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 64,  # the image features never read the text embeddings
            "layer_types": ["conv", "full_attention"],
        },
        "projector_hidden_size": 40,
        "downsample_factor": 2,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
    }
    kwargs.update(overrides)
    return transformers.Lfm2VlConfig(**kwargs)


@pytest.fixture(scope="module")
def config(tokenizer) -> transformers.Lfm2VlConfig:  # noqa: ANN001
    return make_config(tokenizer)


def splice(tokenizer, token_ids: list[int]) -> list[int]:  # noqa: ANN001
    """The prompt tokenised as the engine tokenises it, its one `<image>` replaced."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == 1
    at = ids.index(image_id)
    return ids[:at] + token_ids + ids[at + 1 :]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_processor_as_transformers(variant, reference, tokenizer, config) -> None:  # noqa: ANN001
    processor = Lfm2VlImageProcessor.from_pretrained(
        reference["model_dir"], tokenizer, config, **VARIANTS[variant]
    )
    assert processor.placeholder_token_id == config.image_token_id
    for name, image in IMAGES.items():
        expected = reference[variant, name]
        out = processor.process(image)
        for key in ("pixel_values", "spatial_shapes", "pixel_attention_mask"):
            got, want = out.features[key], expected[key]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, key)
            assert torch.equal(got, want), (variant, name, key, reference["backend"])
        assert splice(tokenizer, out.token_ids) == expected["input_ids"], (variant, name)
        image_id = config.image_token_id
        assert out.embed_offsets == [i for i, t in enumerate(out.token_ids) if t == image_id]
        shapes = out.features["spatial_shapes"]
        assert len(out.embed_offsets) == int((shapes // 2).prod(-1).sum())
        assert out.grid is None and len(out.content_hash) == 64


def test_tiling_and_token_counts(reference, tokenizer, config) -> None:  # noqa: ANN001
    model_dir = reference["model_dir"]
    tiled = Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    out = tiled.process(IMAGES["tiled"])
    assert out.features["spatial_shapes"].tolist() == [[16, 16]] * 4 + [[12, 18]]
    assert len(out.embed_offsets) == 4 * 64 + 6 * 9
    markers = tokenizer.convert_ids_to_tokens(out.token_ids)
    assert [m for m in markers if m != "<image>"] == [
        "<|image_start|>",
        "<|img_row_1_col_1|>",
        "<|img_row_1_col_2|>",
        "<|img_row_2_col_1|>",
        "<|img_row_2_col_2|>",
        "<|img_thumbnail|>",
        "<|image_end|>",
    ]
    tall = tiled.process(IMAGES["tall"])
    assert tall.extra == {"rows": 4, "cols": 1}
    unsplit = Lfm2VlImageProcessor.from_pretrained(
        model_dir, tokenizer, config, do_image_splitting=False
    )
    one = unsplit.process(IMAGES["tiled"])
    assert one.features["spatial_shapes"].tolist() == [[12, 18]]
    assert len(one.embed_offsets) == 54 and len(one.token_ids) == 56
    fewer = Lfm2VlImageProcessor.from_pretrained(
        model_dir, tokenizer, config, do_image_splitting=False, max_image_tokens=32
    )
    small = fewer.process(IMAGES["tiled"])
    assert small.features["pixel_values"].shape[1] == 128  # padded to 32 * 4 patches
    assert len(small.embed_offsets) <= 32
    # the settings are part of the image's identity; the pixels too
    assert small.content_hash != one.content_hash
    assert unsplit.process(IMAGES["tiled"]).content_hash == one.content_hash
    assert one.content_hash != unsplit.process(IMAGES["wide"]).content_hash


def test_refusals(reference, tokenizer, config) -> None:  # noqa: ANN001
    model_dir = reference["model_dir"]
    with pytest.raises(ValueError, match="min_pixels"):
        Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config, min_pixels=1024)
    with pytest.raises(ValueError, match="encoder_patch_size"):
        Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config, encoder_patch_size=8)
    for bad in ({"max_image_tokens": 0}, {"min_tiles": "2"}, {"use_thumbnail": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config, **bad)
    with pytest.raises(ValueError, match="min_tiles"):
        Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config, min_tiles=5)
    with pytest.raises(ValueError, match="tile_size"):
        Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config, tile_size=200)
    with pytest.raises(ValueError, match="image_token_id"):
        Lfm2VlImageProcessor.from_pretrained(
            model_dir, tokenizer, make_config(tokenizer, image_token_id=7)
        )
    processor = Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    with pytest.raises(ValueError, match="patches"):
        processor.process(rgb(5000, 1, 9))  # one crop of 2 x 1132 patches
    with pytest.raises(ValueError, match="PIL"):
        processor.process(np.zeros((32, 32, 3), dtype=np.uint8))
    one_tile = Lfm2VlImageProcessor.from_pretrained(
        model_dir, tokenizer, config, min_tiles=1, max_tiles=3
    )
    with pytest.raises(ValueError, match="1x1"):
        one_tile.process(rgb(1100, 1000, 10))


# ----- the encoder --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(config):  # noqa: ANN001, ANN201
    torch.manual_seed(0)
    return transformers.Lfm2VlForConditionalGeneration(config).float().eval()


def vision_state(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {
        name[len("model.") :]: t
        for name, t in model.state_dict().items()
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
    }


def make_encoder(config, model, dtype=None) -> Lfm2VlVisionEncoder:  # noqa: ANN001
    encoder = Lfm2VlVisionEncoder(config, get_mamba_ops("cpu"), dtype=dtype)
    encoder.load_state_dict(vision_state(model))
    return encoder.eval()


def hf_rows(model, features: dict[str, torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
    out = model.model.get_image_features(**features)
    return torch.cat(out.pooler_output)  # one entry per crop


def features(reference, tokenizer, config, image: str, **kwargs) -> dict:  # noqa: ANN001
    processor = Lfm2VlImageProcessor.from_pretrained(
        reference["model_dir"], tokenizer, config, **kwargs
    )
    return processor.process(IMAGES[image]).features


def test_encoder_as_transformers(reference, tokenizer, config, hf_model) -> None:  # noqa: ANN001
    encoder = make_encoder(config, hf_model)
    tiled = features(reference, tokenizer, config, "tiled")  # 5 crops, 256 patches
    small = features(reference, tokenizer, config, "small")  # 1 crop of 80 patches
    narrow = features(  # 1 crop, padded to 128 patches only
        reference, tokenizer, config, "tall", do_image_splitting=False, max_image_tokens=32
    )
    with torch.inference_mode():
        want = [hf_rows(hf_model, f) for f in (tiled, small, narrow)]
        one = encoder.encode([tiled])
        many = encoder.encode([small, tiled, narrow])
    assert len(one) == 1 and one[0].shape == (310, 24)
    torch.testing.assert_close(one[0], want[0], atol=1e-5, rtol=1e-5)
    assert [m.shape[0] for m in many] == [20, 310, want[2].shape[0]]
    for got, expected in zip(many, [want[1], want[0], want[2]]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert encoder.encode([]) == []


def test_encoder_variants_and_checkpoint_names(reference, tokenizer) -> None:  # noqa: ANN001
    """No projector LayerNorm or biases, exact GELU in the tower; the older names load."""
    config = make_config(
        tokenizer,
        projector_use_layernorm=False,
        projector_bias=False,
        vision_config={
            "model_type": "siglip2_vision_model",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "patch_size": 16,
            "num_patches": 25,
            "hidden_act": "gelu",
            "vision_use_head": True,
        },
    )
    torch.manual_seed(1)
    model = transformers.Lfm2VlForConditionalGeneration(config).float().eval()
    state = vision_state(model)
    assert any(name.startswith("vision_tower.head.") for name in state)
    older = "vision_tower.vision_model."
    old = {name.replace("vision_tower.", older, 1): t for name, t in state.items()}
    encoder = Lfm2VlVisionEncoder(config, get_mamba_ops("cpu"))
    encoder.load_state_dict(old)  # strict: renamed, the head dropped
    assert encoder.checkpoint_name("vision_tower.vision_model.head.probe") is None
    assert encoder.checkpoint_name("multi_modal_projector.linear_1.weight") == (
        "multi_modal_projector.linear_1.weight"
    )
    feats = features(reference, tokenizer, config, "wide")
    with torch.inference_mode():
        want = hf_rows(model, feats)
        (got,) = encoder.eval().encode([feats])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_encoder_bfloat16(reference, tokenizer, config, hf_model) -> None:  # noqa: ANN001
    encoder = make_encoder(config, hf_model, dtype=torch.bfloat16)
    assert encoder.vision_tower.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    feats = features(reference, tokenizer, config, "small")
    with torch.inference_mode():
        want = hf_rows(hf_model, feats)
        (got,) = encoder.encode([feats])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.1)
