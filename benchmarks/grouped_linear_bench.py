"""Single-row (b1) GEMV time of the C++ `grouped_linear` kernel against `int4_linear` and
`int8_linear` on the same weight shapes: microseconds per call and the weight bytes streamed
per second (codes, scales and offsets as stored).

    python benchmarks/grouped_linear_bench.py [--rounds 5] [--calls 200] [--threads N]

Each round times every kernel once, interleaved, on random weights; the best and the median
round are printed (on a shared machine the best is the steadier figure). Not a test: numbers
depend on the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_mamba.ops import cpu_kernels  # noqa: F401  (loads the kernel build)
from vllm_mamba.ops.cpu_isa import active_level
from vllm_mamba.ops.int4_linear import quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8

SHAPES = [(2048, 2048), (6144, 2048)]  # (N, K)


def _cases(n: int, k: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """Kernel name -> (a call on x, weight bytes it streams)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    ops = torch.ops.vllm_mamba
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s32 = torch.rand(n, k // 32, generator=g) * 0.01
    o32 = -s32 * 8.0
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    i4, i4s = quantize_int4(w)
    i8, i8s = quantize_int8(w)
    return {
        "grouped 4-bit G=32 +offsets": (
            lambda x: ops.grouped_linear(x, q4, s32, o32, None, 4, 32),
            q4.nbytes + s32.nbytes + o32.nbytes,
        ),
        "int4_linear (G=32, f16 scale)": (
            lambda x: ops.int4_linear(x, i4, i4s, None),
            i4.nbytes + i4s.nbytes,
        ),
        "grouped 8-bit G=32": (
            lambda x: ops.grouped_linear(x, q8, s32, None, None, 8, 32),
            q8.nbytes + s32.nbytes,
        ),
        "int8_linear (per channel)": (
            lambda x: ops.int8_linear(x, i8, i8s, None),
            i8.nbytes + i8s.nbytes,
        ),
    }


def _time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    for _ in range(10):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"level {active_level()}, {torch.get_num_threads()} threads")
    torch.set_grad_enabled(False)
    for n, k in SHAPES:
        cases = _cases(n, k)
        x = torch.randn(1, k)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (fn, _) in cases.items():
                times[name].append(_time(fn, x, args.calls))
        for name, (_, nbytes) in cases.items():
            best, median = min(times[name]), statistics.median(times[name])
            print(
                f"{n}x{k}  {name:30s} {nbytes / 2**20:5.2f} MiB  best {best * 1e6:7.1f} us "
                f"{nbytes / best / 1e9:5.1f} GB/s  median {median * 1e6:7.1f} us "
                f"{nbytes / median / 1e9:5.1f} GB/s"
            )


if __name__ == "__main__":
    main()
