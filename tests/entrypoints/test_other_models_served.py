"""FalconMamba, Mamba2 and RWKV-4 through the OpenAI server: the same greedy text as
`LLM.generate` (RWKV-4 also chats, streamed, with the official `openai` client)."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, greedy_completions, launch_server
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

PROMPTS = ["The quick brown fox", "def main():"]


@pytest.mark.parametrize("name", ["falcon-tied", "mamba2-tied"])
def test_server_greedy_text_equals_llm(vllm_runner: type[VllmRunner], name: str) -> None:
    model_dir = tiny_model_dir(name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with vllm_runner(model_dir) as runner:
        want = [o.outputs[0].text for o in runner.generate(PROMPTS, params)]
    assert all(want) and len(set(want)) == len(want), want  # an empty match proves nothing
    with launch_server(model_dir=model_dir) as server:
        body = {
            "model": MODEL_NAME,
            "prompt": PROMPTS,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
        )
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == want


def test_rwkv4_completions_and_streamed_chat(vllm_runner: type[VllmRunner]) -> None:
    """RWKV-4 (`RwkvForCausalLM`, rescaling every 2 blocks): completions and a streamed chat
    through the `openai` client give `LLM.generate`'s greedy text."""
    import openai

    model_dir = tiny_model_dir("rwkv4-rescale")
    chat = "user: What is a recurrent state?\nassistant:"  # the test servers' template
    params = SamplingParams(temperature=0, max_tokens=12)
    with vllm_runner(model_dir) as runner:
        want = [o.outputs[0].text for o in runner.generate([*PROMPTS, chat], params)]
    assert all(want) and len(set(want)) == len(want), want
    with launch_server(model_dir=model_dir) as server:
        assert greedy_completions(server.url, PROMPTS, 12) == want[:-1]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What is a recurrent state?"}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([c for c in chunks if c]) > 1  # streamed, not one piece
    assert "".join(chunks) == want[-1]
