"""The small-batch C++ matrix-vector kernel, the oneDNN float32 GEMM path (and the few row
counts it is called with), and the `cpp` table's `linear`, against `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.layers.linear import Linear
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension not built (pip install --no-build-isolation -e .)",
)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [64, 100, 768])
@pytest.mark.parametrize("with_bias", [True, False])
def test_small_batch_matches_f_linear(batch: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(batch * 1000 + k)
    x = torch.randn(batch, k, generator=g)
    w = torch.randn(37, k, generator=g)
    b = torch.randn(37, generator=g) if with_bias else None
    out = torch.ops.vllm_mamba.linear_small_batch(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_bfloat16_weights_and_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 130, generator=g).bfloat16()
    w = torch.randn(50, 130, generator=g).bfloat16()
    out = torch.ops.vllm_mamba.linear_small_batch(x, w, None)
    assert out.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=5e-2)


def test_linear_module_uses_the_same_math_for_any_batch() -> None:
    layer = Linear(48, 20, True, cpu_kernels.make_ops()).eval()
    x = torch.randn(12, 48)
    with torch.no_grad():
        small = layer(x[:2])  # kernel path
        large = layer(x)  # F.linear path
        torch.testing.assert_close(small, large[:2], rtol=1e-5, atol=1e-5)
        # A non-contiguous input (a split view) is handled.
        view = torch.randn(2, 96)[:, ::2]
        torch.testing.assert_close(
            cpu_kernels.linear(view, layer.weight, layer.bias), layer(view.clone())
        )


@pytest.mark.skipif(not cpu_kernels._ONEDNN_LINEAR, reason="torch without oneDNN's linear")
@pytest.mark.parametrize("rows", [9, 32, 77, 512, 1100])
@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_path_matches_f_linear(rows: int, with_bias: bool) -> None:
    """Float32 batches above `SMALL_BATCH`: oneDNN's GEMM in full float32 precision (a
    reduced-precision GEMM would miss this tolerance by orders of magnitude), also for
    strided, 3-D and empty inputs, padded row counts and more rows than one call runs."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 768, generator=g)
    b = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(rows, 2 * 768, generator=g)[:, :768]  # a row stride, as a split's view
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    with torch.no_grad():
        got = cpu_kernels.linear(x, w, b)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)
        x3 = x.reshape(rows, 3, 256)[:, 0].reshape(1, rows, 256)
        w3 = w[:, :256].contiguous()
        got3 = cpu_kernels.linear(x3, w3, b)
        torch.testing.assert_close(got3, F.linear(x3, w3, b), rtol=0, atol=2e-4)
        assert cpu_kernels.linear(x[:0], w, b).shape == (0, 300)


def test_gemm_rows_are_few_and_waste_little() -> None:
    sizes = {m: cpu_kernels.gemm_rows(m) for m in range(1, cpu_kernels.GEMM_ROWS + 1)}
    assert all(m <= padded <= m + 7 for m, padded in sizes.items() if m <= 32)
    assert all(m <= padded < 1.25 * m for m, padded in sizes.items() if m > 32)
    assert len(set(sizes.values())) == 20
    assert sizes[cpu_kernels.GEMM_ROWS] == cpu_kernels.GEMM_ROWS


@pytest.mark.skipif(not cpu_kernels._ONEDNN_LINEAR, reason="torch without oneDNN's linear")
def test_onednn_sees_few_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN caches a JIT-compiled primitive (~0.6 MB) per row count: batches of every size
    from 9 to 1,500 rows reach it with the 20 sizes of `gemm_rows` only."""
    seen: set[int] = set()
    gemm = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.add(x.shape[0])
        return gemm(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    w = torch.randn(16, 8)
    with torch.no_grad():
        for rows in range(cpu_kernels.SMALL_BATCH + 1, 1501):
            cpu_kernels.linear(torch.randn(rows, 8), w, None)
    # the last part of a batch above GEMM_ROWS may have any count of rows
    assert seen == {cpu_kernels.gemm_rows(m) for m in range(1, cpu_kernels.GEMM_ROWS + 1)}


def test_reference_table_runs_f_linear() -> None:
    """`VLLM_MAMBA_OPS=ref` covers the projections too."""
    assert REF_OPS.linear is F.linear
    assert Linear(4, 3, False, REF_OPS).linear_op is F.linear


@pytest.mark.parametrize("rows", [9, 33, 256, 257, 600])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_linear_widens_the_weight(rows: int, x_dtype: torch.dtype) -> None:
    """`bf16_linear` (the tiled kernel up to 256 rows, widened blocks and a GEMM above) is the
    float32 product of the widened weight, rounded once to x's dtype; on a CPU with bfloat16
    instructions the block GEMM of bfloat16 activations runs in bfloat16 (looser bound)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=g).to(x_dtype)
    w = torch.randn(70, 100, generator=g).bfloat16()
    b = torch.randn(70, generator=g)
    out = torch.ops.vllm_mamba.bf16_linear(x, w, b)
    assert out.dtype == x_dtype and out.shape == (rows, 70)
    want = F.linear(x.float(), w.float(), b)
    if x_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    else:  # one bfloat16 rounding of the output (8 bits), plus bfloat16 GEMM blocks if native
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=0.1)


def test_linear_routes_bf16_weights_by_the_cpu() -> None:
    """Without bfloat16 instructions `linear` takes `bf16_linear` for more than 8 rows (the
    float32 product of the widened weight); with them, `F.linear`."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    out = cpu_kernels.linear(x, w, None)
    if cpu_kernels.native_bf16():
        torch.testing.assert_close(out, F.linear(x, w))
    else:
        want = torch.ops.vllm_mamba.bf16_linear(x, w, None)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def _block_diagonal_float64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """Group by group in float64: `x (T, G K)`, `w (G, N, K)`, `b (G, N)` -> `(T, G N)`."""
    groups, n, k = w.shape
    parts = [x[:, g * k : (g + 1) * k].double() @ w[g].double().T for g in range(groups)]
    out = torch.cat(parts, dim=1)
    return out if b is None else out + b.double().flatten()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_matches_a_float64_loop(rows: int, with_bias: bool, dtype) -> None:
    """`block_linear` (RecurrentGemma's gates), ref and C++ (the small-batch kernel up to 8
    rows, a batched matmul above), against each block multiplied alone in float64; groups
    whose rows are not a tile multiple and a split across threads."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 5 * 48, generator=g).to(dtype)
    w = (torch.randn(5, 70, 48, generator=g) * 0.2).to(dtype)
    b = torch.randn(5, 70, generator=g).to(dtype) if with_bias else None
    want = _block_diagonal_float64(x, w, b)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for op in (REF_OPS.block_linear, cpu_kernels.make_ops().block_linear):
        with torch.no_grad():  # the engine's mode: the kernels run only without autograd
            got = op(x, w, b)
        assert got.dtype == dtype and got.shape == (rows, 5 * 70)
        torch.testing.assert_close(got.double(), want, **tol)


def test_block_linear_rows_are_summed_as_alone() -> None:
    """Each row of a decode-sized call has the bits of the row alone (a speculative chain),
    with a weight large enough to be split over threads."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4 * 256, generator=g)
    w, b = torch.randn(4, 512, 256, generator=g), torch.randn(4, 512, generator=g)
    op = cpu_kernels.make_ops().block_linear
    with torch.no_grad():
        together = op(x, w, b)
        for r in range(x.shape[0]):
            assert torch.equal(together[r], op(x[r : r + 1], w, b)[0]), r
