"""RMS norms whose statistics span channels held by several tensor-parallel ranks.

- Mamba2's gated RMSNorm (`gated_rms_norm`): its statistics run over groups of `I / G`
  channels. When a rank holds whole groups (`n_groups` a multiple of the ranks) it is the
  ordinary `GatedRMSNorm` on its channels. When a group is spread over several ranks, each rank
  sums the squares of its part of the group and the sums are all-reduced (one `(T, G)` tensor:
  a rank fills its group's column), so every rank normalises by the variance over the group.
- A whole-projection RMSNorm (`projection_rms_norm`: OLMo Hybrid's q/k norms over all heads
  at once): each rank sums the squares of its channels, the `(T, 1)` sums are all-reduced and
  divided by `C_r * N` (every rank holds `C_r` channels and every channel is held equally
  often, also when key/value heads are replicated over ranks).

Glossary: T tokens, I intermediate size (this rank's: `I_r`), G groups, C projection
channels (this rank's: `C_r`), N ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import GatedRMSNorm, RMSNorm
from vllm_mamba.layers.parallel_linear import Ranges, shard_param
from vllm_mamba.ops.table import MambaOps


class SplitGroupGatedRMSNorm(GatedRMSNorm):
    """The gated norm of channels `[start, start + I_r)` of one group spread over ranks."""

    def __init__(
        self,
        hidden_size: int,
        group_size: int,
        eps: float,
        ops: MambaOps,
        tp: TensorParallel,
        channels: tuple[int, int],
    ) -> None:
        super().__init__(channels[1], group_size, eps, ops)
        self.tp = tp
        self.num_groups = hidden_size // group_size
        self.group = channels[0] // group_size
        assert (channels[0] + channels[1] - 1) // group_size == self.group

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`x, z (T, I_r)` -> `(T, I_r)` in x's dtype (math in float32)."""
        gated = x.float() * F.silu(z.float())  # (T, I_r)
        sums = gated.new_zeros(gated.shape[0], self.num_groups)  # (T, G)
        sums[:, self.group] = gated.pow(2).sum(-1)
        variance = all_reduce(sums, self.tp)[:, self.group, None] / self.group_size  # (T, 1)
        normed = gated * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * normed.to(x.dtype)


def gated_rms_norm(
    hidden_size: int,
    group_size: int,
    eps: float,
    ops: MambaOps,
    tp: TensorParallel = SINGLE,
    channels: tuple[int, int] | None = None,
) -> GatedRMSNorm:
    """The gated norm of this rank's `channels` (`(start, count)`; all with one rank)."""
    if tp.size == 1 or channels is None:
        return GatedRMSNorm(hidden_size, group_size, eps, ops)
    if channels[0] % group_size == 0 and channels[1] % group_size == 0:
        norm = GatedRMSNorm(channels[1], group_size, eps, ops)
    else:
        norm = SplitGroupGatedRMSNorm(hidden_size, group_size, eps, ops, tp, channels)
    shard_param(norm, "weight", 0, [channels], hidden_size)
    return norm


class SplitRMSNorm(RMSNorm):
    """`weight * x / sqrt(mean(x^2) + eps)` over a projection spread over ranks: this rank's
    `C_r` channels, the mean over the whole projection."""

    def __init__(self, channels: int, eps: float, tp: TensorParallel) -> None:
        super().__init__(channels, eps)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, C_r)` -> `(T, C_r)` in x's dtype (statistics in float32)."""
        xf = x.float()
        sums = all_reduce(xf.pow(2).sum(-1, keepdim=True), self.tp)  # (T, 1)
        variance = sums / (xf.shape[-1] * self.tp.size)
        return self.weight * (xf * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


def projection_rms_norm(
    total: int, eps: float, tp: TensorParallel = SINGLE, ranges: Ranges | None = None
) -> RMSNorm:
    """The RMSNorm over a whole projection of `total` channels: this rank's `ranges` of it
    (an even split when None); the plain `RMSNorm` with one rank."""
    if tp.size == 1:
        return RMSNorm(total, eps)
    ranges = ranges if ranges is not None else [tp.range(total, "normed projection channels")]
    norm = SplitRMSNorm(sum(n for _, n in ranges), eps, tp)
    shard_param(norm, "weight", 0, ranges, total)
    return norm
