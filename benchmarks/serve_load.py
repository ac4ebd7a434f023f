"""Load test of a running OpenAI-compatible server: concurrent streaming completion clients.

Each of `--concurrency` clients sends streamed `/v1/completions` requests back to back until
`--num-requests` have been sent in all; every request generates exactly `--max-tokens`
tokens (`ignore_eos`). Reports requests/s, output tokens/s and the p50/p99 time to first
token (arrival of the first streamed text), measured on the client.

    vllm-mamba serve state-spaces/mamba-130m-hf &
    python benchmarks/serve_load.py --concurrency 32 --num-requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class RequestResult:
    """What one streamed request measured."""

    ttft_s: float
    latency_s: float
    output_tokens: int


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100) with linear interpolation."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    """Streams one completion; returns its TTFT, latency and output token count."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return RequestResult(ttft or float("nan"), time.perf_counter() - start, tokens)


async def run_load(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """Runs the clients; returns every result and the wall time."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=None, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        counter = iter(range(args.num_requests))
        results: list[RequestResult] = []

        async def worker() -> None:
            for i in counter:
                body = {
                    "model": model,
                    "prompt": f"{args.prompt} {i}",
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                results.append(await one_request(client, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return results, time.perf_counter() - start


def main() -> None:
    """Parses the flags, runs the load and prints the figures."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--model", default=None, help="model name (default: the first served)")
    parser.add_argument("--api-key", default=None, help="bearer token, if the server needs one")
    parser.add_argument("--concurrency", type=int, default=32, help="clients at once")
    parser.add_argument("--num-requests", type=int, default=128, help="requests in all")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog, request")
    args = parser.parse_args()
    results, wall = asyncio.run(run_load(args))
    ttfts = [r.ttft_s for r in results]
    out_tokens = sum(r.output_tokens for r in results)
    print(f"requests: {len(results)} at concurrency {args.concurrency}, wall {wall:.2f} s")
    print(f"throughput: {len(results) / wall:.2f} req/s, {out_tokens / wall:.1f} output tok/s")
    p50, p99 = percentile(ttfts, 50) * 1000, percentile(ttfts, 99) * 1000
    print(f"TTFT: p50 {p50:.0f} ms, p99 {p99:.0f} ms")
    print(f"latency: mean {statistics.mean(r.latency_s for r in results):.2f} s")


if __name__ == "__main__":
    main()
