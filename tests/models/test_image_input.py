"""Images through `LLM` on Qwen3.5's image-text checkpoints, against transformers.

A tiny `Qwen3_5ForConditionalGeneration` (and the MoE one) with a real Qwen3-VL vision tower
(`tests.helpers.image_checkpoints`): the engine's greedy tokens and logprobs must equal
transformers' `generate` on the same expanded prompt and transformers' own processor's pixels
(M-RoPE positions, the image rows in place of the placeholders), for one and two images of
different sizes, an image in the middle of the text, batched with text-only requests, at
odd chunk budgets that cut inside an image's tokens, with the prefix cache on (the same image
hits, another image does not), forks and speculation after an image; and bad input is refused
by name.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.image_checkpoints import PROCESSOR, qwen3_5_image_text, random_image
from tests.helpers.image_checks import (
    check_chat_equals_generate,
    check_language_model_only,
    check_the_image_changes_the_output,
)
from tests.helpers.runners import VllmRunner
from vllm_mamba import SamplingParams

MAX_TOKENS = 12
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
pytestmark = pytest.mark.xdist_group("image-input")


def _images() -> list:
    return [random_image(50, 70, 0), random_image(130, 40, 1), random_image(16, 16, 2)]


def _prompts(tokenizer) -> list[dict]:  # noqa: ANN001 - a transformers tokenizer
    """Prompts with one image, an image mid-text, two images of different sizes, none."""
    one, tall, tiny = _images()
    texts = [
        (f"Describe {IMAGE} briefly.", [one]),
        (f"The first{IMAGE}and then a long tail of text after the image", [tall]),
        (f"{IMAGE} versus {IMAGE}: which is brighter?", [one, tall]),
        ("Plain text with no image at all, to share the batch", []),
        (f"A tiny one {IMAGE}", [tiny]),
    ]
    out = []
    for text, images in texts:
        prompt = {"prompt_token_ids": tokenizer.encode(text)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        out.append(prompt)
    return out


@torch.no_grad()
def _hf_greedy(path: str, ids: list[int], images: list, moe: bool) -> tuple[list[int], list]:
    """transformers' greedy tokens and per-step log-softmax on the expanded prompt `ids`."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cls = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    model = getattr(transformers, cls).from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    kwargs = {}
    if images:
        proc = Qwen2VLImageProcessorPil(
            size={
                "shortest_edge": PROCESSOR["min_pixels"],
                "longest_edge": PROCESSOR["max_pixels"],
            },
            patch_size=PROCESSOR["patch_size"],
            merge_size=PROCESSOR["merge_size"],
            temporal_patch_size=PROCESSOR["temporal_patch_size"],
        )
        feats = proc.preprocess(images, return_tensors="pt")
        kwargs = dict(
            pixel_values=feats["pixel_values"],
            image_grid_thw=feats["image_grid_thw"],
            mm_token_type_ids=(x == model.config.image_token_id).int(),
        )
    out = model.generate(
        x, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
        return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    tokens = out.sequences[0, x.shape[1] :].tolist()
    return tokens, [step[0].float().log_softmax(-1) for step in out.logits]


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, **kwargs)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_images_match_transformers(moe: bool) -> None:
    path = qwen3_5_image_text(moe)
    with VllmRunner(path, max_model_len=512) as runner:
        prompts = _prompts(runner.llm.get_tokenizer())
        got = runner.generate(prompts, _greedy())
    pad = runner.llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    for prompt, out in zip(prompts, got):
        images = prompt.get("multi_modal_data", {}).get("image", [])
        expanded = out.prompt_token_ids
        assert expanded.count(pad) == sum(_tokens(image) for image in images)
        want, logprobs = _hf_greedy(path, expanded, images, moe)
        comp = out.outputs[0]
        assert comp.token_ids == want
        for step, (token, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert abs(lp[token].logprob - float(logprobs[step][token])) <= 1e-4


def _tokens(image) -> int:  # noqa: ANN001 - a PIL image
    """The LLM tokens transformers' processor gives `image` (merged patches)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    w, h = image.size
    factor = PROCESSOR["patch_size"] * PROCESSOR["merge_size"]
    rh, rw = smart_resize(h, w, factor, PROCESSOR["min_pixels"], PROCESSOR["max_pixels"])
    return (rh // factor) * (rw // factor)


def test_the_image_changes_the_output() -> None:
    """A different image (same text) gives different logprobs: the images are used."""
    with VllmRunner(qwen3_5_image_text(), max_model_len=512) as runner:
        images = (random_image(50, 70, 0), random_image(50, 70, 5))
        check_the_image_changes_the_output(runner, f"Describe {IMAGE} briefly.", images, _greedy())


@pytest.mark.parametrize("budget", [3, 7, 16])
def test_chunked_prefill_cutting_inside_images(budget: int) -> None:
    path = qwen3_5_image_text()
    with VllmRunner(path, max_model_len=512) as runner:
        prompts = _prompts(runner.llm.get_tokenizer())
        want = runner.generate(prompts, _greedy())
    with VllmRunner(path, max_model_len=512, max_num_batched_tokens=budget) as runner:
        got = runner.generate(prompts, _greedy())
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gs, ws in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, lp in gs.items():
                assert abs(lp.logprob - ws[token].logprob) <= 1e-4


def test_prefix_cache_keys_images_by_content() -> None:
    """Requests sharing text and an image share the prefix through the image; another image
    of the same size (the same placeholder ids) shares only the text before it."""
    path = qwen3_5_image_text()
    one = random_image(50, 70, 0)
    other = random_image(50, 70, 9)
    with VllmRunner(path, max_model_len=512) as runner:
        tok = runner.llm.get_tokenizer()
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        tails = [" briefly, please.", " in great detail.", " with its colours."]
        ids = [tok.encode(f"Describe the picture {IMAGE}{tail}") for tail in tails]
        cases = [(ids[0], one), (ids[1], one), (ids[2], one), (ids[0], other)]
        prompts = [{"prompt_token_ids": i, "multi_modal_data": {"image": m}} for i, m in cases]
        want = runner.generate(prompts, _greedy())
    with VllmRunner(path, max_model_len=512, enable_prefix_caching=True) as runner:
        first_two = runner.generate(prompts[:2], _greedy())  # the second waits for the branch
        third = runner.generate(prompts[2:3], _greedy())
        miss = runner.generate(prompts[3:], _greedy())
    got = first_two + third + miss
    image_end = len(want[0].prompt_token_ids) - len(tok.encode(tails[0]))
    image_start = want[0].prompt_token_ids.index(pad)
    assert got[0].num_cached_tokens == 0
    assert got[1].num_cached_tokens >= image_end  # the image's tokens came from the cache
    assert got[2].num_cached_tokens >= image_end
    assert got[3].num_cached_tokens <= image_start  # another image: not past its first token
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_forks_and_speculation_after_an_image() -> None:
    path = qwen3_5_image_text()
    with VllmRunner(path, max_model_len=512) as runner:
        prompts = _prompts(runner.llm.get_tokenizer())[:3]
        want = runner.generate(prompts, _greedy())
        forks = runner.generate(prompts, _greedy(n=2))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    with VllmRunner(path, max_model_len=512, speculative_config=spec) as runner:
        drafted = runner.generate(prompts, _greedy())
    for w, f, d in zip(want, forks, drafted):
        assert [c.token_ids for c in f.outputs] == [w.outputs[0].token_ids] * 2
        assert d.outputs[0].token_ids == w.outputs[0].token_ids


def test_bad_image_input_is_refused_by_name() -> None:
    path = qwen3_5_image_text()
    with VllmRunner(path, max_model_len=512, limit_mm_per_prompt={"image": 2}) as runner:
        tok = runner.llm.get_tokenizer()
        one = tok.encode(f"Look {IMAGE}")
        image = random_image(50, 70, 0)
        cases = [
            ({"prompt_token_ids": one, "multi_modal_data": {"image": [image, image]}}, "2 image"),
            ({"prompt_token_ids": one, "multi_modal_data": {"video": image}}, "'video'"),
            ({"prompt_token_ids": one, "multi_modal_data": {"image": "not an image"}}, "image[0]"),
            (
                {
                    "prompt_token_ids": tok.encode(IMAGE * 3),
                    "multi_modal_data": {"image": [image] * 3},
                },
                "limit_mm_per_prompt",
            ),
            ({"prompt_token_ids": one, "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ]
        for prompt, needle in cases:
            with pytest.raises(ValueError, match="multi_modal_data|prompt field") as err:
                runner.generate([prompt], _greedy())
            assert needle in str(err.value)
        # the engine still serves images afterwards
        ok = runner.generate(
            [{"prompt_token_ids": one, "multi_modal_data": {"image": image}}], _greedy()
        )
        assert len(ok[0].outputs[0].token_ids) == MAX_TOKENS


def test_too_many_image_tokens_for_max_model_len() -> None:
    path = qwen3_5_image_text()
    with VllmRunner(path, max_model_len=40) as runner:
        ids = runner.llm.get_tokenizer().encode(f"Look {IMAGE}")
        big = random_image(128, 128, 3)  # 64 LLM tokens
        with pytest.raises(ValueError, match="with its images' tokens, more than max_model_len"):
            runner.generate(
                [{"prompt_token_ids": ids, "multi_modal_data": {"image": big}}], _greedy()
            )


def test_language_model_only(caplog: pytest.LogCaptureFixture) -> None:
    path = qwen3_5_image_text()
    with VllmRunner(path, max_model_len=512) as runner:
        check_language_model_only(
            path, runner, IMAGE, random_image(20, 20, 0), _greedy(), ["model.visual."], caplog
        )


def test_chat_places_images_as_the_template_says() -> None:
    with VllmRunner(qwen3_5_image_text(), max_model_len=512) as runner:
        check_chat_equals_generate(runner, IMAGE, _images()[:2], _greedy())


@pytest.mark.parametrize("overrides", [{}, {"max_pixels": 32 * 32}, {"min_pixels": 96 * 96}])
def test_processor_equals_transformers(overrides: dict) -> None:
    """The checkpoint's processor settings (and `mm_processor_kwargs`) give transformers'
    own processor's patches and grid, and one placeholder per merged patch."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from vllm_mamba.model_loader import load_hf_config
    from vllm_mamba.models.vision.qwen3_vl import QwenImageProcessor

    path = qwen3_5_image_text()
    ours = QwenImageProcessor.from_pretrained(path, load_hf_config(path), overrides)
    theirs = Qwen2VLImageProcessorPil.from_pretrained(path, **overrides)
    for image in [*_images(), random_image(300, 20, 4)]:
        got = ours.process(image)
        want = theirs.preprocess([image], return_tensors="pt")
        assert torch.equal(got.features["pixel_values"], want["pixel_values"])
        assert torch.equal(got.features["image_grid_thw"], want["image_grid_thw"][0])
        t, h, w = want["image_grid_thw"][0].tolist()
        assert len(got.token_ids) == t * h * w // 4 == len(got.embed_offsets)
        assert got.grid == (t, h // 2, w // 2)


def test_mm_processor_kwargs_reach_the_engine() -> None:
    path = qwen3_5_image_text()
    kwargs = {"max_pixels": 32 * 32}
    with VllmRunner(path, max_model_len=512, mm_processor_kwargs=kwargs) as runner:
        tok = runner.llm.get_tokenizer()
        out = runner.generate(
            [
                {
                    "prompt_token_ids": tok.encode(f"Look {IMAGE}"),
                    "multi_modal_data": {"image": random_image(128, 128, 0)},
                }
            ],
            _greedy(),
        )[0]
    assert out.prompt_token_ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 4
    with pytest.raises(ValueError, match="mm_processor_kwargs: do_resize"):
        VllmRunner(path, max_model_len=512, mm_processor_kwargs={"do_resize": False})


def test_tensor_parallel_equals_one_rank() -> None:
    path = qwen3_5_image_text()
    with VllmRunner(path, max_model_len=512) as runner:
        prompts = _prompts(runner.llm.get_tokenizer())[:3]
        want = runner.generate(prompts, _greedy())
    with VllmRunner(path, max_model_len=512, tensor_parallel_size=2) as runner:
        got = runner.generate(prompts, _greedy())
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_chat_cache_points_move_past_images() -> None:
    """A multi-turn chat about an image saves its prefix where messages end (points moved past
    the image's tokens), so a later turn sharing them starts after the image."""
    path = qwen3_5_image_text()
    image = random_image(50, 70, 0)
    history = [
        {"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A picture of noise."},
    ]  # fmt: skip
    first = [*history, {"role": "user", "content": "Which colour dominates?"}]
    later = [*history, {"role": "user", "content": "Is it bright?"}]
    with VllmRunner(path, max_model_len=512) as runner:
        want = runner.llm.chat([later], _greedy(), use_tqdm=False)[0]
    with VllmRunner(path, max_model_len=512, enable_prefix_caching=True) as runner:
        before = runner.llm.chat([first], _greedy(), use_tqdm=False)[0]
        got = runner.llm.chat([later], _greedy(), use_tqdm=False)[0]
    shared = 0
    while before.prompt_token_ids[shared] == got.prompt_token_ids[shared]:
        shared += 1
    # the snapshot where the assistant's message ends: short of the shared prefix by at most
    # the turn's end and the next turn's header (10 tokens with this tokenizer, which splits
    # `<|im_end|>` and merges it with the text before); unmoved points would fall 11 tokens
    # (the image's expansion) further back
    assert shared - 10 <= got.num_cached_tokens <= shared
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
