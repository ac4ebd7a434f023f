"""Checks every image-text family shares (Qwen3.5, LFM2-VL, LFM3-VL), on an engine already
serving the family's tiny checkpoint: the image changes the output, `LLM.chat`'s image parts
equal the prompt the template writes with the images given directly, and `language_model_only`
serves the same text with the vision tensors skipped and images refused."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.logs import captured
from tests.helpers.runners import VllmRunner
from vllm_mamba import SamplingParams


def check_the_image_changes_the_output(
    runner: VllmRunner, text: str, images: tuple[Any, Any], params: SamplingParams
) -> None:
    """Two images of one size under the same text: the same prompt tokens, other logprobs."""
    ids = runner.llm.get_tokenizer().encode(text)
    a, b = runner.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": image}} for image in images],
        params,
    )
    assert a.prompt_token_ids == b.prompt_token_ids
    first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    assert {t: lp.logprob for t, lp in first_a.items()} != {
        t: lp.logprob for t, lp in first_b.items()
    }


def check_chat_equals_generate(
    runner: VllmRunner, placeholder: str, images: tuple[Any, Any], params: SamplingParams
) -> None:
    """`LLM.chat` with two `image_pil` parts between text parts equals `generate` on the
    template's text with one `placeholder` per image."""
    tok = runner.llm.get_tokenizer()
    first, second = images
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_pil", "image_pil": first},
        {"type": "text", "text": "with"},
        {"type": "image_pil", "image_pil": second},
    ]
    chat = runner.llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"Compare{placeholder}with{placeholder}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    direct = runner.generate(
        [{"prompt_token_ids": tok.encode(text), "multi_modal_data": {"image": [first, second]}}],
        params,
    )[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def check_language_model_only(
    checkpoint: str,
    runner: VllmRunner,
    placeholder: str,
    image: Any,
    params: SamplingParams,
    skipped: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`language_model_only`: the vision tensors skipped (one log line per prefix in
    `skipped`), images refused, the text's tokens and logprobs as with the tower loaded."""
    tok = runner.llm.get_tokenizer()
    ids = tok.encode("Plain text, no image at all")
    assert runner.engine.executor.model.serves_images
    want = runner.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    with (
        captured(caplog, "vllm_mamba.model_loader"),
        VllmRunner(checkpoint, max_model_len=512, language_model_only=True) as text_only,
    ):
        assert not text_only.engine.executor.model.serves_images
        prompt = {
            "prompt_token_ids": tok.encode(f"Look {placeholder}"),
            "multi_modal_data": {"image": image},
        }
        with pytest.raises(ValueError, match="served text-only"):
            text_only.generate([prompt], params)
        got = text_only.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    lines = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(lines) == len(skipped)
    for line, prefix in zip(lines, skipped):
        assert f"'{prefix}'" in line
    assert got.token_ids == want.token_ids
    for g_step, w_step in zip(got.logprobs, want.logprobs):
        assert g_step.keys() == w_step.keys()
        for token, lp in g_step.items():
            assert abs(lp.logprob - w_step[token].logprob) <= 1e-6
