"""Image input on the CPU: the vision encoder's time per image and the time to first token of
a one-image request, engine against transformers on the same weights and pixels.

    python benchmarks/image_bench.py encoder [--model qwen3.5|lfm2-vl] [--dtype float32|bfloat16]
                                             [--repeats 5]
    python benchmarks/image_bench.py ttft [--dtype ...] [--repeats 3]

`encoder`: Qwen3.5-0.8B's vision tower at its real shape (12 blocks of width 768, 12 heads,
MLP 3072, 16-pixel patches, 2 x 2 merging to the language model's 1024), random weights, on a
448 x 448 and a 1024 x 768 image preprocessed with the release's settings (784 and 3072
patches; 196 and 768 LLM tokens): the engine's `Qwen3VisionEncoder` (its linear op) against
transformers' `Qwen3_5VisionModel` (sdpa), the same weights and patches, interleaved, medians.

`encoder --model lfm2-vl`: LFM2-VL-450M's vision side at its real shape (its config.json):
SigLIP2-base NaFlex (12 layers of width 768, 12 heads, MLP 3072, `gelu_pytorch_tanh`, 16-pixel
patches, a 16 x 16 position grid) and the projector (2 x 2 pixel unshuffle to 3072, LayerNorm,
3072 -> 2560 -> 1024, GELU), random weights, on the same two images preprocessed by the
engine's `Lfm2VlImageProcessor` with the release's processor settings (tiles of 512, 64 to 256
LLM tokens per crop, splitting into 2 to 10 tiles, no thumbnail; the GPT-NeoX tokenizer plus
the image marker tokens): 448 x 448 is one crop of 28 x 28 patches (784, padded to 1024; 196
LLM tokens), 1024 x 768 is 3 x 2 tiles of 32 x 32 patches (6144; 1536 LLM tokens). The
engine's `Lfm2VlVisionEncoder` (its linear op; loaded from the transformers model's
`vision_tower.` and `multi_modal_projector.` weights) against transformers'
`Lfm2VlModel.get_image_features` (sdpa; its language model, which that never runs, cut to 2
layers) on the same `pixel_values`, `spatial_shapes` and `pixel_attention_mask`, all crops'
rows concatenated, interleaved, medians.

`ttft`: a Qwen3.5-0.8B-shaped image-text checkpoint (the text model of
`hybrid_configs.QWEN3_5_CONFIG`, the vision tower above, random weights, saved once under
`--dir`), a 448 x 448 image with a short question, one output token: `LLM.generate` (engine
started once, the encoder cache cleared by using a new image each repetition) against
transformers' `generate(max_new_tokens=1)` (processor, encoder and prefill), medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VISION_0_8B = dict(
    depth=12,
    hidden_size=768,
    num_heads=12,
    intermediate_size=3072,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    out_hidden_size=1024,
    hidden_act="gelu_pytorch_tanh",
)
# Qwen3.5's preprocessor_config.json (min / max pixels, 16-pixel patches, merge 2)
RELEASE_PROCESSOR = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
SIZES = [(448, 448), (1024, 768)]

# LFM2-VL-450M's config.json: the vision tower, the projector, the language model's width
LFM2_VL_450M = dict(
    vision_config=dict(
        model_type="siglip2_vision_model",
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_patches=256,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
        vision_use_head=False,
    ),
    projector_hidden_size=2560,
    projector_hidden_act="gelu",
    projector_bias=True,
    downsample_factor=2,
)
# the language model: LFM2-350M's width; two small layers (the image features never run it)
LFM2_VL_TEXT = dict(
    model_type="lfm2",
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=64,
    layer_types=["conv", "full_attention"],
)
# LFM2-VL-450M's processor_config.json (and transformers' defaults for what it leaves out)
LFM2_VL_PROCESSOR = {
    "do_image_splitting": True,
    "min_tiles": 2,
    "max_tiles": 10,
    "use_thumbnail": False,
    "tile_size": 512,
    "min_image_tokens": 64,
    "max_image_tokens": 256,
    "max_pixels_tolerance": 2.0,
    "encoder_patch_size": 16,
    "downsample_factor": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 2,
}
LFM2_VL_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)
]


def _image(width: int, height: int, seed: int):  # noqa: ANN202 - a PIL image
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _timed_ms(fn, *args: object, **kwargs: object) -> float:  # noqa: ANN001
    """Milliseconds of one call."""
    start = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - start) * 1e3


def encoder(args: argparse.Namespace) -> None:
    """The vision tower alone (see the module docstring)."""
    if args.model == "lfm2-vl":
        return _encoder_lfm2_vl(args)
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from vllm_mamba.models.vision.qwen3_vl import Qwen3VisionEncoder, QwenImageProcessor
    from vllm_mamba.ops.dispatch import get_mamba_ops

    dtype = getattr(torch, args.dtype)
    config = Qwen3_5Config(vision_config=VISION_0_8B).vision_config
    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(config).eval().to(dtype)
    engine = Qwen3VisionEncoder(config, get_mamba_ops("cpu")).eval()
    engine.load_state_dict(ref.state_dict())
    engine.to(dtype)
    proc = QwenImageProcessor(RELEASE_PROCESSOR, 0)
    print(f"threads {torch.get_num_threads()}, dtype {args.dtype}, repeats {args.repeats}")
    print("| image | patches | LLM tokens | engine ms | transformers ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for width, height in SIZES:
        feats = proc.process(_image(width, height, 0)).features
        pixels = feats["pixel_values"].to(dtype)
        grid = feats["image_grid_thw"][None]
        with torch.inference_mode():
            got = torch.cat(engine.encode([{**feats, "pixel_values": pixels}]))
            want = ref(pixels, grid_thw=grid).pooler_output
            err = (got.float() - want.float()).abs().max().item()
            inputs = [{**feats, "pixel_values": pixels}]
            mine, theirs = [], []
            for _ in range(args.repeats):  # interleaved
                mine.append(_timed_ms(engine.encode, inputs))
                theirs.append(_timed_ms(ref, pixels, grid_thw=grid))
        m, t = statistics.median(mine), statistics.median(theirs)
        print(
            f"| {width}x{height} | {pixels.shape[0]} | {got.shape[0]} | {m:.0f} | {t:.0f} | "
            f"{t / m:.2f}x |  (max abs diff {err:.1e})"
        )


def _lfm2_vl_tokenizer():  # noqa: ANN202 - a transformers tokenizer
    """The GPT-NeoX tokenizer with LFM2-VL's image marker tokens added."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.helpers.image_checkpoints import add_special_tokens
    from tests.tiny_models import copy_tokenizer

    path = tempfile.mkdtemp(prefix="lfm2-vl-tokenizer-")
    try:
        copy_tokenizer(path)
        add_special_tokens(
            path, LFM2_VL_TOKENS, "{% for m in messages %}{{ m.content }}{% endfor %}"
        )
        return AutoTokenizer.from_pretrained(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _encoder_lfm2_vl(args: argparse.Namespace) -> None:
    """LFM2-VL-450M's vision tower and projector (see the module docstring)."""
    import transformers

    from vllm_mamba.models.vision.lfm2_vl import Lfm2VlImageProcessor, Lfm2VlVisionEncoder
    from vllm_mamba.ops.dispatch import get_mamba_ops

    dtype = getattr(torch, args.dtype)
    tokenizer = _lfm2_vl_tokenizer()
    config = transformers.Lfm2VlConfig(
        **LFM2_VL_450M,
        text_config=LFM2_VL_TEXT,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    ref = transformers.Lfm2VlModel(config).eval().to(dtype)
    engine = Lfm2VlVisionEncoder(config, get_mamba_ops("cpu"), dtype=dtype).eval()
    engine.load_state_dict(
        {
            name: t
            for name, t in ref.state_dict().items()
            if name.startswith(("vision_tower.", "multi_modal_projector."))
        }
    )
    proc = Lfm2VlImageProcessor.from_config(LFM2_VL_PROCESSOR, tokenizer, config)
    print(f"threads {torch.get_num_threads()}, dtype {args.dtype}, repeats {args.repeats}")
    print("| image | tiles | patches | LLM tokens | engine ms | transformers ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for width, height in SIZES:
        feats = proc.process(_image(width, height, 0)).features
        feats = {**feats, "pixel_values": feats["pixel_values"].to(dtype)}
        shapes = feats["spatial_shapes"]
        inputs = [feats]
        with torch.inference_mode():
            got = torch.cat(engine.encode(inputs))
            want = torch.cat(ref.get_image_features(**feats).pooler_output)
            err = (got.float() - want.float()).abs().max().item()
            mine, theirs = [], []
            for _ in range(args.repeats):  # interleaved
                mine.append(_timed_ms(engine.encode, inputs))
                theirs.append(_timed_ms(ref.get_image_features, **feats))
        m, t = statistics.median(mine), statistics.median(theirs)
        patches = int(shapes.prod(-1).sum())
        print(
            f"| {width}x{height} | {shapes.shape[0]} | {patches} | {got.shape[0]} | {m:.0f} | "
            f"{t:.0f} | {t / m:.2f}x |  (max abs diff {err:.1e})"
        )


def _checkpoint(path: str, dtype: torch.dtype) -> str:
    """The Qwen3.5-0.8B-shaped image-text checkpoint, written once."""
    import json

    import transformers
    from hybrid_configs import QWEN3_5_CONFIG

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    config = transformers.Qwen3_5Config(
        text_config=dict(QWEN3_5_CONFIG), vision_config=VISION_0_8B, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(dtype)
    model.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(RELEASE_PROCESSOR, f)
    from tests.tiny_models import copy_tokenizer  # the GPT-NeoX tokenizer files

    copy_tokenizer(path)
    return path


def ttft(args: argparse.Namespace) -> None:
    """Time to first token of a one-image request (see the module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from vllm_mamba import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    path = _checkpoint(args.dir, dtype)
    config = transformers.AutoConfig.from_pretrained(path)
    pad = config.image_token_id
    question = list(range(1000, 1020))  # 20 text tokens
    prompt_ids = question[:10] + [pad] + question[10:]
    llm = LLM(path, dtype=args.dtype, max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=1)
    engine_ms = []
    for i in range(args.repeats):
        image = _image(448, 448, 100 + i)  # a new image: the encoder runs every time
        start = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": image}}],
            params,
            use_tqdm=False,
        )
        engine_ms.append((time.perf_counter() - start) * 1e3)
    del llm
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    proc = Qwen2VLImageProcessorPil(**RELEASE_PROCESSOR)
    hf_ms = []
    for i in range(args.repeats):
        image = _image(448, 448, 100 + i)
        start = time.perf_counter()
        feats = proc.preprocess([image], return_tensors="pt")
        n = int(feats["image_grid_thw"].prod()) // 4
        ids = torch.tensor([question[:10] + [pad] * n + question[10:]])
        with torch.inference_mode():
            hf.generate(
                ids,
                pixel_values=feats["pixel_values"].to(dtype),
                image_grid_thw=feats["image_grid_thw"],
                mm_token_type_ids=(ids == pad).int(),
                max_new_tokens=1,
                do_sample=False,
            )
        hf_ms.append((time.perf_counter() - start) * 1e3)
    m, t = statistics.median(engine_ms), statistics.median(hf_ms)
    print(f"threads {torch.get_num_threads()}, dtype {args.dtype}, repeats {args.repeats}")
    print("| request | engine ms | transformers ms | speed-up |")
    print("|---|---|---|---|")
    print(f"| 448x448 image + 20 text tokens, 1 output token | {m:.0f} | {t:.0f} | {t / m:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["encoder", "ttft"])
    parser.add_argument(
        "--model", default="qwen3.5", choices=["qwen3.5", "lfm2-vl"], help="encoder only"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/qwen3_5-0.8b-vl-random")
    args = parser.parse_args()
    if args.what == "ttft" and args.model != "qwen3.5":
        parser.error("ttft runs Qwen3.5 only")
    encoder(args) if args.what == "encoder" else ttft(args)


if __name__ == "__main__":
    main()
