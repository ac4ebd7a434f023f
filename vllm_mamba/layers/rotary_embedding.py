"""`RotaryEmbedding`: rotary position embedding (RoPE) of one attention layer's queries and keys.

The hybrids' attention layers rotate queries and keys at each token's absolute position (the
paged metadata's `positions`) before the keys enter the KV cache. NeoX pairing
(`rotate_half`, as transformers' Llama-style models), optionally partial (`partial_rotary_factor`:
the first `rot_dim` dimensions of each head rotate, the rest pass through). The cos/sin table is
built on first use on the tensors' device (not a parameter, so nothing to load).

Glossary: T tokens in the step, H heads, D head dim, R rotated dims per head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.ops.rotary_embedding import rotary_cos_sin_cache, rotary_embedding_ref


def rope_settings(config: Any, head_dim: int) -> tuple[float, int]:
    """`(base, rot_dim)` of the config's plain RoPE (`rope_parameters` or `rope_theta`).

    Raises:
        ValueError: a scaled RoPE (`rope_type` other than `default`), which is not implemented.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only plain RoPE)")
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return base, int(head_dim * (factor or 1.0))


class RotaryEmbedding(nn.Module):
    """Rotates `q (T, Hq * D)` and `k (T, Hkv * D)` at `positions (T,)` (NeoX pairing)."""

    def __init__(self, head_dim: int, rot_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        if rot_dim % 2 or not 0 < rot_dim <= head_dim:
            raise ValueError(f"rotary dims ({rot_dim}) must be even and at most head_dim")
        self.head_dim = head_dim
        self.rot_dim = rot_dim
        self.max_position = max_position
        self.base = base
        self._cos_sin: torch.Tensor | None = None  # (max_position, R) float32

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            table = rotary_cos_sin_cache(self.rot_dim, self.max_position, self.base)
            self._cos_sin = table.to(device)
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the rotated `(q, k)` in their shapes and dtypes."""
        num_tokens = q.shape[0]
        q3 = q.view(num_tokens, -1, self.head_dim)  # (T, Hq, D)
        k3 = k.view(num_tokens, -1, self.head_dim)  # (T, Hkv, D)
        q3, k3 = rotary_embedding_ref(positions, q3, k3, self._table(q.device), is_neox=True)
        return q3.reshape(q.shape), k3.reshape(k.shape)
