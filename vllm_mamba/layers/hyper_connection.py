"""Residual streams around the stages of a decoder layer: the `StreamConnection` interface and
its two kinds, `HyperConnection` (GLM-5-Next's mHC) and `GatedResidual` (Qwen4-Exp's gated
hyper-connections).

A layer with `N` residual streams carries `h (T, N, H)`. Around each stage `f` (the mixer with
its norm, or the feed-forward with its norm) a connection collapses the streams into the
stage's input and mixes the stage's output back: `x, ctx = c.collapse(h)`, `h = c.expand(f(x),
ctx, h)`.

`HyperConnection` (manifold-constrained hyper-connections, `attn_hc` / `ffn_hc`):

    z = rms(flatten(h)) @ fn^T                       (T, (2 + N) N), float32, unweighted RMS
    pre  = sigmoid(z_pre  * scale_0 + base_pre) + eps                          (T, N)
    post = 2 sigmoid(z_post * scale_1 + base_post)                             (T, N)
    comb = sinkhorn(softmax(z_comb * scale_2 + base_comb) + eps)               (T, N, N)
    x = sum_n pre_n h_n                              (T, H): the stage's input
    h'_i = post_i f(x) + sum_j comb_ji h_j           (T, N, H): the new streams

`sinkhorn` normalises the columns, then `iters - 1` times the rows and the columns (each sum
plus eps), so `comb` is (nearly) doubly stochastic. Parameters under the checkpoint's names as
transformers loads them (`fn ((2 + N) N, N H)`, `base ((2 + N) N,)`, `scale (3,)`; the
releases' `hc_attn_fn` / `hc_ffn_base` ... are renamed by the model).

`GatedResidual` (`attn_hyper_connection` / `mlp_hyper_connection`, and the model's final
`hyper_connection_mixer` without the injection):

    n = rms_per_stream(h) * (1 + hc_norm)                    (T, N, H), float32 statistics
    w = sigmoid(up(silu(down(n) / N)))                       (T, N, H): a low-rank input mixer
    x = mean_n(w_n * n_n)                                    (T, H): the stage's input
    inject = 2 sigmoid(block_inject(n) / N)                  (T, N)
    h'_i = h_i + inject_i f(x)

`HyperConnection`'s `pre`, `post` and `comb` come from the `hyper_connection` op family's
`mhc_weights` (one C++ call a stage; `vllm_mamba.ops.hyper_connection`). Both are replicated
under tensor parallelism (the streams are whole on every rank). Their transcendental functions
run `rowwise` (or per row in C++), so a speculative chain's rows get the bits of the tokens
decoded one by one.

Glossary: T tokens, N streams (`hc_mult`), H hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops import hyper_connection as hc_ops
from vllm_mamba.ops.table import MambaOps

Context = tuple[torch.Tensor, ...]  # what `collapse` hands `expand`


class StreamConnection(nn.Module):
    """Collapses a layer's residual streams into a stage's input and mixes its output back."""

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, Context]:
        """`streams (T, N, H)` -> the stage's input `(T, H)` and what `expand` needs."""
        raise NotImplementedError

    def expand(self, out: torch.Tensor, ctx: Context, streams: torch.Tensor) -> torch.Tensor:
        """The stage's output `out (T, H)` and the input `streams` -> the new streams."""
        raise NotImplementedError


class HyperConnection(StreamConnection):
    """The mHC weights of one stage: collapse the streams, then expand and mix them back."""

    def __init__(
        self, hidden_size: int, streams: int, iters: int, eps: float, norm_eps: float, ops: MambaOps
    ) -> None:
        """Args: `hidden_size` H; `streams` N (`hc_mult`); `iters` the Sinkhorn iterations
        (`hc_sinkhorn_iters`); `eps` the floor of the weights and the sums (`hc_eps`);
        `norm_eps` the unweighted RMS norm's epsilon (`rms_norm_eps`); `ops` the table whose
        `linear` projects the streams (each row as alone: a speculative chain's rows are
        bitwise the one-token steps')."""
        super().__init__()
        self.linear_op = ops.linear
        self.weights_op = ops.family(hc_ops.FAMILY).mhc_weights
        if streams < 1 or iters < 1:
            raise ValueError(f"hc_mult and hc_sinkhorn_iters must be >= 1, got {streams}, {iters}")
        self.streams, self.iters, self.eps, self.norm_eps = streams, iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nn.Parameter(torch.empty(width, streams * hidden_size))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, Context]:
        """`streams (T, N, H)` -> `(x (T, H), (post (T, N), comb (T, N, N)))`: the stage's
        input and the float32 weights `expand` takes."""
        n = self.streams
        flat = streams.reshape(streams.shape[0], -1).float()  # (T, N H)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        z = self.linear_op(flat, self.fn.float(), None)  # (T, (2 + N) N)
        pre, post, comb = self.weights_op(
            z, self.base, self.scale, n, self.iters, self.eps
        )  # (T, N), (T, N), (T, N, N) float32
        x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # (T, H)
        return x, (post, comb)

    def expand(self, out: torch.Tensor, ctx: Context, streams: torch.Tensor) -> torch.Tensor:
        """The new streams `post_i out + sum_j comb_ji streams_j` -> `(T, N, H)` in the streams'
        dtype, from the stage's output `out (T, H)` and the input `streams (T, N, H)`."""
        post, comb = ctx
        dtype = streams.dtype
        expanded = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)  # (T, N, H)
        return expanded + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class GatedResidual(StreamConnection):
    """Qwen4-Exp's gated hyper-connection of one stage (or, with `inject=False`, the model's
    final merge of the streams, `merge`)."""

    def __init__(
        self, hidden_size: int, streams: int, rank: int, eps: float, ops: MambaOps,
        inject: bool = True,
    ) -> None:  # fmt: skip
        """Args: `hidden_size` H; `streams` N (`hc_count`); `rank` the input mixer's rank
        (`hc_lowrank`); `eps` the norm's epsilon; `ops` the ops table (its `linear` runs the
        projections); `inject` whether the stage's output is mixed back
        (`block_inject_weight`)."""
        super().__init__()
        self.hidden_size, self.streams, self.eps = hidden_size, streams, eps
        width = streams * hidden_size
        self.hc_norm = _GroupedNormWeight(width)
        self.input_mix_weight_down = Linear(width, rank, False, ops)
        self.input_mix_weight_up = Linear(rank, width, False, ops)
        self.block_inject_weight = Linear(width, streams, False, ops) if inject else None

    def _normed(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream RMS-normed, times `1 + hc_norm` -> `(T, N H)` in the streams' dtype."""
        xf = streams.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (T, N, H)
        return (normed.flatten(1) * (1.0 + self.hc_norm.weight.float())).to(streams.dtype)

    def merge(self, streams: torch.Tensor) -> torch.Tensor:
        """`streams (T, N, H)` -> the mixed input `(T, H)`."""
        return self._mix(self._normed(streams))

    def _mix(self, normed: torch.Tensor) -> torch.Tensor:
        n = self.streams
        low = rowwise(F.silu, self.input_mix_weight_down(normed) / n)  # (T, rank)
        w = rowwise(torch.sigmoid, self.input_mix_weight_up(low))  # (T, N H)
        mixed = w.unflatten(-1, (n, self.hidden_size)) * normed.unflatten(-1, (n, self.hidden_size))
        return mixed.mean(dim=-2)  # (T, H)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, Context]:
        """`streams (T, N, H)` -> `(x (T, H), (inject (T, N),))`."""
        assert self.block_inject_weight is not None, "a merge-only connection has no stage"
        normed = self._normed(streams)
        inject = 2 * rowwise(torch.sigmoid, self.block_inject_weight(normed) / self.streams)
        return self._mix(normed), (inject,)

    def expand(self, out: torch.Tensor, ctx: Context, streams: torch.Tensor) -> torch.Tensor:
        """`streams_i + inject_i out` -> `(T, N, H)`."""
        (inject,) = ctx
        return streams + out.unsqueeze(-2) * inject.unsqueeze(-1)


class _GroupedNormWeight(nn.Module):
    """Holds `hc_norm.weight (N H,)` under the checkpoint's name (zero-centred: `1 + w`)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))


__all__ = ["GatedResidual", "HyperConnection", "StreamConnection"]
