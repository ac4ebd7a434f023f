"""The `sampling` op family's `argmax_rows` (the greedy sampler's argmax, `csrc/argmax.cpp`)
against `torch.argmax`: 1 to 33 rows of a small and of a 248k vocabulary (one row split over
the threads), ties to the first index (within a thread's part and across parts), all `-inf`
rows, NaNs (the first one wins, as torch's), a row stride; bad inputs are refused. The
sampler and the rejection sampler call it through the ops table (`layers.sampler.argmax_rows`)."""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.layers.sampler import argmax_rows
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.sampling import argmax_rows_ref

pytestmark = pytest.mark.skipif(
    "argmax_rows" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

VOCABS = [7, 1000, 248_320]


def _op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.vllm_mamba.argmax_rows(x)


@pytest.mark.parametrize("rows", [1, 2, 5, 33])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_rows_match_torch(rows: int, vocab: int, threads: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _op(x)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.int64
    assert torch.equal(got, argmax_rows_ref(x))


@pytest.mark.parametrize("vocab", VOCABS)
def test_ties_nan_and_inf_follow_torch(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=g).clamp(max=3.0)
    last = vocab - 1
    x[0, [last // 3, last]] = 5.0  # a tie: the first (in different thread parts at 248k)
    x[1, [0, last]] = 5.0
    x[2] = float("-inf")  # every token banned
    x[3, last // 2] = float("nan")  # a NaN beats everything, as torch's argmax
    x[3, last] = float("nan")
    x[3, 0] = float("inf")
    x[4, last] = float("inf")
    x[5, [last // 2, last // 2 + 1]] = torch.tensor([-0.0, 0.0]) + 9.0
    x[6] = 0.0  # all equal: index 0
    x[6, 0] = -0.0
    want = argmax_rows_ref(x)
    assert torch.equal(_op(x), want)
    assert want.tolist()[:5] == [last // 3, 0, 0, last // 2, last]


def test_row_stride_and_dispatch() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 3000, generator=g)
    x = base[::2, 100:2100]  # a row stride, columns contiguous
    assert torch.equal(_op(x), argmax_rows_ref(x))
    t = base.t().contiguous().t()  # a column stride: copied
    assert torch.equal(_op(t), argmax_rows_ref(t))
    assert torch.equal(argmax_rows(base), argmax_rows_ref(base))  # the sampler's entry point
    half = base.to(torch.bfloat16)  # other dtypes: torch's own
    assert torch.equal(argmax_rows(half), argmax_rows_ref(half))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="x must be \\(R, V\\)"):
        _op(torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        _op(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="at least one column"):
        _op(torch.zeros(2, 0))
    assert _op(torch.zeros(0, 5)).shape == (0,)
