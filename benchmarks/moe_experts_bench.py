"""The routed experts of one MoE layer for a prefill chunk: the grouped kernel
(`torch.ops.vllm_mamba.moe_experts`, `csrc/moe_experts.cpp`) against the unfused layer's loop
(`layers.moe.dispatch_experts`: per chosen expert, a gather, the gate and up products, the
activation, the down product and a scatter-add, from Python, through the same integer-dot
linear ops).

Random stacked experts at Qwen3.6-35B-A3B's shapes by default (hidden 2048, 256 experts of 512,
top 8), quantised as `--quantization` (w8a8, w4a8 or w4a8_k; or `bfloat16`: bfloat16 weights,
the loop through bfloat16 `mm` as the unfused layer's), routed by a random top-k (about
`tokens * k / E` rows an expert); prints the medians of `--reps` interleaved repetitions in ms,
the kernel's multiply-accumulates per second, and the ratio. `--min-gemm-rows` lists the
per-expert row counts at which to time the GEMM path against the rows path alone (how
`kMinGemmRows` was chosen): one expert's products at each count. `VLLM_MAMBA_BF16_GEMM=0` runs
the bfloat16 kernel's experts through `mm` in place of `bf16_gemm` (how `kBf16MaxRows` was
chosen: `--tokens` sets the rows per expert, about `tokens * k / E`).

    python benchmarks/moe_experts_bench.py --tokens 512 --quantization w4a8
    python benchmarks/moe_experts_bench.py --min-gemm-rows 4,6,8,12,16
    python benchmarks/moe_experts_bench.py --quantization bfloat16 --tokens 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from vllm_mamba.layers.moe import dispatch_experts
from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.int4_linear import quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.int_dot_linear import pack_w4a8, pack_w8a8
from vllm_mamba.ops.q4k import quantize_q4k


def quantised(rows: int, cols: int, fmt: str, gen: torch.Generator, chunk: int = 8192) -> tuple:
    """A random `(rows, cols)` weight quantised as `fmt`, in the strip layout (made in chunks of
    rows, whole strips each, so that the float copy stays small)."""
    codes, scales = [], []
    for r0 in range(0, rows, chunk):
        w = torch.randn(min(chunk, rows - r0), cols, generator=gen) * cols**-0.5
        if fmt == "w8a8":
            q, s = quantize_int8(w)
        else:
            q, s = quantize_q4k(w) if fmt == "w4a8_k" else quantize_int4(w)
        codes.append(q)
        scales.append(s)
    q, s = torch.cat(codes), torch.cat(scales)
    return (pack_w8a8(q), s) if fmt == "w8a8" else pack_w4a8(q, s)


def timed(fn, reps: int) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--quantization", choices=["w8a8", "w4a8", "w4a8_k", "bfloat16"], default="w4a8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-gemm-rows", default="", help="comma-separated per-expert row counts")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_isa.load() is None:
        raise SystemExit("the C++ kernels are not built")
    gen = torch.Generator().manual_seed(0)
    H, I, E, k, T = args.hidden, args.inter, args.experts, args.top_k, args.tokens
    fmt = args.quantization
    int_dot = fmt != "bfloat16"
    if int_dot:
        gu, gu_s = quantised(E * 2 * I, H, fmt, gen)
        dn, dn_s = quantised(E * H, I, fmt, gen)
        ops = torch.ops.vllm_mamba
        linear = ops.w8a8_linear if fmt == "w8a8" else ops.w4a8_linear
    else:
        gu = (torch.randn(E * 2 * I, H, generator=gen) * H**-0.5).bfloat16()
        dn = (torch.randn(E * H, I, generator=gen) * I**-0.5).bfloat16()
        gu_s = dn_s = None

        def linear(x: torch.Tensor, w: torch.Tensor, _s: None, _b: None) -> torch.Tensor:
            return F.linear(x.bfloat16(), w).float()

    params = [gu, dn, gu_s, dn_s]
    print(f"{fmt}, H {H}, I {I}, E {E}, top {k}, {T} tokens, {args.threads} threads, "
          f"ISA {cpu_isa.active_level()}")  # fmt: skip

    if args.min_gemm_rows:
        for m in (int(v) for v in args.min_gemm_rows.split(",")):
            x = torch.randn(m, H, generator=gen)
            ones = torch.ones(m, 1)
            ids = torch.zeros(m, 1, dtype=torch.long)
            one = [gu[: 2 * I], dn[:H], *((gu_s[: 2 * I], dn_s[:H]) if int_dot else (None, None))]
            fn = partial(torch.ops.vllm_mamba.moe_experts, x, ones, ids, one, 0, int_dot)
            for _ in range(20):
                fn()
            t = statistics.median(timed(fn, 200))
            gmacs = m * 3 * I * H / t / 1e9
            print(f"  {m:3d} rows of one expert: {t * 1e6:8.1f} us, {gmacs:6.1f} GMAC/s")
        return

    x = torch.randn(T, H, generator=gen)
    weights = torch.rand(T, k, generator=gen)
    ids = torch.rand(T, E, generator=gen).topk(k, dim=-1)[1]

    def run_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        g = slice(e * 2 * I, (e + 1) * 2 * I)
        d = slice(e * H, (e + 1) * H)
        gate, up = linear(rows, gu[g], gu_s[g] if int_dot else None, None).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, dn[d], dn_s[d] if int_dot else None, None)

    kernel = lambda: torch.ops.vllm_mamba.moe_experts(x, weights, ids, params, 0, int_dot)  # noqa: E731
    loop = lambda: dispatch_experts(x, weights, ids, run_expert, torch.float32)  # noqa: E731
    # the same products (bfloat16: a product rounded the other way moves a row by hundredths)
    torch.testing.assert_close(kernel(), loop(), rtol=1e-3, atol=1e-2 if int_dot else 5e-2)
    times = {"kernel": [], "loop": []}
    for _ in range(args.reps):  # interleaved
        times["kernel"] += timed(kernel, 1)
        times["loop"] += timed(loop, 1)
    macs = T * k * 3 * I * H
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, t in med.items():
        print(f"  {name:6s} {t * 1e3:8.2f} ms  {macs / t / 1e9:6.1f} GMAC/s")
    print(f"  kernel / loop: {med['loop'] / med['kernel']:.2f}x")


if __name__ == "__main__":
    main()
