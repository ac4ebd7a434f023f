"""Tiny image-text checkpoints for the image-input tests: transformers' own classes built
from configs with a small vision tower, saved with the GPT-NeoX tokenizer plus the model's
image special tokens, a chat template that places images, and the processor's settings.

`qwen3_5_image_text(moe)` holds a `Qwen3_5ForConditionalGeneration` (or the MoE one) whose
language model is the registry's `qwen3_5-gqa` shape (`qwen3_5-moe-top2` for the MoE) and whose
vision tower has 8-pixel patches, 2 x 2 merging and 2 frames per patch (the releases' layout
at a tiny width), weights drawn large enough that an image changes the output.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from tests.helpers.tmp_dirs import make_tmp_dir, session_cache
from tests.tiny_models import MODEL_FAMILY, copy_tokenizer

VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)
# Small images: at most 16 x 16 patches (8 x 8 LLM tokens) each.
PROCESSOR = {
    "min_pixels": 16 * 16,
    "max_pixels": 128 * 128,
    "patch_size": 8,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_processor_type": "Qwen2VLImageProcessor",
}
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# Qwen3.5's way of placing an image part (a trimmed copy of its chat template).
QWEN_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{%- else %}"
    "{%- for part in m.content %}{%- if part.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{%- else %}{{ part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def add_special_tokens(path: str, tokens: list[str], template: str) -> dict[str, int]:
    """Adds `tokens` to the tokenizer saved in `path` (and its chat template); their ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    tok.save_pretrained(path)
    return {t: tok.convert_tokens_to_ids(t) for t in tokens}


@session_cache
def qwen3_5_image_text(moe: bool = False) -> str:
    """The directory of a tiny Qwen3.5 (or Qwen3.5-MoE) image-text checkpoint."""
    import transformers

    path = make_tmp_dir("tiny-qwen3_5-vl-")
    copy_tokenizer(path)
    ids = add_special_tokens(path, QWEN_TOKENS, QWEN_TEMPLATE)
    name = "qwen3_5-moe-top2" if moe else "qwen3_5-gqa"
    text = dict(MODEL_FAMILY[name].configs[name], bos_token_id=0, eos_token_id=0, pad_token_id=1)
    cls = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{cls}Config")(
        text_config=text,
        vision_config=VISION,
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=0,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForConditionalGeneration")(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and pname.endswith("weight") and "visual" in pname:
                continue
            if pname.endswith(("A_log", "dt_bias")):
                continue
            std = 0.2 if "visual" in pname else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    return path


def random_image(height: int, width: int, seed: int):  # noqa: ANN201 - a PIL image
    """A reproducible RGB image of random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
