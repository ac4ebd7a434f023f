"""The int8 weight quantiser, and the C++ `int8_linear` kernel against `int8_linear_ref`.

Shapes: every projection of the mamba-130m and mamba2-130m shapes (the benchmark models), and
for the larger models (FalconMamba-7B, Jamba, Falcon-H1, Nemotron-H, Granite 4.0-H, Bamba) their
input sizes `K` with a small odd number of output channels: each output channel is one dot
product over `K`, so `K` (with its tail past a multiple of 16) is what the kernel's
accumulation depends on, and `N` only splits the work over the threads. Rows 1 to 64 cover the
decode kernel (up to 4 rows per pass), the float32 tiled path and the bfloat16 dense path
(more than 32 rows). On a CPU with AMX, float32 rows from 32 up take the bfloat16 tile path
(`csrc/amx_int8_gemm.h`); its own tests cover its block edges, and the float32 tests run once
more with it switched off.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_isa, cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS, get_mamba_ops
from vllm_mamba.ops.int8_linear import (
    dequantize_int8,
    has_amx_int8_path,
    has_int8_kernel,
    int8_linear_ref,
    quantize_int8,
)

needs_kernel = pytest.mark.skipif(
    not has_int8_kernel(), reason="C++ extension not built (pip install --no-build-isolation -e .)"
)

# (N, K): mamba-130m in_proj, x_proj, out_proj; mamba2-130m in_proj; then K of the larger
# models (hidden 1024 / 1536 / 2048 / 2560 / 4096, intermediate 8192) with odd N.
MODEL_SHAPES = [
    (3072, 768), (80, 1536), (768, 1536), (3352, 768),
    (37, 1024), (29, 1536), (21, 2048), (19, 2560), (13, 4096), (11, 8192),
]  # fmt: skip
ODD_SHAPES = [(1, 1), (5, 17), (7, 15), (33, 100), (50, 130)]
ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 17, 32, 33, 64, 300]  # 300: the dequantised GEMM path


@functools.cache
def _weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 10007 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, : max(1, k // 3)] *= 20.0  # one channel with a much larger range than the others
    qweight, scale = quantize_int8(w)
    return qweight, scale, torch.randn(n, generator=g)


@functools.cache
def _dequantised(n: int, k: int) -> torch.Tensor:
    """`int8_linear_ref`'s float32 weight, made once per shape."""
    qweight, scale, _ = _weight(n, k)
    return dequantize_int8(qweight, scale, torch.float32)  # (N, K)


def _case(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    return x, *_weight(n, k)


def test_quantize_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.rand(64, 1, generator=g) * 3
    w[5] = 0.0
    qweight, scale = quantize_int8(w)
    assert qweight.dtype == torch.int8 and qweight.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    assert int(qweight.abs().max()) == 127 and int(qweight.min()) >= -127
    assert torch.equal(qweight[5], torch.zeros(300, dtype=torch.int8)) and scale[5] == 1.0
    err = (dequantize_int8(qweight, scale, torch.float32) - w).abs()  # (64, 300)
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())


def test_ref_is_f_linear_of_the_dequantised_weight() -> None:
    x, qweight, scale, bias = _case(40, 70, 3, 0)
    w = qweight.float() * scale[:, None]
    torch.testing.assert_close(int8_linear_ref(x, qweight, scale, bias), x @ w.T + bias)
    out = int8_linear_ref(x[None], qweight, scale, None)  # leading dims pass through
    assert out.shape == (1, 3, 40)


@needs_kernel
@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES, ids=str)
def test_float32_matches_ref(shape: tuple[int, int]) -> None:
    """Against the reference's product in float64: the float32 reference (`F.linear`, as
    `int8_linear_ref`) is itself off by up to ~3e-5 at K = 4,096 (MKL's AVX2 path), so the
    kernel may be off by twice the reference's own error beyond the fixed tolerance."""
    n, k = shape
    for i, rows in enumerate(ROWS):
        x, qweight, scale, bias = _case(n, k, rows, n * 7 + k + rows)
        b = bias if i % 2 else None
        got = torch.ops.vllm_mamba.int8_linear(x, qweight, scale, b)
        want = F.linear(x, _dequantised(n, k), b)  # = int8_linear_ref(x, qweight, scale, b)
        exact = F.linear(x.double(), _dequantised(n, k).double(), None if b is None else b.double())
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        ref_err = float((want.double() - exact).abs().max())
        tol = 2e-6 * float(want.abs().max()) + 1e-6 + 2 * ref_err
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=tol, msg=f"rows {rows}")


@needs_kernel
@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES, ids=str)
def test_bfloat16_matches_ref_within_bfloat16_rounding(shape: tuple[int, int]) -> None:
    """bfloat16 inputs and outputs: within 1% of the largest output of the float32 reference
    (bfloat16 keeps 8 bits; the dense path also rounds the dequantised weight to bfloat16)."""
    n, k = shape
    for rows in ROWS:
        x, qweight, scale, bias = _case(n, k, rows, n * 5 + k + rows)
        xb = x.bfloat16()
        got = torch.ops.vllm_mamba.int8_linear(xb, qweight, scale, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        want = F.linear(xb.float(), _dequantised(n, k), bias)  # the float32 reference
        tol = 1e-2 * float(want.abs().max())
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol, msg=f"rows {rows}")


def _cpu_has_amx_bf16() -> bool:
    return {"amx_tile", "amx_bf16"} <= (cpu_isa._cpu_flags() or set())


@needs_kernel
def test_tile_path_is_on_exactly_where_the_cpu_has_amx() -> None:
    """The AVX-512 build on a CPU with AMX tiles and bfloat16 tile products takes the tile path
    (unless VLLM_MAMBA_AMX=0); every other build and CPU keeps the FMA kernels."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("ONEDNN_MAX_CPU_ISA caps what oneDNN reports; the expectation follows it")
    expected = (
        cpu_isa.active_level() == "avx512"
        and _cpu_has_amx_bf16()
        and torch.backends.mkldnn.is_available()
        and os.environ.get("VLLM_MAMBA_AMX") != "0"
    )
    assert has_amx_int8_path() == expected


# Rows around the tile path's blocks of 32 rows of x and 64 channels, K with and without a
# tail past a multiple of 16, and an odd K (which the tile path leaves to the FMA kernels).
TILE_SHAPES = [(64, 1024), (70, 130), (130, 1000), (1, 16), (193, 4096), (9, 33)]
TILE_ROWS = [31, 32, 33, 63, 64, 65, 97]


@needs_kernel
@pytest.mark.parametrize("shape", TILE_SHAPES, ids=str)
def test_float32_rows_around_the_tile_blocks_match_float64(shape: tuple[int, int]) -> None:
    """As close to the float64 product of the dequantised weight as float32 `F.linear` is,
    with or without the tile path: the three bfloat16 parts of an activation are exact (two
    parts, 16 bits, would be about 100 times further off)."""
    n, k = shape
    weight = _dequantised(n, k)
    for rows in TILE_ROWS:
        x, qweight, scale, bias = _case(n, k, rows, n * 3 + k + rows)
        got = torch.ops.vllm_mamba.int8_linear(x, qweight, scale, bias)
        want = F.linear(x.double(), weight.double(), bias.double())
        f32_err = float((F.linear(x, weight, bias).double() - want).abs().max())
        err = float((got.double() - want).abs().max())
        assert err <= 4 * f32_err + 1e-7 * float(want.abs().max()), (rows, err, f32_err)


@needs_kernel
@pytest.mark.skipif(not has_amx_int8_path(), reason="the tile path is off here: nothing to switch")
def test_float32_without_the_tile_path() -> None:
    """With VLLM_MAMBA_AMX=0 the same tests run the FMA kernels (a process reads it once)."""
    env = dict(os.environ, VLLM_MAMBA_AMX="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
    cmd += ["-k", "float32 or tile_path_is_on"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@needs_kernel
def test_empty_batch_and_bad_inputs() -> None:
    x, qweight, scale, _ = _case(9, 20, 0, 1)
    assert torch.ops.vllm_mamba.int8_linear(x, qweight, scale, None).shape == (0, 9)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.vllm_mamba.int8_linear(torch.randn(2, 20), qweight.float(), scale, None)
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.vllm_mamba.int8_linear(torch.randn(2, 20), qweight, scale[:3], None)


def test_tables_hold_the_int8_op(monkeypatch: pytest.MonkeyPatch) -> None:
    assert REF_OPS.int8_linear is int8_linear_ref
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    assert get_mamba_ops("cpu").int8_linear is int8_linear_ref
    if cpu_kernels.available() and has_int8_kernel():
        monkeypatch.setenv("VLLM_MAMBA_OPS", "cpp")
        x, qweight, scale, bias = _case(12, 40, 2, 3)
        op = get_mamba_ops("cpu").int8_linear
        torch.testing.assert_close(
            op(x, qweight, scale, bias), int8_linear_ref(x, qweight, scale, bias)
        )
