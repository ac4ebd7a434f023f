"""The placeholder attention backend for attention-free models: no KV cache at all.

Its metadata carries only what state-space mixers read: how many decodes and prefills the
flat batch holds, where each prefill chunk starts (`query_start_loc`), the state slot of every
sequence, and whether a prefill continues from a saved state (chunked prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mamba.attention.backend import AttentionBackend, AttentionMetadata, StepLayout


@dataclass
class PlaceholderAttentionMetadata(AttentionMetadata):
    """Per-step metadata; the token layout is `[decodes (one each)] + [prefill chunks]`.

    Tensors: `decode_state_indices (num_decodes,)`, `prefill_query_start_loc
    (num_prefills + 1,)` relative to the first prefill token, `prefill_state_indices
    (num_prefills,)`, `prefill_has_initial_state (num_prefills,)` bool,
    `seq_lens (num_decodes + num_prefills,)` tokens after this step.
    """

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    decode_state_indices: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_state_indices: torch.Tensor
    prefill_has_initial_state: torch.Tensor
    seq_lens: torch.Tensor


class PlaceholderAttentionBackend(AttentionBackend):
    """Selected for models with no attention layers."""

    @staticmethod
    def get_name() -> str:
        return "placeholder"

    @staticmethod
    def build_metadata(layout: StepLayout, device: torch.device) -> PlaceholderAttentionMetadata:
        num_decodes = len(layout.decode_slots)
        qsl = [0]
        for n in layout.prefill_lens:
            qsl.append(qsl[-1] + n)
        seq_lens = [1] * num_decodes + [
            c + n for c, n in zip(layout.prefill_context_lens, layout.prefill_lens)
        ]

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return PlaceholderAttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=len(layout.prefill_lens),
            num_decode_tokens=num_decodes,
            num_prefill_tokens=qsl[-1],
            decode_state_indices=ints(layout.decode_slots),
            prefill_query_start_loc=ints(qsl),
            prefill_state_indices=ints(layout.prefill_slots),
            prefill_has_initial_state=torch.tensor(
                [c > 0 for c in layout.prefill_context_lens], dtype=torch.bool, device=device
            ),
            seq_lens=ints(seq_lens),
        )
