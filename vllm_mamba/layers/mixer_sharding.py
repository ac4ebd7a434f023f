"""Which channels, heads and groups of a mixer (state-space or attention) one tensor-parallel
rank holds.

Mamba splits its intermediate channels evenly: rank r holds channels `[r I/N, (r+1) I/N)` of
x, z, the conv, `dt_proj`, `A_log` and `D` (and their state). Mamba2 splits by heads; the B
and C groups are split when `n_groups` is a multiple of N, else (N a multiple of `n_groups`)
each rank holds the one group its heads read, so groups are replicated over N / G ranks.

The Gated DeltaNet splits its key heads and their value heads with the ratio kept: rank r holds
key heads `[r Hk/N, (r+1) Hk/N)` and value heads `[r Hv/N, (r+1) Hv/N)` (the value heads that
read them), their q, k and v conv channels, `A_log`, `dt_bias` and state.

Attention splits its query heads; its key/value heads are split when there are at least as
many as ranks, else each rank holds the one its queries read (replicated over N / Hkv ranks).

Glossary: I intermediate size, NH heads, P head dim, G groups, N state size, CD conv channels,
Hkv key/value heads, D attention head dim; Hk, Hv, Dk, Dv the Gated DeltaNet's key and value
heads and head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.parallel_linear import Ranges, shard_param


@dataclass(frozen=True)
class Mamba2Shard:
    """One rank's part of a Mamba2 mixer (local counts and global ranges)."""

    num_heads: int  # local heads
    n_groups: int  # local groups
    heads: tuple[int, int]  # (first head, heads)
    channels: tuple[int, int]  # (first channel of x / z, channels)
    groups: tuple[int, int]  # (first group, groups)

    def conv_ranges(self, intermediate: int, gn_total: int, state_size: int) -> Ranges:
        """Ranges of the conv channels `[x (I), B (G N), C (G N)]` this rank holds."""
        g0, g = self.groups
        return [
            self.channels,
            (intermediate + g0 * state_size, g * state_size),
            (intermediate + gn_total + g0 * state_size, g * state_size),
        ]

    def in_proj_ranges(self, intermediate: int, gn_total: int, state_size: int) -> Ranges:
        """Ranges of `in_proj`'s outputs `[z (I), x B C (CD), dt (NH)]` this rank holds."""
        c0, c = self.channels
        conv_ranges = self.conv_ranges(intermediate, gn_total, state_size)
        conv = [(intermediate + s, n) for s, n in conv_ranges]
        dt = (intermediate + intermediate + 2 * gn_total + self.heads[0], self.heads[1])
        return [(c0, c), *conv, dt]


def mamba2_shard(num_heads: int, head_dim: int, n_groups: int, tp: TensorParallel) -> Mamba2Shard:
    """This rank's heads, channels and groups.

    Raises:
        ValueError: heads not a multiple of N, or groups neither a multiple nor a divisor of N.
    """
    h0, nh = tp.range(num_heads, "num_heads")
    if n_groups % tp.size == 0:
        groups = tp.range(n_groups, "n_groups")
    elif tp.size % n_groups == 0:
        groups = (tp.rank // (tp.size // n_groups), 1)
    else:
        raise ValueError(
            f"n_groups ({n_groups}) must be a multiple or a divisor of tensor_parallel_size "
            f"({tp.size})"
        )
    return Mamba2Shard(nh, groups[1], (h0, nh), (h0 * head_dim, nh * head_dim), groups)


@dataclass(frozen=True)
class GatedDeltaShard:
    """One rank's key and value heads of a Gated DeltaNet (global `(first, count)` ranges)."""

    num_k_heads: int  # global Hk
    num_v_heads: int  # global Hv
    head_k_dim: int
    head_v_dim: int
    k_heads: tuple[int, int]
    v_heads: tuple[int, int]

    @property
    def key_total(self) -> int:
        """The global q (or k) channels `Hk Dk`."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_total(self) -> int:
        """The global v (or z) channels `Hv Dv`."""
        return self.num_v_heads * self.head_v_dim

    def key_range(self) -> tuple[int, int]:
        """This rank's channels of q (or k) among `Hk * Dk`."""
        return self.k_heads[0] * self.head_k_dim, self.k_heads[1] * self.head_k_dim

    def value_range(self) -> tuple[int, int]:
        """This rank's channels of v (or the gate z) among `Hv * Dv`."""
        return self.v_heads[0] * self.head_v_dim, self.v_heads[1] * self.head_v_dim

    def conv_ranges(self) -> Ranges:
        """This rank's conv channels of `[q (Hk Dk), k (Hk Dk), v (Hv Dv)]`."""
        (k0, k), (v0, v) = self.key_range(), self.value_range()
        return [(k0, k), (self.key_total + k0, k), (2 * self.key_total + v0, v)]


def gated_delta_shard(
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, tp: TensorParallel
) -> GatedDeltaShard:
    """This rank's key and value heads.

    Raises:
        ValueError: value heads not a multiple of key heads, or key heads not a multiple of N.
    """
    if num_v_heads % num_k_heads:
        raise ValueError(
            f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
            f"linear_num_key_heads ({num_k_heads})"
        )
    k_heads = tp.range(num_k_heads, "linear_num_key_heads")
    v_heads = tp.range(num_v_heads, "linear_num_value_heads")
    return GatedDeltaShard(num_k_heads, num_v_heads, head_k_dim, head_v_dim, k_heads, v_heads)


def shard_mixer_params(
    mixer: nn.Module, conv_ranges: Ranges, conv_total: int, head_ranges: Ranges, head_total: int
) -> None:
    """Marks the conv (`conv1d.*`) and per-channel / per-head parameters (`A_log`, `D`,
    `dt_bias` when present) of `mixer` as this rank's slices."""
    shard_param(mixer.conv1d, "weight", 0, conv_ranges, conv_total)
    if mixer.conv1d.bias is not None:
        shard_param(mixer.conv1d, "bias", 0, conv_ranges, conv_total)
    for name in ("A_log", "D", "dt_bias"):
        if getattr(mixer, name, None) is not None:
            shard_param(mixer, name, 0, head_ranges, head_total)


def kv_head_ranges(
    num_kv_heads: int, head_dim: int, tp: TensorParallel
) -> tuple[Ranges | None, int]:
    """This rank's key/value projection rows (None: an even split) and its KV head count.

    Raises:
        ValueError: `num_kv_heads` neither a multiple nor a divisor of the ranks.
    """
    if num_kv_heads % tp.size == 0:
        return None, num_kv_heads // tp.size
    if tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must be a multiple or a divisor of "
            f"tensor_parallel_size ({tp.size})"
        )
    head = tp.rank // (tp.size // num_kv_heads)
    return [(head * head_dim, head_dim)], 1
