"""RWKV-7 through the OpenAI server with the official `openai` client, in both of its formats as
they ship: fla-hub's layout (`config.json` with `model_type: rwkv7`, safetensors, the World
vocabulary and a remote-code `tokenizer_config.json`, no `tokenizer.json`) and a BlinkDL
directory (one `.pth` and the vocabulary). Completions and chat (streamed and not) give
`LLM.generate`'s greedy text, a structured `choice` is honoured, and the tokenizer is the RWKV
World one (ids equal the `rwkv` package's)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import openai
import pytest
from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

from tests.entrypoints.conftest import (
    API_KEY,
    MODEL_NAME,
    RunningServer,
    greedy_completions,
    launch_server,
)
from tests.helpers.runners import VllmRunner
from tests.helpers.rwkv_checkpoints import save_rwkv7
from tests.helpers.tmp_dirs import make_tmp_dir
from vllm_mamba import SamplingParams

VOCAB = os.path.join(os.path.dirname(__import__("rwkv").__file__), "rwkv_vocab_v20230424.txt")
CONFIG = dict(
    vocab_size=65536, hidden_size=64, num_hidden_layers=2, head_dim=32, decay_low_rank_dim=8,
    a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, intermediate_size=128,
)  # fmt: skip
MAX_TOKENS = 12
PROMPTS = ["The quick brown fox", "你好，世界", "def fibonacci(n):"]
CHAT = "user: What is a recurrent state?\nassistant:"  # the test servers' role: content template


def _model_dir(fmt: str) -> str:
    """A tiny RWKV-7 laid out as its release format ships, with the World vocabulary."""
    path = save_rwkv7(CONFIG, make_tmp_dir(f"rwkv7-served-{fmt}-"), fmt, seed=5)
    for file in os.listdir(path):  # no GPT-NeoX tokenizer: the World vocabulary instead
        if file.endswith(".json") and file != "config.json":
            os.remove(os.path.join(path, file))
    shutil.copy(VOCAB, path)
    if fmt == "hf":  # fla-hub's tokenizer_config points at remote code that is never run
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            auto = {"AutoTokenizer": ["hf_rwkv_tokenizer.RwkvTokenizer", None]}
            json.dump({"tokenizer_class": "RwkvTokenizer", "auto_map": auto}, f)
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=["hf", "pth"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with launch_server(model_dir=_model_dir(request.param)) as running:
        yield running


@pytest.fixture(scope="module")
def expected(server: RunningServer) -> dict[str, tuple[str, list[int]]]:
    """`LLM.generate`'s greedy continuations (text and ids) of `PROMPTS` and the chat prompt,
    and the prompts' ids."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with VllmRunner(server.model_dir) as runner:
        outs = runner.generate([*PROMPTS, CHAT], params)
    got = {o.prompt: (o.outputs[0].text, o.prompt_token_ids) for o in outs}
    assert len({t for t, _ in got.values()}) == len(got), got  # varied
    return got


def test_prompts_use_the_world_tokenizer(expected: dict[str, tuple[str, list[int]]]) -> None:
    ref = TRIE_TOKENIZER(VOCAB)
    for prompt in PROMPTS:
        assert expected[prompt][1] == ref.encode(prompt)


def test_completions_and_chat_equal_llm_generate(
    server: RunningServer, expected: dict[str, tuple[str, list[int]]]
) -> None:
    got = greedy_completions(server.url, PROMPTS, MAX_TOKENS)
    assert got == [expected[p][0] for p in PROMPTS]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "What is a recurrent state?"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected[CHAT][0]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected[CHAT][0]


def test_structured_choice(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    choices = ["recurrent", "attention", "状态"]
    for seed in range(3):
        out = client.completions.create(
            model=MODEL_NAME, prompt="The layer is", max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert out.choices[0].text in choices
