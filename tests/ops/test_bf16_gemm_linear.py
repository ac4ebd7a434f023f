"""`bf16_gemm_linear` (`csrc/bf16_gemm_linear.cpp`, the kernel `csrc/bf16_gemm.h`) against
torch's bfloat16 product: the same exact products of bfloat16 inputs summed in float32 in
another order, each result rounded to bfloat16. Whole tiles and vectors and their tails (K not
a multiple of 32, N not of 4, M not of 4), float32 inputs rounded first, bfloat16 or float32
results, and `cpu_kernels.linear`'s routing to it."""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.ops import cpu_kernels

pytestmark = pytest.mark.skipif(
    "bf16_gemm_linear" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

SHAPES = [(9, 2048, 300), (17, 50, 37), (32, 96, 4), (1, 33, 5), (4, 64, 8), (30, 512, 130)]


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` is `bf16(x @ w.T)` (float32 values) of some float32 summation: each element within
    half a bfloat16 step of its float32 sum, which is within the float32 summation bound
    (K u sum |terms|) of the exact sum; and equal to torch's bfloat16 product in all but at most
    1% of the elements (where the two sums round apart: the exact sum near a rounding midpoint,
    or cancelling to well below its terms)."""
    xb, wb = x.bfloat16().double(), w.double()
    exact = xb @ wb.T
    bound = x.shape[1] * 2.0**-24 * (xb.abs() @ wb.abs().T)
    half_step = torch.exp2(torch.floor(torch.log2(got.double().abs().clamp_min(1e-38))) - 8)
    err = (got.double() - exact).abs()
    assert bool((err <= half_step + bound).all()), float((err - half_step - bound).max())
    want = (x.bfloat16().float() @ w.float().T).bfloat16().float()
    differ = int((got != want).sum())
    assert differ <= max(1, want.numel() // 100), differ


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_bfloat16_product(m: int, k: int, n: int, x_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 31 + k + n)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    got = torch.ops.vllm_mamba.bf16_gemm_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _check(got.float(), x, w)
    wide = torch.ops.vllm_mamba.bf16_gemm_linear(x, w, True)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, got.float())  # the same values, widened


def test_rows_are_independent_and_edges() -> None:
    """A row's result does not depend on the other rows (the tiles group four); no rows, no
    result; a mismatched weight is refused."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, 80, generator=g).bfloat16()
    w = torch.randn(21, 80, generator=g).bfloat16()
    got = torch.ops.vllm_mamba.bf16_gemm_linear(x, w)
    for t in (0, 5, 12):
        assert torch.equal(got[t], torch.ops.vllm_mamba.bf16_gemm_linear(x[t : t + 1], w)[0])
    assert torch.ops.vllm_mamba.bf16_gemm_linear(x[:0], w).shape == (0, 21)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.vllm_mamba.bf16_gemm_linear(x, w[:, :40].contiguous())


@pytest.mark.parametrize("rows", [cpu_kernels.SMALL_BATCH + 1, cpu_kernels.BF16_GEMM_ROWS])
def test_linear_routes_few_bfloat16_rows_to_it(rows: int) -> None:
    """`cpu_kernels.linear` of bfloat16 rows past the matrix-vector kernel, up to
    `BF16_GEMM_ROWS`, is `bf16_gemm_linear` on a CPU with bfloat16 instructions (else the
    widening or torch path: the same values up to the summation order)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=g).bfloat16()
    w = torch.randn(72, 160, generator=g).bfloat16()
    with torch.no_grad():
        got = cpu_kernels.linear(x, w, None)
    assert got.dtype == torch.bfloat16
    if cpu_kernels.native_bf16():
        assert torch.equal(got, torch.ops.vllm_mamba.bf16_gemm_linear(x, w))
    _check(got.float(), x, w)
