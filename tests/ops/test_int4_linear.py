"""The 4-bit weight quantiser, and the C++ `int4_linear` kernel against `int4_linear_ref`.

The packing is checked against a plain Python unpacking written from `csrc/gemv.h`'s
documentation of `Q4Rows` (not against `unpack_int4`). Rows 1 to 65 cover the 4-bit GEMV
(tiles of up to 4 rows of x; its float32 limit is 64 rows, bfloat16's 32 on a CPU with bfloat16
instructions), 300 and 600 the dequantised block GEMM; K 32, 96 and 768 (one, three and 24
groups), with N values that are and are not multiples of the 8-row parallel unit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS, get_mamba_ops
from vllm_mamba.ops.int4_linear import (
    dequantize_int4,
    has_int4_kernel,
    int4_linear_ref,
    quantize_int4,
)

needs_kernel = pytest.mark.skipif(
    not has_int4_kernel(), reason="C++ extension not built (pip install --no-build-isolation -e .)"
)

SHAPES = [(1, 32), (13, 96), (40, 768), (3072, 768), (80, 1536), (29, 4096)]  # (N, K)
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 64, 65, 300, 600]


@functools.cache
def _weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 10007 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, : max(1, k // 3)] *= 20.0  # groups with a much larger range than the others
    qweight, scales = quantize_int4(w)
    return qweight, scales, torch.randn(n, generator=g)


@functools.cache
def _dequantised(n: int, k: int) -> torch.Tensor:
    """`int4_linear_ref`'s float32 weight, made once per shape."""
    qweight, scales, _ = _weight(n, k)
    return dequantize_int4(qweight, scales, torch.float32)  # (N, K)


def _case(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    return x, *_weight(n, k)


def _python_unpack(qweight: torch.Tensor, scales: torch.Tensor) -> list[list[float]]:
    """gemv.h's `Q4Rows`, element by element: per group of 32, byte j holds weight j (low
    nibble) and weight j + 16 (high nibble), each q + 8; weight = q * the group's scale."""
    rows = []
    for r in range(qweight.shape[0]):
        row_bytes = qweight[r].tolist()
        row_scales = scales[r].float().tolist()
        vals = [0.0] * (2 * len(row_bytes))
        for g, s in enumerate(row_scales):
            for j in range(16):
                byte = row_bytes[g * 16 + j]
                vals[g * 32 + j] = ((byte & 0xF) - 8) * s
                vals[g * 32 + j + 16] = ((byte >> 4) - 8) * s
        rows.append(vals)
    return rows


def test_layout_is_the_documented_one() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 96, generator=g)
    qweight, scales = quantize_int4(w)
    assert qweight.shape == (6, 48) and qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert scales.shape == (6, 3) and scales.dtype == torch.float16 and scales.is_contiguous()
    want = torch.tensor(_python_unpack(qweight, scales))
    assert torch.equal(dequantize_int4(qweight, scales, torch.float32), want)


def test_quantize_round_trip_error_bound() -> None:
    """Every weight within half a step (|scale| / 2) of its value, except those clamped to
    level 7 (the opposite sign of the group's peak, beyond 7.5 steps): within a step. The
    group's peak is level -8 exactly; all-zero groups get scale 1 and zeros."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 320, generator=g) * torch.rand(64, 1, generator=g) * 3
    w[5] = 0.0
    w[6, 32:64] = torch.linspace(-1.0, 0.9, 32)  # peak negative: positive scale
    qweight, scales = quantize_int4(w)
    assert torch.equal(qweight[5], torch.full((160,), 0x88, dtype=torch.uint8))
    assert bool((scales[5] == 1.0).all()) and float(scales[6, 1]) > 0
    levels = torch.tensor(_python_unpack(qweight, torch.ones_like(scales))).reshape(64, 10, 32)
    assert int(levels.min()) == -8 and int(levels.max()) == 7
    err = (dequantize_int4(qweight, scales, torch.float32) - w).abs().reshape(64, 10, 32)
    step = scales.float().abs()[..., None]  # (64, 10, 1)
    clamped = levels == 7
    assert bool((err[~clamped] <= (step / 2).expand_as(err)[~clamped] * (1 + 1e-3)).all())
    assert bool((err <= step * (1 + 1e-3)).all())
    peak_at = w.reshape(64, 10, 32).abs().argmax(dim=2, keepdim=True)
    nonzero = scales.float() != 1.0
    assert bool((levels.gather(2, peak_at).squeeze(2)[nonzero] == -8).all())


def test_quantize_rejects_k_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="group"):
        quantize_int4(torch.randn(4, 64), group=64)


def test_ref_is_f_linear_of_the_dequantised_weight() -> None:
    x, qweight, scales, bias = _case(40, 96, 3, 0)
    w = torch.tensor(_python_unpack(qweight, scales))
    torch.testing.assert_close(int4_linear_ref(x, qweight, scales, bias), x @ w.T + bias)
    out = int4_linear_ref(x[None], qweight, scales, None)  # leading dims pass through
    assert out.shape == (1, 3, 40)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_float32_matches_ref(shape: tuple[int, int]) -> None:
    n, k = shape
    for i, rows in enumerate(ROWS):
        x, qweight, scales, bias = _case(n, k, rows, n * 7 + k + rows)
        b = bias if i % 2 else None
        got = torch.ops.vllm_mamba.int4_linear(x, qweight, scales, b)
        want = F.linear(x, _dequantised(n, k), b)  # = int4_linear_ref(x, qweight, scales, b)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        tol = 2e-6 * float(want.abs().max()) + 1e-6
        torch.testing.assert_close(got, want, rtol=1e-5, atol=tol, msg=f"rows {rows}")


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bfloat16_matches_ref_within_bfloat16_rounding(shape: tuple[int, int]) -> None:
    """bfloat16 inputs and outputs: within 1% of the largest output of the float32 reference
    (bfloat16 keeps 8 bits; the dense path may also round the dequantised weight)."""
    n, k = shape
    for i, rows in enumerate(ROWS):
        x, qweight, scales, bias = _case(n, k, rows, n * 5 + k + rows)
        b = bias if i % 2 else None
        xb = x.bfloat16()
        got = torch.ops.vllm_mamba.int4_linear(xb, qweight, scales, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        want = F.linear(xb.float(), _dequantised(n, k), b)  # the float32 reference
        tol = 1e-2 * float(want.abs().max())
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol, msg=f"rows {rows}")
        ref = int4_linear_ref(xb, qweight, scales, b)  # bfloat16 weight and product
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2 * tol)


@needs_kernel
def test_row_strided_x() -> None:
    """A column slice of a wider tensor (the fused layers pass such views)."""
    x, qweight, scales, bias = _case(24, 64, 5, 9)
    wide = torch.randn(5, 200)
    wide[:, 10:74] = x
    got = torch.ops.vllm_mamba.int4_linear(wide[:, 10:74], qweight, scales, bias)
    torch.testing.assert_close(got, int4_linear_ref(x, qweight, scales, bias))


@needs_kernel
def test_empty_batch_and_bad_inputs() -> None:
    x, qweight, scales, _ = _case(9, 64, 0, 1)
    op = torch.ops.vllm_mamba.int4_linear
    assert op(x, qweight, scales, None).shape == (0, 9)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, qweight.to(torch.int8), scales, None)
    with pytest.raises(RuntimeError, match="scales"):
        op(x, qweight, scales.float(), None)
    with pytest.raises(RuntimeError, match="scales"):
        op(x, qweight, scales[:3], None)
    with pytest.raises(RuntimeError, match="K / 2"):
        op(torch.randn(2, 96), qweight, scales, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 40), qweight[:, :20].contiguous(), scales, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, qweight, scales, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.half(), qweight, scales, None)


def test_tables_hold_the_int4_op(monkeypatch: pytest.MonkeyPatch) -> None:
    assert REF_OPS.int4_linear is int4_linear_ref
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    assert get_mamba_ops("cpu").int4_linear is int4_linear_ref
    if cpu_kernels.available() and has_int4_kernel():
        monkeypatch.setenv("VLLM_MAMBA_OPS", "cpp")
        x, qweight, scales, bias = _case(12, 64, 2, 3)
        op = get_mamba_ops("cpu").int4_linear
        assert op is not int4_linear_ref
        torch.testing.assert_close(
            op(x, qweight, scales, bias), int4_linear_ref(x, qweight, scales, bias)
        )
