"""`vllm-mamba bench serve` against a real server on the tiny model (completions and chat), a
wrong port (every request counted as failed), the arrival schedule and the metric math on
hand-made timings, and `benchmarks/plot.py` writing PNGs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, closed_port
from vllm_mamba.entrypoints import bench_serve
from vllm_mamba.entrypoints.bench_serve import RequestOutput
from vllm_mamba.entrypoints.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM, OUT_LEN = 8, 8


def _bench(tmp_path, url: str, model_dir: str, *extra: str) -> dict:
    path = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", url, "--model", MODEL_NAME, "--tokenizer", model_dir]
    argv += ["--api-key", API_KEY, "--num-prompts", str(NUM), "--request-rate", "20"]
    argv += ["--max-concurrency", "4", "--random-input-len", "16"]
    argv += ["--random-output-len", str(OUT_LEN), "--ignore-eos", "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", path.name, "--disable-tqdm"]
    argv += ["--metric-percentiles", "50,90,99", *extra]
    assert main(argv) == 0
    return json.loads(path.read_text())


def _check_run(result: dict) -> None:
    assert result["completed"] == NUM and result["failed"] == 0
    assert not any(result["errors"]) and len(result["errors"]) == NUM
    assert result["total_output_tokens"] == NUM * OUT_LEN
    assert result["output_lens"] == [OUT_LEN] * NUM
    assert len(result["ttfts"]) == NUM and all(t > 0 for t in result["ttfts"])
    assert all(len(itl) >= 1 for itl in result["itls"])
    assert result["total_input_tokens"] == sum(result["input_lens"]) > 0
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["total_token_throughput"] > result["output_throughput"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (result[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
        assert result[f"median_{metric}_ms"] == pytest.approx(p50)
        assert result[f"mean_{metric}_ms"] > 0
    assert all(e >= t for e, t in zip(result["latencies"], result["ttfts"]))
    assert result["num_prompts"] == NUM and result["request_rate"] == 20
    assert result["burstiness"] == 1.0 and result["max_concurrency"] == 4
    assert result["model_id"] == MODEL_NAME and result["date"]
    assert 1 <= result["max_concurrent_requests"] <= 4


def test_completions(server, tmp_path, capsys):
    result = _bench(tmp_path, server.url, server.model_dir)
    _check_run(result)
    assert result["backend"] == "openai"
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    assert "P99 TPOT (ms):" in out and "Median E2EL (ms):" in out


def test_chat(server, tmp_path):
    result = _bench(
        tmp_path, server.url, server.model_dir, "--backend", "openai-chat", "--temperature", "0"
    )
    _check_run(result)
    assert result["backend"] == "openai-chat"


def test_wrong_port_counts_failures(server, tmp_path, capsys):
    with closed_port() as port:
        result = _bench(tmp_path, f"http://127.0.0.1:{port}", server.model_dir)
    assert result["completed"] == 0 and result["failed"] == NUM
    assert all(result["errors"]) and result["total_output_tokens"] == 0
    assert "Failed requests:" in capsys.readouterr().out


def test_no_torch_on_import():
    code = "import sys, vllm_mamba.entrypoints.bench_serve; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_poisson_gaps():
    rate = 5.0
    gaps = np.array(bench_serve.arrival_gaps(20000, rate, 1.0, np.random.default_rng(0)))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    smooth = np.array(bench_serve.arrival_gaps(20000, rate, 100.0, np.random.default_rng(0)))
    assert smooth.mean() == pytest.approx(1 / rate, rel=0.03) and smooth.std() < gaps.std() / 5
    assert bench_serve.arrival_gaps(3, float("inf"), 1.0, None) == [0.0] * 3
    times = bench_serve.arrival_times(50, rate, 1.0, seed=1)
    assert times == sorted(times) and times[-1] == pytest.approx(50 / rate)
    assert times == bench_serve.arrival_times(50, rate, 1.0, seed=1)
    with pytest.raises(ValueError):
        bench_serve.arrival_gaps(3, rate, 0.0, None)


def _out(ttft: float, itl: list[float], tokens: int | None, prompt_len: int = 10) -> RequestOutput:
    return RequestOutput(
        prompt_len=prompt_len,
        success=True,
        generated_text="x" * (len(itl) + 1),
        output_tokens=tokens,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=0.0,
    )


def test_metric_math():
    outs = [
        _out(0.1, [0.02, 0.02, 0.02, 0.02], 5),  # tpot (0.18 - 0.1) / 4 = 0.02
        _out(0.3, [0.05, 0.05], 5),  # usage says 5 tokens in 3 chunks: tpot 0.1 / 4 = 0.025
        _out(0.2, [], None),  # no usage, no tokenizer: 1 chunk = 1 token, no tpot
        RequestOutput(prompt_len=10, error="HTTP 500: boom"),
    ]
    result = bench_serve.calculate_metrics(outs, 2.0, None, [50, 99])
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["output_lens"] == [5, 5, 1, 0]
    assert result["total_output_tokens"] == 11 and result["total_input_tokens"] == 30
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(5.5)
    assert result["total_token_throughput"] == pytest.approx(20.5)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)  # linear interpolation
    assert result["mean_tpot_ms"] == pytest.approx(22.5)
    assert result["p50_tpot_ms"] == pytest.approx(22.5)
    assert result["mean_itl_ms"] == pytest.approx((4 * 20 + 2 * 50) / 6)
    assert result["median_itl_ms"] == pytest.approx(20.0)
    assert result["mean_e2el_ms"] == pytest.approx((180 + 400 + 200) / 3)
    assert result["errors"] == ["", "", "", "HTTP 500: boom"]
    assert result["max_concurrent_requests"] == 3
    assert bench_serve.tpot_of(outs[0], 1) is None


def _plot(*args: str) -> None:
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "plot.py"), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def test_plot_serve_and_throughput(tmp_path):
    files = []
    for system, scale in (("engine", 1.0), ("vllm", 1.5)):
        for rate in (1, 2, 4):
            row = {"request_rate": rate, "label": system, "backend": "openai"}
            for m in ("ttft", "tpot"):
                row[f"median_{m}_ms"] = 10 * rate * scale
                row[f"p99_{m}_ms"] = 20 * rate * scale
            path = tmp_path / f"{system}-{rate}.json"
            path.write_text(json.dumps(row))
            files.append(str(path))
    out = tmp_path / "latency.png"
    _plot("serve", *files, "-o", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labelled = tmp_path / "labelled.png"
    _plot("serve", *files, "--labels", *(["a"] * 3 + ["b"] * 3), "-o", str(labelled))
    assert labelled.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    compare = {"date": "x", "samples": {"engine": {"prefill 512": [100.0, 110.0]}}}
    compare["samples"]["llama.cpp"] = {"prefill 512": [90.0], "decode b1": [20.0]}
    compare["samples"]["engine"]["decode b1"] = [25.0]
    cpath = tmp_path / "compare.json"
    cpath.write_text(json.dumps(compare))
    bars = tmp_path / "bars.png"
    _plot("throughput", str(cpath), "-o", str(bars))
    assert bars.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv = tmp_path / "rows.csv"
    csv.write_text("system,workload,tokens_per_s\nengine,decode b1,25\nvllm,decode b1,30\n")
    _plot("throughput", str(csv), "-o", str(tmp_path / "csv.png"))
    assert (tmp_path / "csv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
