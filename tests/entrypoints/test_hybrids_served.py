"""The Mamba2 hybrids (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1, Zamba2) through the OpenAI
server: the same greedy text as `LLM.generate` for concurrent requests under KV pressure
(preemptions), and a drained KV cache afterwards."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, launch_server
from tests.helpers import family_checks as checks
from tests.helpers.prompts import make_prompts
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams

BLOCKS = 14
MAX_TOKENS = 12


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


@pytest.mark.parametrize(
    "name",
    ["bamba-gqa", "granite-moe-rope", "nemotron-h-moe", "falcon-h1-norm", "zamba2-lora-rope"],
)
def test_served_hybrid_equals_llm_generate(name: str) -> None:
    path = tiny_model_dir(name)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with VllmRunner(path) as runner:
        want = [o.outputs[0].text for o in runner.generate(checks.prompts(), params)]
    assert all(want) and len(set(want)) == len(want), want  # an empty match proves nothing
    flags = ("--num-gpu-blocks-override", str(BLOCKS), "--block-size", "16")
    with launch_server(*flags, model_dir=path) as server:

        def complete(ids: list[int]) -> httpx.Response:
            body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
            url = f"{server.url}/v1/completions"
            return httpx.post(url, json=body, headers=server.headers, timeout=300)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(complete, make_prompts()))
        metrics = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    bodies = [r.json() for r in replies]
    assert all(r.status_code == 200 for r in replies), bodies
    assert [b["choices"][0]["text"] for b in bodies] == want
    assert _metric(metrics, "vllm:kv_cache_blocks_total") == BLOCKS
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0.0  # drained
