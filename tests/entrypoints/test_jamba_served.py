"""Jamba (a hybrid) through the OpenAI server: the same greedy tokens as `LLM.generate` under KV
pressure, a 400 naming the limit for a request that can never fit, and KV usage and
preemptions in `/metrics`."""

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
from vllm_mamba.entrypoints.cli import main

BLOCKS = 14


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_served_jamba_equals_llm_under_kv_pressure(vllm_runner: type[VllmRunner]) -> None:
    path = tiny_model_dir("jamba-gqa")
    params = SamplingParams(temperature=0, max_tokens=20)
    with vllm_runner(path) as runner:
        want = [o.outputs[0].text for o in runner.generate(checks.prompts(), params)]
    assert all(want) and len(set(want)) == len(want), want  # an empty match proves nothing
    flags = ("--num-gpu-blocks-override", str(BLOCKS), "--block-size", "16")
    with launch_server(*flags, model_dir=path) as server:

        def complete(ids: list[int] | list[list[int]]) -> httpx.Response:
            body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 20, "temperature": 0}
            url = f"{server.url}/v1/completions"
            return httpx.post(url, json=body, headers=server.headers, timeout=300)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(complete, make_prompts()))
        # One request carrying all eight prompts: they enter the engine in one step, so the
        # running ones outgrow the 14 blocks while decoding, whatever the machine's speed
        # (separate requests may each finish before the next arrives on a fast machine).
        batched = complete(make_prompts())
        too_long = complete(make_prompts()[7] * 2)  # 262 tokens: more than 14 x 16
        metrics = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    bodies = [r.json() for r in replies]
    assert all(r.status_code == 200 for r in replies), bodies
    assert [b["choices"][0]["text"] for b in bodies] == want
    assert batched.status_code == 200, batched.text
    choices = sorted(batched.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == want
    assert too_long.status_code == 400 and "KV cache" in too_long.text, too_long.text
    assert _metric(metrics, "vllm:num_preemptions_total") > 0
    assert _metric(metrics, "vllm:kv_cache_blocks_total") == BLOCKS
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0.0  # drained


def test_generate_command_runs_jamba(
    capsys: pytest.CaptureFixture[str], vllm_runner: type[VllmRunner]
) -> None:
    path = tiny_model_dir("jamba-mqa")
    prompt = "def fibonacci(n):"
    with vllm_runner(path, num_gpu_blocks_override=16) as runner:
        want = runner.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert want.outputs[0].text
    argv = ["generate", prompt, "--model", path, "--max-tokens", "12", "--temperature", "0"]
    assert main([*argv, "--num-gpu-blocks-override", "16"]) == 0
    assert want.outputs[0].text in capsys.readouterr().out
