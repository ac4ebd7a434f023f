"""CPU speed of one paged decode-attention step: the C++ kernel against the reference.

One attention layer of Jamba's shape by default (32 query heads, 8 kv heads, head dim 128,
block size 16, float32), a decode step of `--batches` rows with every row at `--contexts`
tokens of cached context; block tables are shuffled so the blocks are scattered as in a busy
pool. Reports the medians of `--reps` timed steps as rows per second (tokens/s of this layer
alone) and the step time, and the ratio of the step at the longest context to the shortest.

    python benchmarks/attention_bench.py
    python benchmarks/attention_bench.py --threads 2 --batches 1,32 --contexts 128,4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.paged_attention import paged_decode_attention_ref


def make_step(
    batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype,
) -> dict:  # fmt: skip
    """Keyword arguments of one decode step: caches, shuffled block tables, lengths, queries."""
    blocks_per_row = (context + block_size - 1) // block_size
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(num_blocks).to(torch.int32).view(batch, blocks_per_row)
    return {
        "query": torch.randn(batch, q_heads, head_dim).to(dtype),
        "k_cache": torch.randn(shape).to(dtype),
        "v_cache": torch.randn(shape).to(dtype),
        "block_tables": tables,
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
        "scale": head_dim**-0.5,
    }


def median_seconds(fn: Callable[..., torch.Tensor], args: dict, reps: int) -> float:
    """Median wall time of `reps` calls after one warm-up call."""
    fn(**args)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(**args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32", help="decode rows per step, comma-separated")
    parser.add_argument("--contexts", default="128,4096", help="context lengths, comma-separated")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the C++ extension is not built: pip install --no-build-isolation -e .")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(
        f"decode attention, {args.q_heads}/{args.kv_heads} heads x {args.head_dim}, block "
        f"{args.block_size}, {args.dtype}, {args.threads} threads, median of {args.reps}"
    )
    print(f"{'batch':>5} {'context':>7} {'C++ tok/s':>11} {'C++ ms':>8} {'ref tok/s':>10} "
          f"{'ref ms':>8} {'speedup':>8}")  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        step_ms = {}
        for context in contexts:
            step = make_step(batch, context, args.q_heads, args.kv_heads, args.head_dim,
                             args.block_size, dtype)  # fmt: skip
            cpp = median_seconds(cpu_kernels.paged_decode_attention, step, args.reps)
            ref = median_seconds(paged_decode_attention_ref, step, max(3, args.reps // 4))
            step_ms[context] = cpp * 1e3
            print(f"{batch:>5} {context:>7} {batch / cpp:>11.0f} {cpp * 1e3:>8.3f} "
                  f"{batch / ref:>10.0f} {ref * 1e3:>8.3f} {ref / cpp:>7.1f}x")  # fmt: skip
        longest, shortest = step_ms[max(contexts)], step_ms[min(contexts)]
        print(f"      C++ step at {max(contexts)} / at {min(contexts)}: {longest / shortest:.1f}x")


if __name__ == "__main__":
    main()
