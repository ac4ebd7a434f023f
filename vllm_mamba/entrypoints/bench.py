"""`vllm-mamba bench latency|throughput|serve`: benchmarks with vLLM's meaning.

- `latency`: one batch of `--batch-size` prompts of `--input-len` tokens, each generating
  exactly `--output-len` tokens; the end-to-end seconds of `LLM.generate` per iteration over
  `--num-iters` iterations after `--num-iters-warmup`, as the average and percentiles.
- `throughput`: `--num-prompts` requests of `--input-len` / `--output-len` tokens through one
  `LLM.generate` call (continuous batching); requests/s, total tokens/s and output tokens/s.

Prompts are random token ids and every request ignores EOS, so lengths are exact. Both also
report memory: the state bytes one sequence holds, the weight bytes, the peak resident memory
of the process and, with `--memory-budget-gb`, how many sequences fit that budget.

`serve` (online, against a running server) lives in `bench_serve.py`.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.entrypoints import bench_serve
from vllm_mamba.entrypoints.cli_args import HelpFormatter, add_model_args
from vllm_mamba.model_zoo import DEFAULT_MODEL

PERCENTILES = (10, 25, 50, 75, 90, 99)

EXAMPLES = """examples (the shipped model, offline):
  vllm-mamba bench latency --batch-size 1 --input-len 16 --output-len 64
  vllm-mamba bench throughput --num-prompts 64 --threads 2
  vllm-mamba bench latency --dtype bfloat16 --memory-budget-gb 4 --output-json lat.json
a running server (vllm-mamba, vLLM or llama-server):
  vllm-mamba bench serve --port 8000 --num-prompts 100 --request-rate 4 --save-result
a mamba-130m-shaped model with random weights (see benchmarks/README.md):
  python benchmarks/make_model.py /tmp/mamba-130m-random
  vllm-mamba bench throughput --model /tmp/mamba-130m-random --num-prompts 64 --threads 2
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers `bench` with its `latency` and `throughput` subcommands."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark latency or throughput",
        description="Offline latency and throughput benchmarks (vLLM's meaning).",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="{latency,throughput,serve}")
    latency = sub.add_parser(
        "latency",
        help="seconds per batch, end to end",
        description="End-to-end seconds of one batch: prefill plus every decode step.",
        formatter_class=HelpFormatter,
    )
    _add_common_args(latency, input_len=32, output_len=128)
    latency.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    latency.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations")
    latency.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    latency.set_defaults(func=run_latency)
    throughput = sub.add_parser(
        "throughput",
        help="requests/s and tokens/s of many requests",
        description="Requests/s and tokens/s of many requests through one LLM.generate call.",
        formatter_class=HelpFormatter,
    )
    _add_common_args(throughput, input_len=128, output_len=128)
    throughput.add_argument("--num-prompts", type=int, default=64, help="requests in all")
    throughput.set_defaults(func=run_throughput)
    bench_serve.add_parser(sub)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _add_common_args(parser: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    add_model_args(parser, DEFAULT_MODEL)
    work = parser.add_argument_group("workload")
    work.add_argument("--input-len", type=int, default=input_len, help="prompt tokens")
    work.add_argument("--output-len", type=int, default=output_len, help="generated tokens")
    work.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    work.add_argument(
        "--memory-budget-gb", type=float, default=None, help="report sequences fitting this"
    )
    work.add_argument(
        "--output-json", "--json", dest="output_json", default=None, help="write results here"
    )
    EngineArgs.add_cli_args(parser, skip=("model", "served_model_name"))
    parser.set_defaults(parser=parser)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[dict[str, Any]]:
    """`num` prompts of exactly `length` random token ids in `[0, vocab_size)`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num, length), generator=g)
    return [{"prompt_token_ids": row} for row in ids.tolist()]


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100) with linear interpolation."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def memory_report(llm: Any, budget_gb: float | None) -> dict[str, Any]:
    """State bytes per sequence, weight bytes, peak RSS and sequences fitting `budget_gb`.

    Args:
        llm: a loaded `LLM`.
        budget_gb: memory budget in GiB, or None.

    Returns:
        `state_bytes_per_seq`, `weight_bytes`, `kv_cache_bytes` (0 without attention
        layers), `peak_rss_bytes` and, with a budget,
        `budget_bytes` and `max_concurrent_seqs` (budget minus weights, over the state bytes).
    """
    engine = llm.llm_engine
    state = engine.cache.bytes_per_slot()
    weights = engine.model.weight_bytes()
    report: dict[str, Any] = {
        "state_bytes_per_seq": state,
        "weight_bytes": weights,
        "kv_cache_bytes": engine.kv_cache.nbytes() if engine.kv_cache is not None else 0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if budget_gb is not None:
        budget = int(budget_gb * 2**30)
        report["budget_bytes"] = budget
        report["max_concurrent_seqs"] = max(0, (budget - weights) // state)
    return report


def _load(args: argparse.Namespace, num_seqs: int) -> Any:
    """The `LLM` of `args`, with room for `num_seqs` sequences of input plus output.

    `--seed` seeds both the random prompts and the engine's sampler.
    """

    from vllm_mamba import LLM

    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.max_num_seqs = min(args.max_num_seqs, num_seqs)
    engine_args.max_model_len = args.max_model_len or max(2048, args.input_len + args.output_len)
    return LLM.from_engine_args(engine_args)


def _requests(llm: Any, args: argparse.Namespace, num: int) -> tuple[list[dict], Any]:
    """Random prompts and sampling params that generate exactly `--output-len` tokens."""
    from vllm_mamba import SamplingParams

    vocab = llm.llm_engine.config.model_config.vocab_size
    vocab = min(vocab, len(llm.get_tokenizer()))
    prompts = random_prompts(num, args.input_len, vocab, args.seed)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True
    )
    return prompts, params


def run_latency(args: argparse.Namespace) -> int:
    """Times whole-batch generation; prints the average and percentile latencies."""
    if args.batch_size < 1 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size and --num-iters must be >= 1, warmup >= 0")
    llm = _load(args, args.batch_size)
    prompts, params = _requests(llm, args, args.batch_size)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    avg = sum(latencies) / len(latencies)
    results = {
        "avg_latency": avg,
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
        "output_tokens_per_second": args.batch_size * args.output_len / avg,
        "memory": memory_report(llm, args.memory_budget_gb),
    }
    print(f"Avg latency: {avg:.4f} seconds")
    for q, value in results["percentiles"].items():
        print(f"{q}% percentile latency: {value:.4f} seconds")
    print(f"Output tokens/s (batch {args.batch_size}): {results['output_tokens_per_second']:.2f}")
    _print_memory(results["memory"])
    _write_json(args.output_json, results)
    return 0


def run_throughput(args: argparse.Namespace) -> int:
    """Runs all requests through one `LLM.generate`; prints requests/s and tokens/s."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    llm = _load(args, args.num_prompts)
    prompts, params = _requests(llm, args, args.num_prompts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total_tokens = out_tokens + args.num_prompts * args.input_len
    results = {
        "elapsed_time": elapsed,
        "num_requests": args.num_prompts,
        "total_num_tokens": total_tokens,
        "num_output_tokens": out_tokens,
        "requests_per_second": args.num_prompts / elapsed,
        "tokens_per_second": total_tokens / elapsed,
        "output_tokens_per_second": out_tokens / elapsed,
        "memory": memory_report(llm, args.memory_budget_gb),
    }
    print(
        f"Throughput: {results['requests_per_second']:.2f} requests/s, "
        f"{results['tokens_per_second']:.2f} total tokens/s, "
        f"{results['output_tokens_per_second']:.2f} output tokens/s"
    )
    _print_memory(results["memory"])
    _write_json(args.output_json, results)
    return 0


def _print_memory(report: dict[str, Any]) -> None:
    mib = 2**20
    print(f"State per sequence: {report['state_bytes_per_seq'] / mib:.3f} MiB")
    print(f"Weights: {report['weight_bytes'] / mib:.1f} MiB")
    if report["kv_cache_bytes"]:
        print(f"KV cache: {report['kv_cache_bytes'] / mib:.1f} MiB")
    print(f"Peak resident memory: {report['peak_rss_bytes'] / mib:.1f} MiB")
    if "max_concurrent_seqs" in report:
        print(
            f"Concurrent sequences in {report['budget_bytes'] / 2**30:g} GiB: "
            f"{report['max_concurrent_seqs']}"
        )


def _write_json(path: str | None, results: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
