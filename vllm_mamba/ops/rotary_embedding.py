"""Rotary position embedding (RoPE) of queries and keys, before they enter the KV cache.

Pure-PyTorch reference for the attention layers of hybrids that use rotary (part 2 of the
hybrid work; Jamba has none). Two pairings, as in vLLM: NeoX style (`is_neox=True`, the Llama /
Hugging Face `rotate_half`: dimension `i` pairs with `i + rot_dim / 2`) and GPT-J style
(`is_neox=False`: dimension `2i` pairs with `2i + 1`). Partial rotary (`rot_dim < head_dim`)
rotates the first `rot_dim` dimensions of each head and passes the rest through.

Glossary: T tokens; H heads; D head dim; R `rot_dim` (even, <= D). `cos_sin_cache` is
`(max_position, R)`: the `R / 2` cosines then the `R / 2` sines of each position (vLLM's).
"""

from __future__ import annotations

import torch

__all__ = ["rotary_cos_sin_cache", "rotary_embedding_ref"]


def rotary_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, attention_factor: float = 1.0
) -> torch.Tensor:
    """The float32 `(max_position, R)` table of cosines and sines of a RoPE.

    Args:
        inv_freq: `(R/2,)` float32 inverse frequencies (`layers.rope_scaling`; plain RoPE:
            `base ** (-2i / R)`).
        max_position: positions in the table.
        attention_factor: the factor on every cosine and sine (scaled RoPE; 1 for plain).

    Returns:
        `(max_position, R)`: `cos(p * f_i) * a`, then `sin(p * f_i) * a`.
    """
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq  # (P, R/2)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return table * attention_factor if attention_factor != 1.0 else table


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotates the first `2 * cos.shape[-1]` dims of `x (T, H, D)`; cos, sin `(T, 1, R/2)`."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat([out1, out2], dim=-1)
    else:
        rotated = torch.stack([out1, out2], dim=-1).flatten(-2)  # interleave back
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies RoPE to each token's query and key heads at the token's position.

    Args:
        positions: `(T,)` int absolute position of each token.
        query: `(T, Hq, D)`.
        key: `(T, Hkv, D)`.
        cos_sin_cache: `(max_position, R)` from `rotary_cos_sin_cache` (or a scaled variant).
        is_neox: NeoX pairing (`rotate_half`) when True, GPT-J interleaved pairing when False.

    Returns:
        The rotated `(query, key)`, new tensors in the input dtypes (math in float32).
    """
    half = cos_sin_cache.shape[-1] // 2
    table = cos_sin_cache[positions.long()].float()  # (T, R)
    cos, sin = table[:, None, :half], table[:, None, half:]  # (T, 1, R/2)
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)
