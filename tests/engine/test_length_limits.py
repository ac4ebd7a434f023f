"""Length limits as vLLM's, for every model: prompt plus `max_tokens` beyond `max_model_len`
is a `ValueError` with vLLM's message (the server's 400 naming `max_tokens`); an omitted
`max_tokens` fills what the prompt leaves; a prompt that leaves no room is refused."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.entrypoints.openai.errors import error_from_value_error

MAX_MODEL_LEN = 64
PROMPT = list(range(3, 13))  # 10 token ids


def too_large(max_tokens: int, prompt_len: int, max_model_len: int = MAX_MODEL_LEN) -> str:
    """vLLM's message (`OpenAIServing._validate_input`), as a regular expression."""
    return re.escape(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
        f"maximum context length is {max_model_len} tokens and your request has {prompt_len} "
        f"input tokens ({max_tokens} > {max_model_len} - {prompt_len})."
    )


@pytest.fixture(scope="module")
def llm(vllm_runner: type[VllmRunner]) -> Iterator[VllmRunner]:
    """An attention-free model (no KV cache): the limit used to be clamped silently."""
    with vllm_runner(tiny_model_dir("tied"), max_model_len=MAX_MODEL_LEN, max_num_seqs=4) as r:
        yield r


def test_max_tokens_beyond_the_model_length_is_refused(llm: VllmRunner) -> None:
    prompt = {"prompt_token_ids": PROMPT}
    with pytest.raises(ValueError, match=too_large(100000, 10)) as err:
        llm.generate(prompt, SamplingParams(max_tokens=100000))
    assert error_from_value_error(err.value).param == "max_tokens"
    with pytest.raises(ValueError, match=too_large(55, 10)):  # one token over
        llm.generate(prompt, SamplingParams(max_tokens=55))
    llm.assert_drained()
    # Exactly what is left is fine, and all of it is generated.
    out = llm.generate(prompt, SamplingParams(max_tokens=54, ignore_eos=True, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 54
    assert out[0].outputs[0].finish_reason == "length"


def test_refusal_ends_the_whole_batch_and_the_engine_serves_on(llm: VllmRunner) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=60)
    with pytest.raises(ValueError, match="'max_tokens'"):
        llm.generate(["hello", {"prompt_token_ids": PROMPT}], greedy)  # "hello" fits, 10 + 60 not
    llm.assert_drained()
    assert len(llm.generate_greedy("hello", 4)[0]) > 0


def test_omitted_max_tokens_fills_the_rest(llm: VllmRunner) -> None:
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    assert len(out.token_ids) == MAX_MODEL_LEN - len(PROMPT)
    assert out.finish_reason == "length"


def test_prompt_that_leaves_no_room(llm: VllmRunner) -> None:
    full = {"prompt_token_ids": [5] * MAX_MODEL_LEN}
    message = (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request "
        f"has {MAX_MODEL_LEN} input tokens. Please reduce the length of the input messages."
    )
    for params in (SamplingParams(max_tokens=None), SamplingParams(max_tokens=1)):
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            llm.generate(full, params)
        assert error_from_value_error(err.value).param == "prompt"
    # A prompt over the length stays the prompt's own error.
    with pytest.raises(ValueError, match=r"prompt is 65 tokens long, more than max_model_len"):
        llm.generate({"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)}, SamplingParams())
    llm.assert_drained()


def test_hybrid_gets_the_same_message(vllm_runner: type[VllmRunner]) -> None:
    with vllm_runner(tiny_model_dir("jamba-gqa"), max_model_len=MAX_MODEL_LEN, max_num_seqs=2) as r:
        with pytest.raises(ValueError, match=too_large(60, 10)):
            r.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=60))
        params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
        out = r.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
        assert len(out.token_ids) == MAX_MODEL_LEN - len(PROMPT)
