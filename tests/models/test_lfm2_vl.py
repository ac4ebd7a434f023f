"""Images through `LLM` on LFM2-VL image-text checkpoints (`Lfm2VlForConditionalGeneration`),
against transformers.

A tiny `Lfm2VlForConditionalGeneration` saved by transformers (`save_pretrained`: the files' own
names, `model.language_model.*`, `feed_forward.w1`, `q_layernorm`, `model.vision_tower.*` with
SigLIP2's pooling head, which the engine skips) with its processor's files as
`Lfm2VlProcessor.save_pretrained` writes them, and the GPT-NeoX tokenizer plus LFM2-VL's image
tokens (`<image>`, `<|image_start|>`, `<|image_end|>`, `<|img_thumbnail|>`, the tile markers)
and a chat template that places images. The processor's settings are small enough that one test
image is split into 2 x 2 tiles and a thumbnail and another is not. The engine's greedy tokens
and logprobs must equal transformers' `generate` on the engine's expanded prompt (which must be
transformers' processor's `input_ids`) with transformers' processor's pixels, for one image and
for two (one split, one not); the language model is LFM2 with a tied head, or LFM2-MoE (an
`lfm2_moe` text config) with an untied one. A different image changes the output; `LLM.chat`
with `image_pil` parts equals the generate path; `language_model_only` refuses images and skips
the vision tensors; a checkpoint with the released files' older tower names
(`model.vision_tower.vision_model.*`) gives the same output.

transformers' LFM2-VL image processor needs torchvision, absent here: its outputs come from a
child process (`tests.helpers.lfm2_vl_reference`, as `test_lfm2_vl_vision`).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.helpers.image_checkpoints import QWEN_TEMPLATE, add_special_tokens, random_image
from tests.helpers.image_checks import (
    check_chat_equals_generate,
    check_language_model_only,
    check_the_image_changes_the_output,
)
from tests.helpers.lfm2_vl_reference import run_reference
from tests.helpers.logs import captured
from tests.helpers.runners import VllmRunner
from tests.helpers.tiny_configs import LFM2, LFM2_MOE
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import copy_tokenizer
from vllm_mamba import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("image-input")

MAX_TOKENS = 16
IMAGE = "<image>"
SPECIAL = [IMAGE, "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)
]
TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", IMAGE)
PATCH = 4
# 4 to 16 LLM tokens per crop (patch 4, factor 2); tiles of 32 pixels (16 tokens), 2 to 4 of
# them for an image over 2 * 16 * 64 pixels
SETTINGS = {
    "encoder_patch_size": PATCH,
    "downsample_factor": 2,
    "min_image_tokens": 4,
    "max_image_tokens": 16,
    "tile_size": 32,
    "min_tiles": 2,
    "max_tiles": 4,
    "use_thumbnail": True,
    "do_image_splitting": True,
    "do_convert_rgb": True,
}
VISION = {
    "model_type": "siglip2_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": PATCH,
    "num_patches": 16,
    "vision_use_head": True,  # the pooling head: saved, never run (skipped by the engine)
}
IMAGES = {
    "tiled": random_image(80, 100, 1),  # 2 x 2 tiles of 32 and a 24 x 32 thumbnail: 76 tokens
    "small": random_image(40, 50, 0),  # one 24 x 32 crop: 12 tokens
    "other": random_image(80, 100, 5),  # as `tiled`, other pixels
}
CASES = {
    "one": (f"Describe {IMAGE} briefly.", ["tiled"]),
    "two": (f"{IMAGE} versus {IMAGE}: which is brighter?", ["tiled", "small"]),
}
TEXTS = {  # the language model: LFM2 with a tied head, LFM2-MoE with an untied one
    "lfm2-tied": ("lfm2", LFM2["lfm2-gqa"], True),
    "lfm2_moe-untied": ("lfm2_moe", LFM2_MOE["lfm2-moe-top2"], False),
}


def _checkpoint(text_kind: str) -> tuple[str, dict]:
    """A tiny LFM2-VL checkpoint, its processor and tokenizer; transformers' processor outputs
    for `CASES` (saving the processor's files into the checkpoint)."""
    model_type, text_config, tied = TEXTS[text_kind]
    path = make_tmp_dir("tiny-lfm2-vl-")
    copy_tokenizer(path)
    ids = add_special_tokens(path, SPECIAL, TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = {k: v for k, v in text_config.items() if k != "tie_word_embeddings"}
    text.update(
        model_type=model_type, vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0,
        pad_token_id=1,
    )  # fmt: skip
    config = transformers.Lfm2VlConfig(
        vision_config=VISION,
        text_config=text,
        image_token_id=ids[IMAGE],
        projector_hidden_size=48,
        downsample_factor=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.Lfm2VlForConditionalGeneration(config).eval()
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
    calls = {(case,): (prompt, names, {}) for case, (prompt, names) in CASES.items()}
    reference = run_reference(path, SETTINGS, calls, IMAGES, save_to=path)
    return path, reference


@pytest.fixture(scope="module", params=list(TEXTS))
def saved(request) -> tuple[str, dict]:  # noqa: ANN001 - pytest's request
    return _checkpoint(request.param)


@pytest.fixture(scope="module")
def checkpoint(saved) -> str:  # noqa: ANN001
    return saved[0]


@pytest.fixture(scope="module")
def hf(checkpoint):  # noqa: ANN001, ANN201 - transformers' model
    return transformers.Lfm2VlForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def runner(checkpoint):  # noqa: ANN001, ANN201 - the engine
    with VllmRunner(checkpoint, max_model_len=512) as r:
        yield r


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)


@torch.no_grad()
def _hf_greedy(model, inputs: dict) -> tuple[list[int], list]:  # noqa: ANN001
    """transformers' `generate` on the processor's outputs `inputs`: its greedy tokens and
    per-step log-softmax."""
    ids = torch.tensor([inputs["input_ids"]])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
        spatial_shapes=inputs["spatial_shapes"],
        pixel_attention_mask=inputs["pixel_attention_mask"], max_new_tokens=MAX_TOKENS,
        do_sample=False, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return tokens, [step[0].float().log_softmax(-1) for step in out.logits]


def test_processor_files(saved) -> None:  # noqa: ANN001
    """The checkpoint holds the processor's files as transformers saves them, and one test
    image is tiled (2 x 2 and a thumbnail), the other not."""
    path, reference = saved
    assert os.path.isfile(os.path.join(path, "processor_config.json"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.chat_template == TEMPLATE
    spatial = reference[("two",)]["spatial_shapes"].tolist()
    assert spatial == [[8, 8]] * 4 + [[6, 8], [6, 8]]


@pytest.mark.parametrize("case", list(CASES))
def test_images_match_transformers(case: str, saved, runner, hf) -> None:  # noqa: ANN001
    text, names = CASES[case]
    images = [IMAGES[name] for name in names]
    tok = runner.llm.get_tokenizer()
    ids = tok.encode(text)
    image_id = tok.convert_tokens_to_ids(IMAGE)
    assert ids.count(image_id) == len(images)
    out = runner.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], _greedy()
    )[0]
    inputs = saved[1][(case,)]
    assert out.prompt_token_ids == inputs["input_ids"]  # the processor's expansion
    assert out.prompt_token_ids.count(image_id) == 76 + 12 * (len(images) - 1)
    want, logprobs = _hf_greedy(hf, inputs)
    comp = out.outputs[0]
    assert comp.token_ids == want
    assert len(comp.logprobs) == MAX_TOKENS
    for step, lp in enumerate(comp.logprobs):
        assert len(lp) >= 2
        for t, value in lp.items():
            assert abs(value.logprob - float(logprobs[step][t])) <= 1e-4


def test_the_image_changes_the_output(runner) -> None:  # noqa: ANN001
    images = (IMAGES["tiled"], IMAGES["other"])
    check_the_image_changes_the_output(runner, CASES["one"][0], images, _greedy())


def test_chat_equals_generate(runner) -> None:  # noqa: ANN001
    check_chat_equals_generate(runner, IMAGE, (IMAGES["tiled"], IMAGES["small"]), _greedy())


def test_language_model_only(checkpoint, runner, caplog) -> None:  # noqa: ANN001
    """The pooling head is counted with the tower's prefix."""
    check_language_model_only(
        checkpoint, runner, IMAGE, IMAGES["small"], _greedy(),
        ["model.vision_tower.", "model.multi_modal_projector."], caplog,
    )  # fmt: skip


def test_older_tower_names(checkpoint, runner, caplog) -> None:  # noqa: ANN001
    """The released files' `model.vision_tower.vision_model.*` (transformers 4's spelling, with
    its pooling head, which is skipped) load as transformers 5's names."""
    from safetensors.torch import load_file, save_file

    older = make_tmp_dir("tiny-lfm2-vl-older-")
    for file in os.listdir(checkpoint):
        if file != "model.safetensors":
            shutil.copy(os.path.join(checkpoint, file), older)
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    renamed = {
        name.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1): t
        for name, t in tensors.items()
    }
    assert any(n.startswith("model.vision_tower.vision_model.head.") for n in renamed)
    save_file(renamed, os.path.join(older, "model.safetensors"), metadata={"format": "pt"})
    prompt = {
        "prompt_token_ids": runner.llm.get_tokenizer().encode(CASES["two"][0]),
        "multi_modal_data": {"image": [IMAGES["tiled"], IMAGES["small"]]},
    }
    want = runner.generate([prompt], _greedy())[0].outputs[0]
    with (
        captured(caplog, "vllm_mamba.model_loader"),
        VllmRunner(older, max_model_len=512) as r,
    ):
        got = r.generate([prompt], _greedy())[0].outputs[0]
    skipped = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skipped) == 1 and "'model.vision_tower.vision_model.head.'" in skipped[0]
    assert got.token_ids == want.token_ids
    for g_step, w_step in zip(got.logprobs, want.logprobs):
        for token, lp in g_step.items():
            assert abs(lp.logprob - w_step[token].logprob) <= 1e-6


@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_and_prefix_cache_equal_one_pass(checkpoint, runner, budget) -> None:  # noqa: ANN001
    """Chunks that cut inside the tiles' tokens and between tile markers, and a prefix-cache
    hit through the image (the second request shares its text and image), give the one-pass
    outputs."""
    text, names = CASES["two"]
    images = [IMAGES[name] for name in names]
    ids = runner.llm.get_tokenizer().encode(text)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    other = {"prompt_token_ids": [*ids[:-1], ids[1]], "multi_modal_data": {"image": images}}
    want = runner.generate([prompt, other], _greedy())
    with VllmRunner(
        checkpoint, max_model_len=512, max_num_batched_tokens=budget, enable_prefix_caching=True
    ) as chunked:
        got = chunked.generate([prompt, other], _greedy())
    # the second waited for the first to save where they part: its last token
    assert got[1].num_cached_tokens == len(got[1].prompt_token_ids) - 1
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gs, ws in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for t, lp in gs.items():
                assert abs(lp.logprob - ws[t].logprob) <= 1e-4
