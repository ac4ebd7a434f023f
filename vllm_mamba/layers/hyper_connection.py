"""`HyperConnection`: manifold-constrained hyper-connections (mHC) around one stage of a decoder
layer with `N` residual streams (GLM-5-Next's `attn_hc` / `ffn_hc`).

The layer's input and output are `N` streams per token, `h (T, N, H)`. Around a stage `f`
(the mixer with its norm, or the feed-forward with its norm):

    z = rms(flatten(h)) @ fn^T                       (T, (2 + N) N), float32, unweighted RMS
    pre  = sigmoid(z_pre  * scale_0 + base_pre) + eps                          (T, N)
    post = 2 sigmoid(z_post * scale_1 + base_post)                             (T, N)
    comb = sinkhorn(softmax(z_comb * scale_2 + base_comb) + eps)               (T, N, N)
    x = sum_n pre_n h_n                              (T, H): the stage's input
    h'_i = post_i f(x) + sum_j comb_ji h_j           (T, N, H): the new streams

`sinkhorn` normalises the columns, then `iters - 1` times the rows and the columns (each sum
plus eps), so `comb` is (nearly) doubly stochastic. Parameters under the checkpoint's names as
transformers loads them (`fn ((2 + N) N, N H)`, `base ((2 + N) N,)`, `scale (3,)`; the
releases' `hc_attn_fn` / `hc_ffn_base` ... are renamed by the model). Replicated under tensor
parallelism (the streams are whole on every rank).

Glossary: T tokens, N streams (`hc_mult`), H hidden size.
"""

from __future__ import annotations

import torch
from torch import nn


class HyperConnection(nn.Module):
    """The mHC weights of one stage: collapse the streams, then expand and mix them back."""

    def __init__(
        self, hidden_size: int, streams: int, iters: int, eps: float, norm_eps: float
    ) -> None:
        """Args: `hidden_size` H; `streams` N (`hc_mult`); `iters` the Sinkhorn iterations
        (`hc_sinkhorn_iters`); `eps` the floor of the weights and the sums (`hc_eps`);
        `norm_eps` the unweighted RMS norm's epsilon (`rms_norm_eps`)."""
        super().__init__()
        if streams < 1 or iters < 1:
            raise ValueError(f"hc_mult and hc_sinkhorn_iters must be >= 1, got {streams}, {iters}")
        self.streams, self.iters, self.eps, self.norm_eps = streams, iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nn.Parameter(torch.empty(width, streams * hidden_size))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`streams (T, N, H)` -> `(x (T, H), post (T, N), comb (T, N, N))`: the stage's input
        and the weights `expand` takes (float32)."""
        n = self.streams
        flat = streams.reshape(streams.shape[0], -1).float()  # (T, N H)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        z = flat @ self.fn.float().t()  # (T, (2 + N) N)
        pre_w, post_w, comb_w = z.split([n, n, n * n], dim=-1)
        base, scale = self.base.float(), self.scale.float()
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.eps  # (T, N)
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)  # (T, N)
        comb_logits = comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb_logits, dim=-1) + self.eps  # (T, N, N)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # (T, H)
        return x, post, comb

    @staticmethod
    def expand(
        out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor
    ) -> torch.Tensor:
        """The new streams `post_i out + sum_j comb_ji streams_j` -> `(T, N, H)` in the streams'
        dtype, from the stage's output `out (T, H)` and the input `streams (T, N, H)`."""
        dtype = streams.dtype
        expanded = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)  # (T, N, H)
        return expanded + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


__all__ = ["HyperConnection"]
