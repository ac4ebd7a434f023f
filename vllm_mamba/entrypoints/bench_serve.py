"""`vllm-mamba bench serve`: online serving benchmark with `vllm bench serve`'s flags and meaning.

This module owns the `bench serve` arguments, the workload (random token-id prompts decoded
with the tokenizer, or prompts from a text/JSONL file), the request arrival schedule (Poisson
or gamma at `--request-rate`, capped by `--max-concurrency`), the async streaming OpenAI
client (httpx, SSE) and the metrics: TTFT, TPOT ((e2e - ttft) / (output tokens - 1)), ITL (gaps
between streamed chunks) and E2E latency, printed as vLLM's summary table and saved as vLLM's
results JSON. It speaks plain OpenAI HTTP (`/v1/completions`, `/v1/chat/completions`), so it
measures a vLLM server or llama-server as well as `vllm-mamba serve`.

A failed request (refused connection, HTTP error, error event in the stream) is counted with
its error; it never ends the run. Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vllm_mamba.entrypoints.cli_args import HelpFormatter

DEFAULT_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
BACKENDS = ("openai", "openai-chat")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}

EXAMPLES = """examples:
  vllm-mamba serve --port 8000 &                      # the shipped model, offline
  vllm-mamba bench serve --model vllm-mamba/tiny-stdlib --num-prompts 50 --random-input-len 64
  vllm-mamba serve state-spaces/mamba-130m-hf --port 8000 &
  vllm-mamba bench serve --model state-spaces/mamba-130m-hf --num-prompts 200 \\
      --request-rate 4 --random-input-len 256 --random-output-len 64 --save-result
  vllm-mamba bench serve --backend openai-chat --endpoint /v1/chat/completions \\
      --base-url http://127.0.0.1:8080 --model m --tokenizer state-spaces/mamba-130m-hf
  vllm-mamba bench serve --dataset-name prompt-file --dataset-path prompts.jsonl --num-prompts 50
"""


# ----------------------------------------------------------------------------- arguments


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `serve` in the `bench` subcommands; returns its parser."""
    parser = subparsers.add_parser(
        "serve",
        help="latency and throughput of a running OpenAI-compatible server",
        description="Online serving benchmark against a running server (vLLM's meaning).",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_cli_args(parser)
    parser.set_defaults(func=run, parser=parser)
    return parser


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `vllm bench serve` this benchmark implements, with vLLM's names."""
    server = parser.add_argument_group("server")
    server.add_argument("--backend", default="openai", choices=BACKENDS, help="API flavour")
    server.add_argument("--base-url", default=None, help="server URL instead of host and port")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--endpoint",
        default=DEFAULT_ENDPOINT,
        help=f"API path ({CHAT_ENDPOINT} with --backend openai-chat)",
    )
    server.add_argument(
        "--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, if set)"
    )
    server.add_argument(
        "--header", metavar="KEY=VALUE", nargs="*", help="extra headers of every request"
    )
    server.add_argument(
        "--model", default=None, help="model name (default: the server's first /v1/models)"
    )
    server.add_argument(
        "--served-model-name", default=None, help="name sent in requests (default: --model)"
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer: a directory, a shipped name or a hub id, as serve's MODEL (default: "
        "--model)",
    )
    server.add_argument("--trust-remote-code", action="store_true")
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "prompt-file", "custom"),
        help="random token ids, or a text/JSONL file of prompts (custom: vLLM's name for it)",
    )
    data.add_argument("--dataset-path", default=None, help="the prompt file")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests in all")
    data.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    data.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    data.add_argument(
        "--output-len", type=int, default=None, help="sets --random/custom-output-len"
    )
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]",
    )
    data.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix tokens")
    data.add_argument(
        "--custom-output-len", type=int, default=256, help="max tokens of prompt-file requests"
    )
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s (inf: all at time 0; else Poisson or gamma arrivals)",
    )
    traffic.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1: Poisson; < 1 burstier; > 1 more uniform)",
    )
    traffic.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most"
    )
    traffic.add_argument("--num-warmups", type=int, default=0, help="untimed requests first")
    traffic.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    sampling = parser.add_argument_group("sampling parameters")
    sampling.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (vLLM's extension)"
    )
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float)):
        sampling.add_argument(f"--{name}", type=kind, default=None, help="sent when given")
    sampling.add_argument(
        "--extra-body", type=json.loads, default=None, help="JSON object merged into each body"
    )
    out = parser.add_argument_group("results")
    out.add_argument("--label", default=None, help="results label (default: --backend)")
    out.add_argument("--save-result", action="store_true", help="write the results JSON")
    out.add_argument(
        "--save-detailed",
        action="store_true",
        help="accepted for vLLM compatibility; per-request lists are always saved",
    )
    out.add_argument("--result-dir", default=None, help="directory of the results JSON")
    out.add_argument(
        "--result-filename",
        default=None,
        help="results file name (default: {label}-{rate}qps[-concurrencyN]-{model}-{date}.json)",
    )
    out.add_argument(
        "--metadata", metavar="KEY=VALUE", nargs="*", help="extra fields of the results JSON"
    )
    out.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help="metrics whose percentiles are reported: ttft,tpot,itl,e2el",
    )
    out.add_argument(
        "--metric-percentiles", default="99", help='percentiles reported, e.g. "50,90,99"'
    )


# ----------------------------------------------------------------------------- workload


@dataclass
class SampleRequest:
    """One request of the workload."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def _lengths(base: int, ratio: float, num: int, rng: Any) -> list[int]:
    """`num` lengths drawn uniformly from `[base * (1 - ratio), base * (1 + ratio)]`."""
    if not 0 <= ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    low = max(1, math.floor(base * (1 - ratio)))
    high = max(low, math.ceil(base * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def random_requests(
    tokenizer: Any,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
) -> list[SampleRequest]:
    """Prompts of random non-special token ids decoded to text (vLLM's `random` dataset).

    Each prompt is decoded, re-encoded and cut to its drawn length, so that it tokenizes to
    about that many tokens; `prompt_len` is the length of the final text's encoding.
    """
    import numpy as np

    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    prefix = rng.choice(allowed, size=prefix_len).tolist() if prefix_len else []
    in_lens = _lengths(input_len, range_ratio, num, rng)
    out_lens = _lengths(output_len, range_ratio, num, rng)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        ids = prefix + rng.choice(allowed, size=in_len).tolist()
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[: prefix_len + in_len]
        text = tokenizer.decode(ids)
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(SampleRequest(text, prompt_len, out_len))
    return requests


def read_prompt_file(path: str) -> list[str]:
    """Prompts of a file: JSONL objects with `prompt` (or `text`), else one prompt a line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                row = json.loads(line)
                prompts.append(str(row.get("prompt", row.get("text", ""))))
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def file_requests(
    tokenizer: Any, path: str, num: int, output_len: int, seed: int
) -> list[SampleRequest]:
    """`num` prompts of the file (shuffled with `seed`, cycled when the file has fewer)."""
    import numpy as np

    prompts = read_prompt_file(path)
    order = np.random.default_rng(seed).permutation(len(prompts)).tolist()
    requests = []
    for i in range(num):
        prompt = prompts[order[i % len(prompts)]]
        n = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer else 0
        requests.append(SampleRequest(prompt, n, output_len))
    return requests


# ----------------------------------------------------------------------------- arrivals


def arrival_gaps(num: int, rate: float, burstiness: float, rng: Any) -> list[float]:
    """Seconds between consecutive requests: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    which is exponential (a Poisson process) at burstiness 1; all 0 at an infinite rate."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if math.isinf(rate):
        return [0.0] * num
    if math.isinf(burstiness):
        return [1.0 / rate] * num
    return [float(x) for x in rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num)]


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, seconds from the start: the cumulative gaps, scaled so that
    the last is `num / rate` (as vLLM does, which steadies throughput across seeds)."""
    import numpy as np

    gaps = arrival_gaps(num, rate, burstiness, np.random.default_rng(seed))
    times = list(np.cumsum(gaps)) if gaps else []
    if times and times[-1] > 0 and not math.isinf(rate):
        scale = (num / rate) / times[-1]
        times = [t * scale for t in times]
    return [float(t) for t in times]


# ----------------------------------------------------------------------------- client


@dataclass
class RequestOutput:
    """What one streamed request measured (seconds; `start_time` on the perf counter)."""

    prompt_len: int = 0
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None  # from the server's usage, when it sent one
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


def _sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line, else None."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        )
    return choices[0].get("text") or ""


async def send_request(
    client: Any,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    prompt_len: int,
    chat: bool,
) -> RequestOutput:
    """Streams one request; every failure becomes `error` on the returned output."""
    out = RequestOutput(prompt_len=prompt_len)
    start = time.perf_counter()
    out.start_time = start
    last = start
    texts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {response.status_code}: {body[:500]}"
                return out
            async for line in response.aiter_lines():
                data = _sse_data(line.strip())
                if data is None or data == "":
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return out
                now = time.perf_counter()
                text = _chunk_text(chunk, chat)
                if text:
                    if not texts:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    texts.append(text)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
        if not texts:
            out.error = "never received a streamed token to time TTFT"
            return out
        out.generated_text = "".join(texts)
        out.latency = last - start
        out.success = True
    except Exception as err:  # noqa: BLE001 - every failure is counted, none ends the run
        out.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return out


def build_payload(
    req: SampleRequest, model: str, chat: bool, ignore_eos: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """The streamed request body of `req` (usage requested in the last chunk)."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra)
    return body


async def _timed_requests(
    requests: Sequence[SampleRequest], times: Sequence[float]
) -> AsyncIterator[SampleRequest]:
    start = time.perf_counter()
    for req, at in zip(requests, times):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield req


async def run_benchmark(
    requests: Sequence[SampleRequest],
    api_url: str,
    model: str,
    chat: bool,
    headers: dict[str, str],
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    ignore_eos: bool,
    extra_body: dict[str, Any],
    num_warmups: int = 0,
    show_progress: bool = True,
) -> tuple[list[RequestOutput], float]:
    """Sends every request on its arrival time, at most `max_concurrency` in flight.

    Returns:
        Each request's output, in the order of `requests`, and the run's duration (seconds).
    """
    import httpx

    limit = max_concurrency or max(len(requests), 1)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if show_progress:
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            bar = tqdm(total=len(requests), file=sys.stderr)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(req: SampleRequest) -> RequestOutput:
            payload = build_payload(req, model, chat, ignore_eos, extra_body)
            if semaphore is None:
                out = await send_request(client, api_url, payload, headers, req.prompt_len, chat)
            else:
                async with semaphore:
                    out = await send_request(
                        client, api_url, payload, headers, req.prompt_len, chat
                    )
            if bar is not None:
                bar.update(1)
            return out

        if num_warmups > 0 and requests:
            print(f"Warming up with {num_warmups} requests...")
            warm = requests[0]
            await asyncio.gather(
                *(
                    send_request(
                        client,
                        api_url,
                        build_payload(warm, model, chat, ignore_eos, extra_body),
                        headers,
                        warm.prompt_len,
                        chat,
                    )
                    for _ in range(num_warmups)
                )
            )
        times = arrival_times(len(requests), request_rate, burstiness, seed)
        started = time.perf_counter()
        tasks = []
        async for req in _timed_requests(requests, times):
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return list(outputs), duration


# ----------------------------------------------------------------------------- metrics


def output_len_of(out: RequestOutput, tokenizer: Any | None) -> int:
    """Output tokens of a successful request: the server's usage, else the tokenizer's count
    of the text, else the number of streamed chunks."""
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return len(out.itl) + 1


def tpot_of(out: RequestOutput, output_len: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
    if output_len <= 1:
        return None
    return (out.latency - out.ttft) / (output_len - 1)


def _stats(values: list[float], percentiles: Sequence[float]) -> dict[str, Any]:
    """mean, median, std and percentiles (numpy's linear interpolation) in milliseconds."""
    import numpy as np

    data = values or [0.0]
    return {
        "mean": float(np.mean(data)) * 1000,
        "median": float(np.median(data)) * 1000,
        "std": float(np.std(data)) * 1000,
        "percentiles": [(p, float(np.percentile(data, p)) * 1000) for p in percentiles],
    }


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    tokenizer: Any | None,
    percentiles: Sequence[float],
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
) -> dict[str, Any]:
    """vLLM's result fields of a run: counts, throughputs, per-request lists and, for each
    metric in `percentile_metrics`, `mean_/median_/std_/p{P}_{metric}_ms`."""
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_input = 0
    completed = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        n = output_len_of(out, tokenizer)
        output_lens.append(n)
        total_input += out.prompt_len
        tpot = tpot_of(out, n)
        if tpot is not None:
            tpots.append(tpot)
        ttfts.append(out.ttft)
        itls.extend(out.itl)
        e2els.append(out.latency)
        completed += 1
    total_output = sum(output_lens)
    duration = max(duration, 1e-9)
    peak_tokens, peak_concurrency = _peaks([o for o in outputs if o.success])
    result: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for metric in percentile_metrics:
        stats = _stats(values[metric], percentiles)
        result[f"mean_{metric}_ms"] = stats["mean"]
        result[f"median_{metric}_ms"] = stats["median"]
        result[f"std_{metric}_ms"] = stats["std"]
        for p, value in stats["percentiles"]:
            result[f"p{_percentile_word(p)}_{metric}_ms"] = value
    return result


def _peaks(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """Most output tokens (streamed chunks) in one wall-clock second, and most requests in
    flight at once."""
    if not outputs:
        return 0.0, 0
    t0 = min(o.start_time for o in outputs)
    buckets: dict[int, int] = {}
    events: list[tuple[float, int]] = []
    for o in outputs:
        t = o.start_time + o.ttft
        stamps = [t]
        for gap in o.itl:
            t += gap
            stamps.append(t)
        for s in stamps:
            buckets[int(s - t0)] = buckets.get(int(s - t0), 0) + 1
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    events.sort()
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return float(max(buckets.values())), peak


def format_summary(
    result: dict[str, Any],
    max_concurrency: int | None,
    request_rate: float,
    percentile_metrics: Sequence[str],
    percentiles: Sequence[float],
) -> str:
    """vLLM's `Serving Benchmark Result` table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{}}".format(label, value, fmt).rstrip())

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for metric in percentile_metrics:
        name, header = _METRIC_HEADERS[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"], ".2f")
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"], ".2f")
        for p in percentiles:
            word = _percentile_word(p)
            row(f"P{word} {name} (ms):", result[f"p{word}_{metric}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def _key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        pairs[key.strip()] = value.strip()
    return pairs


def _first_model(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        reply = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        reply.raise_for_status()
        return reply.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        raise ConnectionError(
            f"could not read the first model from {base_url}/v1/models (give --model): {err}"
        ) from err


def _load_tokenizer(name: str, trust_remote_code: bool) -> Any:
    """The tokenizer of `name`, resolved as every subcommand resolves a model (a shipped
    name, a directory, or a hub id that fails at once, in one line, when the hub is out of
    reach).

    Raises:
        FileNotFoundError: naming `--tokenizer`.
    """
    from vllm_mamba.model_resolver import TOKENIZER_FILES, resolve_model_path

    try:
        path = resolve_model_path(name, allow_patterns=TOKENIZER_FILES)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())  # one line
        message = f"could not load the tokenizer {name!r} (give --tokenizer): {reason}"
        raise FileNotFoundError(message) from err


def _resolve(args: argparse.Namespace) -> tuple[str, str, bool]:
    """The base URL, the request URL and whether the API is chat."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint
    if args.backend == "openai-chat" and endpoint == DEFAULT_ENDPOINT:
        endpoint = CHAT_ENDPOINT
    chat = args.backend == "openai-chat" or endpoint.rstrip("/").endswith("chat/completions")
    return base, f"{base}{endpoint}", chat


def result_filename(args: argparse.Namespace, model_id: str, label: str, date: str) -> str:
    """Where `--save-result` writes (vLLM's default name under `--result-dir`)."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (
        f"{label}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark of `args`; prints the summary and, with `--save-result`, saves it.
    A bad option or tokenizer raises `ValueError` / `FileNotFoundError`, a server out of
    reach `ConnectionError` (the command's exit statuses 2 and 1)."""
    benchmark(args)
    return 0


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run of `args`: workload, requests, metrics, summary, results JSON."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {unknown}; allowed: {PERCENTILE_METRICS}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.custom_output_len = args.output_len
    base_url, api_url, chat = _resolve(args)
    headers = {"Content-Type": "application/json"}
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers.update(_key_values(args.header, "--header"))
    metadata = _key_values(args.metadata, "--metadata")
    model_id = args.model or _first_model(base_url, headers)
    model_name = args.served_model_name or model_id
    tokenizer_id = args.tokenizer or model_id
    if args.dataset_name == "random":
        if args.dataset_path:
            raise ValueError("--dataset-path goes with --dataset-name prompt-file")
        tokenizer = _load_tokenizer(tokenizer_id, args.trust_remote_code)
        requests = random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    else:
        if not args.dataset_path:
            raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
        tokenizer = _load_tokenizer(tokenizer_id, args.trust_remote_code)
        requests = file_requests(
            tokenizer, args.dataset_path, args.num_prompts, args.custom_output_len, args.seed
        )
    sampling = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
    }
    extra = {k: v for k, v in sampling.items() if v is not None} | (args.extra_body or {})
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    outputs, duration = asyncio.run(
        run_benchmark(
            requests,
            api_url,
            model_name,
            chat,
            headers,
            args.request_rate,
            args.burstiness,
            args.max_concurrency,
            args.seed,
            args.ignore_eos,
            extra,
            num_warmups=args.num_warmups,
            show_progress=not args.disable_tqdm,
        )
    )
    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"Failed requests during benchmark run detected (capping to 10): {len(failed)}")
        for i, out in enumerate(failed[:10]):
            print(f"Error {i}: {out.error}")
    if len(failed) == len(outputs):
        print("warning: all requests failed; check the server URL, --model and --endpoint")
    bench = calculate_metrics(outputs, duration, tokenizer, percentiles, metrics)
    print(format_summary(bench, args.max_concurrency, args.request_rate, metrics, percentiles))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = args.label or args.backend
    result: dict[str, Any] = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
        **metadata,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **bench,
    }
    if args.save_result:
        path = result_filename(args, model_id, label, date)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"Results saved to {path}")
    return result
