"""How near the machine's read rate the integer-dot products of one row of x stream their weights.

A b1 decode step reads every weight once, so its kernels are worth what share of the read
rate they reach. For each (N, K) shape this makes enough int8 (`w8a8`) and Q4_0-style 4-bit
(`w4a8`) copies of an N x K weight to fill `--mib` MiB (far past the caches), then times one
pass over all copies with `--rows` rows of x, interleaved with a `x.sum()` pass over 512 MiB
(`bandwidth_bound.read_rate`'s measure), and prints the medians in GB/s and each kernel's
ratio to the read rate of the same repetitions (the host's rate moves between phases; the
ratio moves less).

    python benchmarks/int_dot_bandwidth.py --threads 2
    python benchmarks/int_dot_bandwidth.py --shapes 16384x2048,2048x8192 --rows 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.int4_linear import quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.int_dot_linear import pack_w4a8, pack_w8a8

# (N, K): LFM2-1.2B's merged gate/up and down, a 1024-wide layer's, a square 4096
DEFAULT_SHAPES = "16384x1024,16384x2048,2048x8192,4096x4096"


def weights(n: int, k: int, mib: int, gen: torch.Generator) -> tuple[list, list, int, int]:
    """Copies of an N x K weight in both formats, `mib` MiB of int8; their bytes."""
    w8, w4 = [], []
    for _ in range(max(1, (mib << 20) // (n * k))):
        w = torch.randn(n, k, generator=gen) * 0.02
        q8, s8 = quantize_int8(w)
        w8.append((pack_w8a8(q8), s8))
        q4, s4 = quantize_int4(w)
        w4.append(pack_w4a8(q4, s4))
    bytes8 = sum(q.numel() + s.numel() * 4 for q, s in w8)
    bytes4 = sum(q.numel() + s.numel() * 2 for q, s in w4)
    return w8, w4, bytes8, bytes4


def pass_gbs(fn: Callable[[], object], nbytes: int) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


def measure(
    n: int, k: int, args: argparse.Namespace, gen: torch.Generator, big: torch.Tensor
) -> dict[str, float]:
    """Median GB/s of a pass over the int8 copies, the 4-bit copies and `big.sum()`."""
    ops = torch.ops.vllm_mamba
    w8, w4, bytes8, bytes4 = weights(n, k, args.mib, gen)
    x = torch.randn(args.rows, k)

    def int8_pass() -> None:
        for w in w8:
            ops.w8a8_linear(x, *w, None)

    def four_bit_pass() -> None:
        for w in w4:
            ops.w4a8_linear(x, *w, None)

    rates: dict[str, list[float]] = {"i8": [], "q4": [], "sum": []}
    for _ in range(args.reps + 2):  # the first two warm up
        rates["i8"].append(pass_gbs(int8_pass, bytes8))
        rates["q4"].append(pass_gbs(four_bit_pass, bytes4))
        rates["sum"].append(pass_gbs(lambda: float(big.sum()), big.numel() * 4))
    return {key: statistics.median(v[2:]) for key, v in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK,NxK,...")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (a chain: k + 1)")
    parser.add_argument("--mib", type=int, default=768, help="int8 weight MiB per shape")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cpu_isa.load()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    big = torch.ones(128 << 20)  # 512 MiB of float32
    instruction = torch.ops.vllm_mamba.int_dot_instruction()
    print(f"{args.threads} threads, {args.rows} row(s) of x, {instruction}")
    print("| N x K | int8 GB/s (ratio) | 4-bit GB/s (ratio) | x.sum() GB/s |")
    print("|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        med = measure(n, k, args, gen, big)
        print(
            f"| {n} x {k} | {med['i8']:.1f} ({med['i8'] / med['sum']:.2f}) "
            f"| {med['q4']:.1f} ({med['q4'] / med['sum']:.2f}) | {med['sum']:.1f} |"
        )


if __name__ == "__main__":
    main()
