"""The ops of a hybrid's prefill, alone, at Qwen3.5-0.8B's shapes: where a 512-token prompt goes.

Times each C++ op of a Qwen3.5-0.8B-shaped prefill of `--tokens` tokens (one sequence, no
history) at `--threads` threads, on random inputs, medians of `--reps` calls after two warm-up
calls:

- `causal_conv1d_varlen`: the width-4 depthwise conv of a GDN layer (6,144 channels, SiLU);
- `gated_delta_varlen`: the chunked delta rule of a GDN layer (16 heads of 128, chunks of 64);
- `paged_prefill_attention`: an attention layer (8 query heads, 2 kv heads of 256, blocks of 16);
- `w8a8_linear` / `w4a8_linear`: the integer-dot GEMMs of the layer projections (GMAC/s printed).

    python benchmarks/prefill_ops.py --threads 2
    python benchmarks/prefill_ops.py --threads 1 --only linear
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from vllm_mamba.ops import cpu_isa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gated_delta_kernels import median_us  # noqa: E402

# (K, N) of the projections a Qwen3.5-0.8B layer multiplies by: a GDN layer's [q | k | v] and z,
# its output; the MLP's gate (and up) and down; an attention layer's queries (with the gate).
LINEAR_SHAPES = [(1024, 6144), (1024, 2048), (2048, 1024), (1024, 3584), (3584, 1024), (1024, 4096)]


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls of fn after two warm-up calls."""
    return median_us(fn, reps) / 1e3


def bench_conv(tokens: int, reps: int) -> None:
    ops = torch.ops.vllm_mamba
    x, w = torch.randn(tokens, 6144), torch.randn(6144, 4)
    states = torch.zeros(2, 6144, 3)
    qsl, slots = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    init = torch.tensor([False])
    ms = median_ms(
        lambda: ops.causal_conv1d_varlen(x, w, None, states, qsl, slots, init, True), reps
    )
    print(f"causal_conv1d_varlen  T {tokens} x 6144, width 4: {ms:.2f} ms")


def bench_gdn(tokens: int, reps: int) -> None:
    ops = torch.ops.vllm_mamba
    heads, dim = 16, 128
    q, k, v = (torch.randn(tokens, heads, dim) for _ in range(3))
    a, b = torch.randn(tokens, heads), torch.randn(tokens, heads)
    a_log, dt_bias = torch.randn(heads) * 0.1, torch.randn(heads)
    states = torch.zeros(2, heads, dim, dim)
    qsl, slots = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    init = torch.tensor([False])
    ms = median_ms(
        lambda: ops.gated_delta_varlen(
            q, k, v, a, b, a_log, dt_bias, 1.0, states, qsl, slots, init, 64
        ),
        reps,
    )
    print(f"gated_delta_varlen    T {tokens}, 16 heads of 128, chunks of 64: {ms:.2f} ms")


def bench_attention(tokens: int, reps: int) -> None:
    ops = torch.ops.vllm_mamba
    q_heads, kv_heads, dim, block = 8, 2, 256, 16
    blocks = (tokens + block - 1) // block
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, dim) for _ in range(2))
    q = torch.randn(tokens, q_heads, dim)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    ms = median_ms(
        lambda: ops.paged_prefill_attention(
            q, k_cache, v_cache, tables, qsl, lens, dim**-0.5, 0, None, None
        ),
        reps,
    )
    print(f"paged_prefill_attention T {tokens}, 8 / 2 heads of 256, causal: {ms:.2f} ms")


def bench_linear(tokens: int, reps: int) -> None:
    from vllm_mamba.ops.int4_linear import quantize_int4
    from vllm_mamba.ops.int8_linear import quantize_int8
    from vllm_mamba.ops.int_dot_linear import pack_w4a8, pack_w8a8

    ops = torch.ops.vllm_mamba
    for name in ("w8a8", "w4a8"):
        macs, seconds = 0, 0.0
        for k, n in LINEAR_SHAPES:
            w, x = torch.randn(n, k) * 0.05, torch.randn(tokens, k)
            if name == "w8a8":
                qweight, scale = quantize_int8(w)
                op, args = ops.w8a8_linear, (x, pack_w8a8(qweight), scale, None)
            else:
                op, args = ops.w4a8_linear, (x, *pack_w4a8(*quantize_int4(w)), None)
            ms = median_ms(lambda op=op, args=args: op(*args), reps)
            macs += tokens * k * n
            seconds += ms / 1e3
            rate = tokens * k * n / ms / 1e6
            print(f"{name}_linear  M {tokens} K {k} N {n}: {ms:.2f} ms, {rate:.0f} GMAC/s")
        print(f"{name}_linear  all shapes: {macs / seconds / 1e9:.0f} GMAC/s")


BENCHES = {
    "conv": bench_conv,
    "gdn": bench_gdn,
    "attention": bench_attention,
    "linear": bench_linear,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--only", choices=sorted(BENCHES), action="append")
    args = parser.parse_args()
    cpu_isa.load()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, kernels {cpu_isa.active_level()}")
    for name in args.only or BENCHES:
        BENCHES[name](args.tokens, args.reps)


if __name__ == "__main__":
    main()
