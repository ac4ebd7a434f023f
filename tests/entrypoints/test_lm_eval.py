"""End to end: lm-evaluation-harness's `local-completions` against a real server on the tiny
model, with the local tasks in `lm_eval_task/` (multiple choice, rolling perplexity, greedy
generation). Every loglikelihood lm-eval records must equal `transformers`' own, and every
generation the greedy text cut at the task's `until` strings.

lm-eval runs as a user would type it (default tokenizer backend: it finds the server's
tokenizer routes and sends token ids), with `num_concurrent=4`.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, RunningServer, launch_server
from tests.helpers.runners import HfRunner
from tests.tiny_models import tiny_model_dir

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'lm-eval[api]'")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK_DIR = os.path.join("tests", "entrypoints", "lm_eval_task")
TASKS = ("tiny_mamba_mc", "tiny_mamba_rolling", "tiny_mamba_gen")
ATOL = 1e-3  # sums of up to ~10 float32 logprobs (see test_echo_logprobs.ATOL)
GEN_UNTIL = ["\n", "."]  # as in tiny_mamba_gen.yaml
GEN_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def lm_eval_samples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """lm-eval's logged samples per task.

    The small step budget chunks the prefills of the concurrent requests.
    """
    out = tmp_path_factory.mktemp("lm_eval")
    with launch_server("--max-num-batched-tokens", "16") as server:
        proc = run_lm_eval(server, str(out))
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert "Using remote tokenizer backend" in proc.stdout, proc.stdout[-4000:]
        samples = {task: read_samples(str(out), task) for task in TASKS}
        yield samples


@pytest.fixture(scope="module")
def hf(hf_runner: type[HfRunner]) -> HfRunner:
    """transformers on the directory the server serves."""
    return hf_runner(tiny_model_dir("tied"))


def run_lm_eval(server: RunningServer, output_path: str) -> subprocess.CompletedProcess:
    model_args = f"model={MODEL_NAME},base_url={server.url}/v1/completions,num_concurrent=4"
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        TASK_DIR,
        "--log_samples",
        "--output_path",
        output_path,
    ]
    env = {
        **os.environ,
        "OPENAI_API_KEY": API_KEY,  # what local-completions sends as its bearer token
        "HF_DATASETS_CACHE": os.path.join(output_path, "datasets"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    return subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def read_samples(output_path: str, task: str) -> list[dict]:
    paths = glob.glob(os.path.join(output_path, "**", f"samples_{task}_*.jsonl"), recursive=True)
    assert len(paths) == 1, f"no samples (or several) logged for {task}: {paths}"
    with open(paths[0]) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def encode_pair(hf: HfRunner, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens (causal models)."""
    encode = hf.tokenizer.encode
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids) :]


def loglikelihood(hf: HfRunner, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of log p(continuation token | everything before it), and whether all are argmax."""
    ids = context + continuation
    logprobs = hf.logprobs(ids)[len(context) - 1 : -1]  # (len(continuation), V)
    target = logprobs[range(len(continuation)), continuation]
    greedy = logprobs.argmax(-1).tolist() == continuation
    return float(target.sum()), greedy


def test_multiple_choice_loglikelihoods(lm_eval_samples: dict, hf: HfRunner) -> None:
    samples = lm_eval_samples["tiny_mamba_mc"]
    assert len(samples) == 6
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            recorded, is_greedy = float(resp[0][0]), resp[0][1] == "True"
            context, continuation = encode_pair(hf, args["arg_0"], args["arg_1"])
            expected, greedy = loglikelihood(hf, context, continuation)
            assert recorded == pytest.approx(expected, abs=ATOL), args
            assert is_greedy == greedy, args


def test_rolling_loglikelihoods(lm_eval_samples: dict, hf: HfRunner) -> None:
    samples = lm_eval_samples["tiny_mamba_rolling"]
    eos = hf.tokenizer.eos_token_id  # lm-eval's prefix token
    assert len(samples) == 2
    for sample in samples:
        text = sample["arguments"]["gen_args_0"]["arg_0"]
        expected, _ = loglikelihood(hf, [eos], hf.tokenizer.encode(text))
        assert float(sample["resps"][0][0]) == pytest.approx(expected, abs=ATOL), text


def test_generations_cut_at_until(lm_eval_samples: dict, hf: HfRunner) -> None:
    samples = lm_eval_samples["tiny_mamba_gen"]
    tokenizer = hf.tokenizer
    cut = 0
    for sample in samples:
        args = sample["arguments"]["gen_args_0"]
        assert args["arg_1"]["until"] == GEN_UNTIL
        prompt = tokenizer.encode(args["arg_0"])
        full = tokenizer.decode(hf.greedy(prompt, GEN_MAX_TOKENS)[len(prompt) :])
        end = min((full.find(s) for s in GEN_UNTIL if s in full), default=len(full))
        cut += end < len(full)
        assert sample["resps"][0][0] == full[:end]
    assert 0 < cut < len(samples), "the task should have generations with and without a stop"
