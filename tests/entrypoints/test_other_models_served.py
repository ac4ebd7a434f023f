"""FalconMamba and Mamba2 through the OpenAI server: the same greedy text as `LLM.generate`."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, launch_server
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
