"""GLM-5-Next's manifold-constrained hyper-connection weights as one op family,
`hyper_connection`: `mhc_weights` turns a stage's projected streams into the weights that
collapse the streams into the stage's input and mix its output back
(`layers.hyper_connection.HyperConnection`). The reference (`mhc_weights_ref`) is the layer's
arithmetic in PyTorch; the C++ op (`csrc/hyper_connection.cpp`) runs each row's sigmoids,
softmax and Sinkhorn iterations in one call, where the reference takes about 130 small ops a
stage (0.95 ms at GLM-5.3-Flash's shape on a Zen 4, 85 ms a decode step over its 45 layers).

Per row, with `z` the projection `rms(flatten(h)) @ fn^T` split `[pre (N) | post (N) | comb
(N N)]`, `base` split alike and `scale (3,)`:

    pre  = sigmoid(z_pre  * scale_0 + base_pre) + eps                   (N,)
    post = 2 sigmoid(z_post * scale_1 + base_post)                      (N,)
    comb = softmax_c(z_comb * scale_2 + base_comb) + eps                 (N, N), rows a, columns c
    comb /= column sums + eps; then iters - 1 times: rows, then columns (each sum plus eps)

Math is float32; every row is computed alone (a speculative chain's rows get the bits of the
tokens decoded one by one).

Glossary: T rows, N streams (`hc_mult`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from vllm_mamba.ops.families import OpFamily, OpSpec

FAMILY = "hyper_connection"


def mhc_weights_ref(
    z: Tensor, base: Tensor, scale: Tensor, streams: int, iters: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """`z (T, (2 + N) N)` float32, `base ((2 + N) N,)`, `scale (3,)` -> `pre (T, N)`,
    `post (T, N)`, `comb (T, N, N)`, float32 (see the module docstring)."""
    n = streams
    pre_w, post_w, comb_w = z.split([n, n, n * n], dim=-1)
    base, scale = base.float(), scale.float()
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps  # (T, N)
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)  # (T, N)
    comb_logits = comb_w.reshape(-1, n, n) * scale[2] + comb_b.view(n, n)
    comb = torch.softmax(comb_logits, dim=-1) + eps  # (T, N, N)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class MhcWeightsOp(Protocol):
    def __call__(
        self, z: Tensor, base: Tensor, scale: Tensor, streams: int, iters: int, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(FAMILY, {"mhc_weights": OpSpec(MhcWeightsOp, mhc_weights_ref)})
