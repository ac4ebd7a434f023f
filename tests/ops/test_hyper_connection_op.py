"""The `hyper_connection` op family's `mhc_weights` (GLM-5-Next's mHC weights: the pre and
post sigmoids and the Sinkhorn-normalised mix, `csrc/hyper_connection.cpp`) against its
reference, which `tests/attention/test_indexed_mla_layer.py` checks against transformers' own
`Glm5NextTextHyperConnection` through the layer: 1 and 5 rows, 3 and 4 streams, one and twenty
Sinkhorn iterations, each row's bits as alone; bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.hyper_connection import mhc_weights_ref

pytestmark = pytest.mark.skipif(
    "mhc_weights" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)


def _inputs(rows: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    width = (2 + n) * n
    z = torch.randn(rows, width, generator=g) * 2.0
    base = torch.randn(width, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return z, base, scale


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("streams", [3, 4])
@pytest.mark.parametrize("iters", [1, 20])
def test_mhc_weights_match_reference(rows: int, streams: int, iters: int) -> None:
    z, base, scale = _inputs(rows, streams, rows * 10 + streams + iters)
    op = torch.ops.vllm_mamba.mhc_weights
    got = op(z, base, scale, streams, iters, 1e-6)
    want = mhc_weights_ref(z, base, scale, streams, iters, 1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for i in range(rows):  # each row's bits as alone
        alone = op(z[i : i + 1], base, scale, streams, iters, 1e-6)
        assert all(torch.equal(a[i : i + 1], b) for a, b in zip(got, alone)), i
    # the last normalisation is the columns': each sums to 1 (less the eps in its divisor)
    torch.testing.assert_close(got[2].sum(-2), torch.ones(rows, streams), atol=1e-4, rtol=0)


def test_bad_shapes_are_refused() -> None:
    z, base, scale = _inputs(2, 4, 0)
    op = torch.ops.vllm_mamba.mhc_weights
    with pytest.raises(RuntimeError, match="z must be"):
        op(z[:, :-1], base, scale, 4, 20, 1e-6)
    with pytest.raises(RuntimeError, match="scale"):
        op(z, base, scale[:2], 4, 20, 1e-6)
