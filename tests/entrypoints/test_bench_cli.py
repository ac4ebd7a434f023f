"""Smoke tests of `vllm-mamba bench latency|throughput` on the tiny model (no timing checks),
and how `bench serve` resolves its model and fails."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.entrypoints.conftest import closed_port
from tests.tiny_models import tiny_model_dir
from vllm_mamba.entrypoints.cli import main
from vllm_mamba.model_zoo import DEFAULT_MODEL


def _numbers(text: str, label: str) -> list[float]:
    """The numbers on the first output line starting with `label`."""
    line = next(line for line in text.splitlines() if line.startswith(label))
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", line[len(label) :])]


def _check_memory(memory: dict, out: str) -> None:
    assert memory["state_bytes_per_seq"] > 0
    assert memory["weight_bytes"] > 0
    assert memory["peak_rss_bytes"] > 0
    assert memory["max_concurrent_seqs"] > 0
    assert _numbers(out, "State per sequence:")[0] > 0
    assert _numbers(out, "Peak resident memory:")[0] > 0
    assert _numbers(out, "Concurrent sequences in")[-1] > 0


def test_latency(tmp_path, capsys):
    path = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", tiny_model_dir("tied"), "--batch-size", "2"]
    argv += ["--input-len", "5", "--output-len", "3", "--num-iters-warmup", "1"]
    argv += ["--num-iters", "2", "--memory-budget-gb", "1", "--output-json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _numbers(out, "Avg latency:")[0] > 0
    assert _numbers(out, "50% percentile latency:")[0] > 0
    results = json.loads(path.read_text())
    assert len(results["latencies"]) == 2
    assert all(t > 0 for t in results["latencies"])
    assert results["avg_latency"] > 0 and results["output_tokens_per_second"] > 0
    assert set(results["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    _check_memory(results["memory"], out)


def test_throughput(tmp_path, capsys):
    path = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", tiny_model_dir("tied"), "--num-prompts", "5"]
    argv += ["--input-len", "4", "--output-len", "3", "--max-num-seqs", "2", "--temperature", "0"]
    argv += ["--memory-budget-gb", "1", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    requests, total, output = _numbers(out, "Throughput:")
    assert requests > 0 and total > output > 0
    results = json.loads(path.read_text())
    assert results["num_requests"] == 5
    assert results["num_output_tokens"] == 5 * 3
    assert results["total_num_tokens"] == 5 * (4 + 3)
    assert results["requests_per_second"] > 0 and results["tokens_per_second"] > 0
    _check_memory(results["memory"], out)


@pytest.mark.parametrize("extra", [["--input-len", "0"], ["--num-prompts", "0"]])
def test_bad_arguments_exit_2(extra, capsys):
    argv = ["bench", "throughput", "--model", tiny_model_dir("tied"), *extra]
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err


def test_bench_without_subcommand_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "latency" in capsys.readouterr().out


def test_bench_serve_resolves_the_model_as_serve_does(monkeypatch, capsys):
    """`bench serve --model vllm-mamba/tiny-stdlib` (the shipped model, which `serve` takes)
    looked the name up on the hub for its tokenizer, retried for 55 s offline and failed; a
    hub id that is not to be had fails at once, in one line."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with closed_port() as port:
        argv = ["bench", "serve", "--port", str(port), "--num-prompts", "2", "--disable-tqdm"]
        argv += ["--random-input-len", "8", "--random-output-len", "2"]
        assert main([*argv, "--model", DEFAULT_MODEL]) == 0  # its tokenizer: the shipped one
        assert "Failed requests" in capsys.readouterr().out  # no server there
        start = time.monotonic()
        assert main([*argv, "--model", "someone/no-such-model"]) == 2
        assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert err.startswith("error: could not load the tokenizer 'someone/no-such-model' (give")
    assert "HF_HUB_OFFLINE=1" in err and err.count("\n") == 1


def test_bench_serve_without_a_server_is_a_runtime_error(capsys):
    with closed_port() as port:
        assert main(["bench", "serve", "--port", str(port), "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not read the first model from") and err.count("\n") == 1
