"""Speculative decoding through the OpenAI server (`--speculative-config` JSON) with the
official `openai` client: the shipped trained model (n-gram lookup pays on code), a tiny
hybrid drafted by a tiny Mamba, and a tiny Nemotron-H and a tiny Qwen4-Exp (its head over the
hyper-connection streams, asked for by SGLang's method name) drafting with their own MTP heads give
`LLM.generate`'s greedy text without speculation, streamed or not, concurrently; `/metrics`
reports vLLM's speculative-decoding counters."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.conftest import (
    API_KEY,
    MODEL_NAME,
    RunningServer,
    greedy_completions,
    launch_server,
)
from tests.helpers.mtp_checkpoints import save_tiny_nemotron_with_mtp, save_tiny_qwen4_with_mtp
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.model_zoo import DEFAULT_MODEL

MAX_TOKENS = 24
MTP_MODEL = "nemotron-h-moe with its MTP head"  # `save_tiny_nemotron_with_mtp`
STREAMS_MTP_MODEL = "qwen4-exp-ple with its MTP head"  # `save_tiny_qwen4_with_mtp`
CODE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
PROMPTS = [CODE, "import os\nimport sys\n\n\nclass Foo:\n    def __init__(self):\n", "for i in"]
CASES = {
    "ngram": (DEFAULT_MODEL, {"method": "ngram", "num_speculative_tokens": 4}),
    "draft": ("jamba-gqa", {"method": "draft_model", "num_speculative_tokens": 3}),
    "mtp": (MTP_MODEL, {"method": "mtp", "num_speculative_tokens": 2}),
    "mtp-streams": (STREAMS_MTP_MODEL, {"method": "qwen4_exp_mtp", "num_speculative_tokens": 2}),
}


def _model(name: str) -> str:
    if name == MTP_MODEL:
        return save_tiny_nemotron_with_mtp(make_tmp_dir("tiny-nemotron-mtp-served-"))
    if name == STREAMS_MTP_MODEL:
        return save_tiny_qwen4_with_mtp(make_tmp_dir("tiny-qwen4-mtp-served-"))
    return name if name.startswith("vllm-mamba/") else tiny_model_dir(name)


@pytest.fixture(scope="module", params=sorted(CASES))
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    model, spec = CASES[request.param]
    spec = dict(spec)
    if spec["method"] == "draft_model":
        spec["model"] = tiny_model_dir("tied")
    flags = ("--speculative-config", json.dumps(spec))
    with launch_server(*flags, model_dir=_model(model)) as running:
        yield running


def test_served_speculation_equals_llm_generate(server: RunningServer) -> None:
    with VllmRunner(server.model_dir) as runner:
        outs = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    expected = {o.prompt: o.outputs[0].text for o in outs}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    got = greedy_completions(server.url, PROMPTS * 2, MAX_TOKENS)
    assert got == [expected[p] for p in PROMPTS * 2]
    stream = client.completions.create(
        model=MODEL_NAME, prompt=CODE, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected[CODE]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text

    def counter(name: str) -> float:
        found = re.search(rf"^{name}_total\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
        assert found, name
        return float(found.group(1))

    drafts = counter("vllm:spec_decode_num_drafts")
    drafted = counter("vllm:spec_decode_num_draft_tokens")
    accepted = counter("vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0 and drafted >= drafts and 0 <= accepted <= drafted
    per_pos = re.findall(
        r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} (\S+)$',
        metrics,
        re.MULTILINE,
    )
    assert sum(float(v) for _, v in per_pos) == accepted
    if server.model_dir == DEFAULT_MODEL:  # the trained model copies code: lookup pays
        assert accepted > 0


def test_bad_speculative_config_is_refused_at_startup() -> None:
    """An unknown key: the server exits at startup with an error that names it."""
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}'
    cmd = [sys.executable, "-m", "vllm_mamba.entrypoints.openai.api_server"]
    cmd += ["--model", tiny_model_dir("tied"), "--speculative-config", spec]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "bogus" in done.stderr and "speculative_config" in done.stderr
