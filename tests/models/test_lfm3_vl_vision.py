"""LFM3-VL's image processor and vision encoder (`vllm_mamba.models.vision.lfm3_vl`) against
transformers' `Lfm3VlProcessor` and `Lfm3VlForConditionalGeneration` on tiny configs.

- processor: the same `pixel_values` / `image_grid_thw` (exactly) and, spliced into the
  tokenised prompt in place of its one image token, the same `input_ids` as transformers'
  processor, for a small, a downscaled, a tall, a tiny and a grayscale image, with and without
  `mm_processor_kwargs`; refusals and unknown kwargs are ValueErrors.
- encoder: loaded from the transformers model's state dict (and from the files transformers
  writes, which spell three names otherwise), the same rows as `get_image_features` for one
  image and for two of different sizes in one call, within 1e-5 in float32.

Without torchvision transformers cannot make LFM3-VL's video processor, so the reference
processor is built with image processor and tokenizer only (`Lfm3VlProcessor.get_attributes`
patched for this module); its image path does not use the video processor.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import TOKENIZER_DIR
from vllm_mamba.models.vision.lfm3_vl import Lfm3VlImageProcessor, Lfm3VlVisionEncoder
from vllm_mamba.ops.dispatch import get_mamba_ops

transformers = pytest.importorskip("transformers")

SPECIAL = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8 * 4, 8 * 8 * 64  # 4 to 64 image tokens (factor 8)
PROMPT = "Describe <|vision_start|><|image_pad|><|vision_end|> in a few words."


def rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image of `width x height`."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


IMAGES = {
    "small": rgb(50, 34, 1),  # 6x4 patches after rounding: 6 tokens
    "downscaled": rgb(200, 150, 2),  # over max_pixels: shrunk to 64 tokens at most
    "tall": rgb(20, 90, 3),
    "tiny": rgb(3, 5, 4),  # under min_pixels: enlarged
    "gray": rgb(40, 40, 5).convert("L"),
}


@pytest.fixture(scope="module")
def tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tok


@pytest.fixture(scope="module")
def config(tokenizer):
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["conv", "full_attention"],  # the default for 2 layers has no attention
        conv_kernel_size=3,
    )
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = tokenizer.convert_tokens_to_ids(SPECIAL)
    return transformers.Lfm3VlConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids[0],
        video_token_id=ids[1],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
        projector_hidden_size=48,
    )


@pytest.fixture(scope="module")
def hf_processor(tokenizer):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            transformers.Lfm3VlProcessor,
            "get_attributes",
            classmethod(lambda cls: ["image_processor", "tokenizer"]),
        )
        yield transformers.Lfm3VlProcessor(image_processor=image_processor, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def model_dir(hf_processor):
    path = make_tmp_dir("lfm3-vl-processor-")
    hf_processor.save_pretrained(path)
    return path


def hf_inputs(processor, image: Image.Image, **kwargs) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # min_pixels / max_pixels at call time
        return processor(text=[PROMPT], images=[image], return_tensors="pt", **kwargs)


def spliced(tokenizer, token_ids: list[int], placeholder: int) -> list[int]:
    """The prompt's ids with its one placeholder replaced by `token_ids` (what the engine
    does)."""
    ids = tokenizer(PROMPT)["input_ids"]
    at = ids.index(placeholder)
    assert ids.count(placeholder) == 1
    return ids[:at] + token_ids + ids[at + 1 :]


def check_processor(ours: Lfm3VlImageProcessor, hf_processor, tokenizer, image, **kwargs) -> int:
    want = hf_inputs(hf_processor, image, **kwargs)
    got = ours.process(image)
    assert set(got.features) == {"pixel_values", "image_grid_thw"}
    assert got.features["pixel_values"].dtype == want["pixel_values"].dtype == torch.float32
    assert torch.equal(got.features["pixel_values"], want["pixel_values"])
    assert torch.equal(got.features["image_grid_thw"], want["image_grid_thw"][0])
    ids = spliced(tokenizer, got.token_ids, ours.placeholder_token_id)
    assert ids == want["input_ids"][0].tolist()
    assert got.embed_offsets == list(range(len(got.token_ids)))
    assert got.grid is None
    return len(got.token_ids)


@pytest.mark.parametrize("name", list(IMAGES))
def test_processor_as_transformers(name, hf_processor, tokenizer, config, model_dir) -> None:
    ours = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    assert ours.placeholder_token_id == config.image_token_id
    n = check_processor(ours, hf_processor, tokenizer, IMAGES[name])
    assert 4 <= n <= 64
    if name == "downscaled":
        assert n > 32  # close to the budget, not below it


def test_processor_hash(tokenizer, config, model_dir) -> None:
    ours = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    small = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config, max_pixels=1024)
    image = IMAGES["small"]
    assert ours.process(image).content_hash == ours.process(image.copy()).content_hash
    assert ours.process(image).content_hash != ours.process(IMAGES["tall"]).content_hash
    assert ours.process(image).content_hash != small.process(image).content_hash


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_pixels": 8 * 8 * 6},
        {"min_pixels": 8 * 8 * 20},
        {"min_pixels": 8 * 8 * 8, "max_pixels": 8 * 8 * 8},
        {"size": {"shortest_edge": 8 * 8 * 2, "longest_edge": 8 * 8 * 10}},
    ],
    ids=["max", "min", "both", "size"],
)
def test_mm_processor_kwargs(kwargs, hf_processor, tokenizer, config, model_dir) -> None:
    """The overrides change the token counts as they do at transformers' call."""
    default = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    ours = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config, **kwargs)
    hf_kwargs = {"images_kwargs": kwargs} if "size" in kwargs else kwargs
    counts = {}
    for name in ("downscaled", "tiny", "tall"):
        image = IMAGES[name]
        counts[name] = check_processor(ours, hf_processor, tokenizer, image, **hf_kwargs)
    before = {name: len(default.process(IMAGES[name]).token_ids) for name in counts}
    assert counts != before
    if "max_pixels" in kwargs:
        assert counts["downscaled"] < before["downscaled"]
    if "min_pixels" in kwargs:
        assert counts["tiny"] > before["tiny"]


def test_bad_kwargs_and_images(tokenizer, config, model_dir) -> None:
    with pytest.raises(ValueError, match="max_image_tokens"):
        Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config, max_image_tokens=64)
    with pytest.raises(ValueError, match="size"):
        Lfm3VlImageProcessor.from_pretrained(
            model_dir, tokenizer, config, size={"longest_edge": 1024}
        )
    with pytest.raises(ValueError, match="exceeds"):
        Lfm3VlImageProcessor.from_pretrained(
            model_dir, tokenizer, config, min_pixels=4096, max_pixels=1024
        )
    with pytest.raises(ValueError, match="max_pixels"):
        Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config, max_pixels=0)
    bad_config = config.to_dict()
    bad_config["vision_config"]["patch_size"] = 8
    with pytest.raises(ValueError, match="patch_size"):
        Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, bad_config)
    ours = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    with pytest.raises(ValueError, match="200"):
        ours.process(rgb(1, 300))
    with pytest.raises(ValueError, match="PIL"):
        ours.process(np.zeros((8, 8, 3), dtype=np.uint8))


# --- encoder ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(config):
    torch.manual_seed(0)
    model = transformers.Lfm3VlForConditionalGeneration(config).eval()
    # transformers' init (std 0.02, unit norms) leaves the layers' contributions tiny next to
    # the residual: larger random weights and norms away from 1 make every part count.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return model


def vision_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefixes = ("model.vision_tower.", "model.multi_modal_projector.")
    return {k[len("model.") :]: v for k, v in state.items() if k.startswith(prefixes)}


@pytest.fixture(scope="module")
def encoder(config, hf_model):
    enc = Lfm3VlVisionEncoder(config, get_mamba_ops("cpu"))
    enc.load_state_dict(vision_state(hf_model.state_dict()), strict=True)
    return enc.eval()


def hf_rows(hf_model, features: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    pixel_values = torch.cat([f["pixel_values"] for f in features])
    grid = torch.stack([f["image_grid_thw"] for f in features])
    out = hf_model.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid)
    return list(out.pooler_output)


@pytest.mark.parametrize("names", [["small"], ["tall", "downscaled"]], ids=["one", "two"])
def test_encoder_as_transformers(names, encoder, hf_model, tokenizer, config, model_dir) -> None:
    processor = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    processed = [processor.process(IMAGES[n]) for n in names]
    features = [p.features for p in processed]
    with torch.inference_mode():
        want = hf_rows(hf_model, features)
        got = encoder.encode(features)
        alone = [hf_rows(hf_model, [f])[0] for f in features]
    assert len(got) == len(names)
    for g, w, a, p in zip(got, want, alone, processed):
        assert g.shape == (len(p.embed_offsets), config.text_config.hidden_size)
        assert w.abs().max() > 0.1
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        torch.testing.assert_close(g, a, rtol=0, atol=1e-5)  # images do not see each other


def test_encoder_loads_checkpoint_files(config, hf_model, encoder) -> None:
    """The saved files' names (`patchifier`, `q_layernorm`, `k_layernorm`) load too."""
    path = make_tmp_dir("lfm3-vl-model-")
    hf_model.save_pretrained(path)
    state = vision_state(load_file(os.path.join(path, "model.safetensors")))
    assert any(".patchifier." in k for k in state) and any("q_layernorm" in k for k in state)
    fresh = Lfm3VlVisionEncoder(config, get_mamba_ops("cpu"))
    fresh.load_state_dict(state, strict=True)
    for (name, p), (_, q) in zip(fresh.state_dict().items(), encoder.state_dict().items()):
        assert torch.equal(p, q), name


def test_encoder_bfloat16(config, hf_model, encoder, tokenizer, model_dir) -> None:
    processor = Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, config)
    features = [processor.process(IMAGES["small"]).features]
    enc = Lfm3VlVisionEncoder(config, get_mamba_ops("cpu"), dtype=torch.bfloat16)
    enc.load_state_dict(vision_state(hf_model.state_dict()))
    with torch.inference_mode():
        got = enc.encode(features)[0]
        want = encoder.encode(features)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
