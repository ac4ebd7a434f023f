"""The trained model that ships inside the package, and the `vllm-mamba generate` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import vllm_mamba
from tests.helpers.runners import HfRunner, VllmRunner
from vllm_mamba import SamplingParams
from vllm_mamba.model_zoo import DEFAULT_MODEL, list_shipped_models, shipped_model_path

PROMPTS = ["def ", "import ", "class "]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def llm(vllm_runner: type[VllmRunner]) -> Iterator[VllmRunner]:
    with vllm_runner(DEFAULT_MODEL) as runner:
        yield runner


def test_shipped_model_is_inside_the_package() -> None:
    path = shipped_model_path(DEFAULT_MODEL)
    assert path is not None and DEFAULT_MODEL in list_shipped_models()
    package_dir = os.path.dirname(os.path.abspath(vllm_mamba.__file__))
    assert os.path.commonpath([path, package_dir]) == package_dir
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size <= 10 * 1024 * 1024


def test_generates_varied_python_like_text(llm: VllmRunner) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    texts = [o.outputs[0].text for o in outs]
    assert all(t.strip() for t in texts), texts
    assert len(set(texts)) == len(texts)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert len(set(tokens)) >= len(tokens) // 4, out.outputs[0].text
    # Trained on Python source: the continuations contain Python's punctuation and newlines.
    joined = "".join(texts)
    assert "\n" in joined and ("(" in joined or ":" in joined), texts


def test_same_greedy_tokens_as_transformers(llm: VllmRunner, hf_runner: type[HfRunner]) -> None:
    hf = hf_runner(shipped_model_path(DEFAULT_MODEL))
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        ids = hf.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :]
        assert out.outputs[0].token_ids == ref.tolist()
        assert out.outputs[0].finish_reason == "length"  # 40 tokens: no EOS cut either side


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_mamba.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_generate_help_and_run(llm: VllmRunner) -> None:
    helped = _cli("generate", "--help")
    assert helped.returncode == 0
    assert "examples:" in helped.stdout and "--max-tokens" in helped.stdout
    ran = _cli("generate", "def ", "import ", "--max-tokens", "12")
    assert ran.returncode == 0, ran.stderr
    for out in llm.generate(["def ", "import "], SamplingParams(temperature=0, max_tokens=12)):
        assert len(out.outputs[0].token_ids) == 12
        assert f"--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}\n" in ran.stdout
    summary = ran.stdout.splitlines()[-1]
    assert summary.startswith("2 prompt(s), 24 tokens in ") and summary.endswith(" tokens/s)")
