"""The step metadata of state-space layers, and its one builder.

Every state-space mixer (Mamba, Mamba2, the Mamba layers of a hybrid) reads the same few
things about a step's flat batch `[decodes (one token each)] + [prefill chunks]`: how many
decodes and prefills it holds, where each prefill chunk starts, the state slot of every
sequence, and whether a prefill continues from a saved state (chunked prefill). The eager path
and the CUDA-graph capture both build it with `build_mamba_metadata`. How a mixer runs its
recurrence over these rows (decodes, speculative waves, prefill chunks) is
`vllm_mamba.layers.recurrent_step`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from vllm_mamba.attention.backend import AttentionMetadata, StepLayout

# Re-exported for plugins written against it; the layers call `recurrent_step`.
from vllm_mamba.layers.recurrent_step import run_decode_waves as run_decode_waves


@dataclass
class MambaMetadata(AttentionMetadata):
    """What the mixers read about one step.

    Attributes:
        num_decodes: decoding sequences; their tokens come first in the flat batch.
        num_prefills: prefill chunks, after the decodes.
        decode_state_indices: `(num_decodes,)` int32, the state slot of each decode.
        prefill_query_start_loc: `(num_prefills + 1,)` int32, where each chunk starts,
            counted from the first prefill token.
        prefill_state_indices: `(num_prefills,)` int32, the state slot of each chunk.
        prefill_has_initial_state: `(num_prefills,)` bool, True when the chunk continues a
            sequence whose state already holds earlier tokens.
        decode_waves: decode rows per wave (speculative chains, see the module docstring);
            empty when every decode row is its own sequence.
        wave_copies: per wave but the last, `(src, dst)` int64 slot tensors: after that wave
            the states of slots `src` are saved into slots `dst`.
        decode_chain_src / decode_chain_dst: with waves, `(num_decodes,)` int64: the slot each
            decode row reads its state from and writes it to (position w of a chain writes
            the spare slot of position w, its last position the sequence's own slot), for
            kernels that run a whole chain in one call (`fused_decode_layer`); None without.
    """

    num_decodes: int
    num_prefills: int
    decode_state_indices: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_state_indices: torch.Tensor
    prefill_has_initial_state: torch.Tensor
    decode_waves: tuple[int, ...] = field(default=(), kw_only=True)
    wave_copies: tuple[tuple[torch.Tensor, torch.Tensor], ...] = field(default=(), kw_only=True)
    decode_chain_src: torch.Tensor | None = field(default=None, kw_only=True)
    decode_chain_dst: torch.Tensor | None = field(default=None, kw_only=True)


def build_mamba_metadata(layout: StepLayout, device: torch.device) -> MambaMetadata:
    """Builds the step's metadata with one host-to-device copy.

    Args:
        layout: the step's flat batch.
        device: where the model runs.

    Returns:
        The metadata; its tensors are views of one int32 buffer on `device`.
    """
    num_decodes = len(layout.decode_slots)
    num_prefills = len(layout.prefill_lens)
    qsl = list(itertools.accumulate(layout.prefill_lens, initial=0))
    initial = [int(c > 0) for c in layout.prefill_context_lens]
    values = layout.decode_slots + qsl + layout.prefill_slots + initial
    packed = torch.tensor(values, dtype=torch.int32).to(device)  # (D + 3P + 1,)
    decodes, qsl_t, slots, has_initial = packed.split(
        [num_decodes, num_prefills + 1, num_prefills, num_prefills]
    )
    return MambaMetadata(
        num_decodes=num_decodes,
        num_prefills=num_prefills,
        decode_state_indices=decodes,
        prefill_query_start_loc=qsl_t,
        prefill_state_indices=slots,
        prefill_has_initial_state=has_initial.bool(),
        decode_waves=tuple(layout.decode_waves),
        wave_copies=_wave_copies(layout, device),
        decode_chain_src=_longs(layout.decode_chain_src, device),
        decode_chain_dst=_longs(layout.decode_chain_dst, device),
    )


def _wave_copies(
    layout: StepLayout, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per wave but the last, `(src, dst)`: the rows of that wave whose chain goes on save the
    state of their sequence's slot (where the ops run them in place) into their own slot."""
    copies, start = [], 0
    for rows in layout.decode_waves[:-1]:
        pairs = [
            (slot, dst)
            for slot, dst in zip(
                layout.decode_slots[start : start + rows],
                layout.decode_chain_dst[start : start + rows],
            )
            if slot != dst
        ]
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        copies.append((_longs(src, device), _longs(dst, device)))
        start += rows
    return tuple(copies)


def _longs(values: list[int], device: torch.device) -> torch.Tensor | None:
    return torch.tensor(values, dtype=torch.long, device=device) if values else None
