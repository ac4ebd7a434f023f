"""Mamba2's gated RMSNorm: the C++ kernel against `gated_rms_norm_ref`, the ref against a loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.gated_rms_norm import gated_rms_norm_ref

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")


def _inputs(rows: int, dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, 3 * dim, generator=g).to(dtype)  # z as a strided view
    x = torch.randn(rows, dim, generator=g).to(dtype)
    weight = (torch.randn(dim, generator=g) * 0.5 + 1.0).to(dtype)
    return x, wide[:, dim : 2 * dim], weight


def test_reference_normalises_each_group() -> None:
    x, z, weight = _inputs(3, 12, torch.float32)
    out = gated_rms_norm_ref(x, z, weight, 4, 1e-5)
    for r in range(3):
        for g0 in range(0, 12, 4):
            v = x[r, g0 : g0 + 4] * F.silu(z[r, g0 : g0 + 4])
            want = weight[g0 : g0 + 4] * v / torch.sqrt(v.pow(2).mean() + 1e-5)
            torch.testing.assert_close(out[r, g0 : g0 + 4], want)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize(("dim", "group_size"), [(12, 12), (12, 4), (1536, 1536), (96, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_ref(rows: int, dim: int, group_size: int, dtype: torch.dtype) -> None:
    x, z, weight = _inputs(rows, dim, dtype, seed=rows + dim)
    assert rows == 1 or not z.is_contiguous()
    got = cpu_kernels.gated_rms_norm(x, z, weight, group_size, 1e-5)
    want = gated_rms_norm_ref(x, z, weight, group_size, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
