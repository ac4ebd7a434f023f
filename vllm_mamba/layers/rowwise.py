"""`rowwise`: an elementwise function whose bits per row do not depend on the number of rows.

torch's elementwise loop runs over the flat tensor two vectors at a time and finishes the rest
with scalar code, whose transcendental functions (`tanh`, `exp`, `sigmoid`, GELU) round
differently from the vector ones. A row whose width is not a multiple of 32 would take one
path alone and the other among more rows; a speculative chain's rows must get the bits of the
tokens decoded one by one. Padding the rows to a multiple of 32 columns puts every row in the
vector loop (up to torch's parallel grain, itself a multiple of 32, far above a decode step).
A strided view (a `chunk` of a merged projection) is made contiguous first: torch loops over a
strided tensor's rows differently from a one-row view, which counts as contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

ROW_ALIGN = 32  # two AVX-512 vectors of float32 (four AVX2 ones)


def rowwise(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fill: float = 0.0
) -> torch.Tensor:
    """`fn(x)` for a function of `x (..., C)` that is elementwise or reduces each row alone
    (padded with `fill`, a value the reduction ignores: `-inf` for a log-sum-exp), each row
    computed as alone; the result's first `C` columns (a reduced row's one)."""
    x = x.contiguous()
    pad = -x.shape[-1] % ROW_ALIGN
    if not pad:
        return fn(x)
    return fn(F.pad(x, (0, pad), value=fill))[..., : x.shape[-1]]
