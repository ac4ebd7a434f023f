"""Images through `LLM` on LFM3-VL image-text checkpoints (`Lfm3VlForConditionalGeneration`),
against transformers.

A tiny `Lfm3VlForConditionalGeneration` saved by transformers (`save_pretrained`: the files'
own names, `model.language_model.*`, `self_attn.gate_proj`, `vision_tower.patchifier`,
`q_layernorm` ...) with its processor's files and the GPT-NeoX tokenizer plus the image special
tokens and a chat template that places images: the engine's greedy tokens and logprobs must
equal transformers' `generate` on the engine's expanded prompt (which must be transformers'
processor's `input_ids`) with transformers' processor's pixels, for one image and for two of
different sizes, tied and untied heads; a different image changes the output; `LLM.chat` with
`image_pil` parts equals the generate path; `language_model_only` refuses images and skips the
vision tensors.

Without torchvision transformers cannot make LFM3-VL's video processor, so the reference
processor is built with image processor and tokenizer only (as `test_lfm3_vl_vision`).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.image_checkpoints import QWEN_TEMPLATE, add_special_tokens, random_image
from tests.helpers.image_checks import (
    check_chat_equals_generate,
    check_language_model_only,
    check_the_image_changes_the_output,
)
from tests.helpers.runners import VllmRunner
from tests.helpers.tiny_configs import LFM3
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import copy_tokenizer
from vllm_mamba import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("image-input")

MAX_TOKENS = 16
SPECIAL = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8 * 4, 8 * 8 * 48  # 4 to 48 image tokens (factor 8)
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=TEMPORAL,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    layer_types=["conv", "full_attention"],
    conv_kernel_size=3,
)


@pytest.fixture(scope="module", autouse=True)
def _no_video_processor():  # noqa: ANN202 - a fixture
    """`Lfm3VlProcessor` with image processor and tokenizer only, for this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            transformers.Lfm3VlProcessor,
            "get_attributes",
            classmethod(lambda cls: ["image_processor", "tokenizer"]),
        )
        yield


def _hf_processor(tokenizer):  # noqa: ANN001, ANN202 - transformers objects
    """transformers' `Lfm3VlProcessor` without its video processor (no torchvision)."""
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
    return transformers.Lfm3VlProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _checkpoint(tied: bool) -> str:
    """A tiny LFM3-VL checkpoint (LFM3's `lfm3-gqa` language model: conv, sliding and full
    attention layers, gate and sandwich norms), its processor and tokenizer."""
    path = make_tmp_dir("tiny-lfm3-vl-")
    copy_tokenizer(path)
    ids = add_special_tokens(path, SPECIAL, QWEN_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = {k: v for k, v in LFM3["lfm3-gqa"].items() if k != "tie_word_embeddings"}
    text.update(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0, pad_token_id=1)
    config = transformers.Lfm3VlConfig(
        vision_config=VISION,
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        projector_hidden_size=48,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.Lfm3VlForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            vision = name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise if vision else p)
            else:
                p.copy_((0.2 if vision else 0.3) * noise)
    model.save_pretrained(path)
    _hf_processor(tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def checkpoint(request) -> str:  # noqa: ANN001 - pytest's request
    return _checkpoint(request.param)


@pytest.fixture(scope="module")
def hf(checkpoint):  # noqa: ANN001, ANN201 - transformers objects
    """transformers' model and processor on `checkpoint`."""
    model = transformers.Lfm3VlForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return model, _hf_processor(tokenizer)


@pytest.fixture(scope="module")
def runner(checkpoint):  # noqa: ANN001, ANN201 - the engine
    with VllmRunner(checkpoint, max_model_len=512) as r:
        yield r


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)


@torch.no_grad()
def _hf_greedy(hf, text: str, images: list) -> tuple[list[int], list[int], list]:  # noqa: ANN001
    """transformers' processor's `input_ids` for `text` and `images`, and `generate`'s greedy
    tokens and per-step log-softmax on them."""
    model, processor = hf
    inputs = processor(text=[text], images=images, return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    ids = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(ids) :].tolist()
    return ids, tokens, [step[0].float().log_softmax(-1) for step in out.logits]


CASES = {
    "one": (f"Describe {IMAGE} briefly.", [(50, 70, 0)]),
    "two": (f"{IMAGE} versus {IMAGE}: which is brighter?", [(50, 70, 0), (130, 40, 1)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_images_match_transformers(case: str, runner, hf) -> None:  # noqa: ANN001
    text, shapes = CASES[case]
    images = [random_image(*shape) for shape in shapes]
    tok = runner.llm.get_tokenizer()
    ids = tok.encode(text)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == len(images)
    out = runner.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], _greedy()
    )[0]
    want_ids, want, logprobs = _hf_greedy(hf, text, images)
    assert out.prompt_token_ids == want_ids  # the processor's expansion
    assert out.prompt_token_ids.count(pad) > len(images)
    comp = out.outputs[0]
    assert comp.token_ids == want
    assert len(comp.logprobs) == MAX_TOKENS
    for step, lp in enumerate(comp.logprobs):
        assert len(lp) >= 2
        for t, value in lp.items():
            assert abs(value.logprob - float(logprobs[step][t])) <= 1e-4


def test_the_image_changes_the_output(runner) -> None:  # noqa: ANN001
    images = (random_image(50, 70, 0), random_image(50, 70, 5))
    check_the_image_changes_the_output(runner, CASES["one"][0], images, _greedy())


def test_chat_equals_generate(runner) -> None:  # noqa: ANN001
    images = (random_image(50, 70, 0), random_image(130, 40, 1))
    check_chat_equals_generate(runner, IMAGE, images, _greedy())


def test_language_model_only(checkpoint, runner, caplog) -> None:  # noqa: ANN001
    check_language_model_only(
        checkpoint, runner, IMAGE, random_image(20, 20, 0), _greedy(),
        ["model.vision_tower.", "model.multi_modal_projector."], caplog,
    )  # fmt: skip
