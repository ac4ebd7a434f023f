"""`rotary_embedding_ref` against transformers' Llama (NeoX pairing) and GPT-J RoPE."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from vllm_mamba.layers.rope_scaling import plain_frequencies
from vllm_mamba.ops.rotary_embedding import rotary_cos_sin_cache, rotary_embedding_ref


def _inputs(rot_dim: int, head_dim: int = 16):
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 7, 2, 40])
    query, key = torch.randn(5, 4, head_dim), torch.randn(5, 2, head_dim)
    return (
        positions,
        query,
        key,
        rotary_cos_sin_cache(plain_frequencies(10000.0, rot_dim).inv_freq, 64),
    )


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_neox_matches_llama(rot_dim: int) -> None:
    """NeoX pairing equals Llama's `rotate_half` (partial rotary: the tail passes through)."""
    positions, query, key, cache = _inputs(rot_dim)
    q_out, k_out = rotary_embedding_ref(positions, query, key, cache, is_neox=True)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # (T, R)
    q_hf, k_hf = llama_rope(query[..., :rot_dim], key[..., :rot_dim], cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(q_out, torch.cat([q_hf, query[..., rot_dim:]], -1))
    torch.testing.assert_close(k_out, torch.cat([k_hf, key[..., rot_dim:]], -1))


def test_gptj_matches_transformers() -> None:
    """GPT-J pairing equals transformers' GPT-J rotary on the first `rot_dim` dims."""
    rot_dim = 8
    positions, query, key, cache = _inputs(rot_dim)
    q_out, _ = rotary_embedding_ref(positions, query, key, cache, is_neox=False)
    sin, cos = create_sinusoidal_positions(64, rot_dim)[positions].chunk(2, dim=-1)
    q_hf = gptj_rope(query[None, :, :, :rot_dim], sin[None], cos[None])[0]
    torch.testing.assert_close(q_out, torch.cat([q_hf, query[..., rot_dim:]], -1))


def test_bfloat16_keeps_dtype_and_position_zero_is_identity() -> None:
    positions, query, key, cache = _inputs(16)
    q_out, k_out = rotary_embedding_ref(positions, query.bfloat16(), key.bfloat16(), cache, True)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out[0], query[0].bfloat16())
