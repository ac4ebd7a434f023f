"""One decode row of sparse attention over its selected tokens, three ways, with the C++ kernels.

The indexed layers (GLM-5-Next's DSA over MLA latents, Qwen4-Exp's QSA over GQA keys and
values) read each row's selection (`layers.block_indexer`) through a block table of one-token
blocks. This times, per layer and row, the paged decode kernel over `W` selected tokens read
that way, against the same tokens copied out first (the gathered form) and against `W`
contiguous tokens in blocks of 16 (the dense kernel's best case); bfloat16, 2 threads, median
of 30 calls.

    python benchmarks/sparse_decode_bench.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from vllm_mamba.ops import cpu_kernels

W = 2063  # GLM-5.3-Flash's and Qwen3.8-Flash-Next's budget of 2048 plus a tail of 15
BLOCKS, BLOCK = 200, 16


def _median_ms(fn: Callable[[], object], reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    ops = cpu_kernels.make_ops()
    mla = ops.family("mla")
    lens = torch.tensor([W], dtype=torch.int32)
    dense_table = torch.arange(-(-W // BLOCK), dtype=torch.int32)[None]
    slots = torch.randperm(BLOCKS * BLOCK)[:W].sort().values.to(torch.int32)[None]
    one = torch.zeros(1, 1, dtype=torch.int32)
    k = torch.randn(BLOCKS, BLOCK, 2, 256, dtype=torch.bfloat16)  # QSA: 2 KV heads of 256
    v, q = torch.randn_like(k), torch.randn(1, 16, 256, dtype=torch.bfloat16)
    latent = torch.randn(BLOCKS, BLOCK, 512, dtype=torch.bfloat16)  # DSA: latent 512
    q_lat = torch.randn(1, 64, 512)

    def gqa(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return ops.paged_decode_attention(
            query=q, k_cache=kc, v_cache=vc, block_tables=table, seq_lens=lens, scale=0.06,
            sliding_window=0,
        )  # fmt: skip

    def dsa(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return mla.decode_attention(
            query=q_lat, cache=cache, block_tables=table, seq_lens=lens, scale=0.06, v_dim=512
        )

    rows = slots[0].long()
    flat_k, flat_v = k.view(-1, 1, 2, 256), v.view(-1, 1, 2, 256)
    print("| kernel | blocks of 16 | one-token blocks | gathered copy |\n|---|---|---|---|")

    def gqa_copied() -> torch.Tensor:
        return gqa(flat_k[rows].view(1, W, 2, 256), flat_v[rows].view(1, W, 2, 256), one)

    print(
        f"| GQA 16 / 2 heads of 256 | {_median_ms(lambda: gqa(k, v, dense_table)):.2f} ms "
        f"| {_median_ms(lambda: gqa(flat_k, flat_v, slots)):.2f} ms "
        f"| {_median_ms(gqa_copied):.2f} ms |"
    )
    flat = latent.view(-1, 1, 512)
    print(
        f"| MLA 64 heads, latent 512 | {_median_ms(lambda: dsa(latent, dense_table)):.2f} ms "
        f"| {_median_ms(lambda: dsa(flat, slots)):.2f} ms "
        f"| {_median_ms(lambda: dsa(flat[rows].view(1, W, 512), one)):.2f} ms |"
    )


if __name__ == "__main__":
    main()
