"""The paged attention backend of hybrid models: KV blocks beside the state-space slots.

Its step metadata, `PagedMetadata`, is `MambaMetadata` (what the state-space layers read) plus
what the attention layers read about the same flat batch `[decodes] + [prefill chunks]`: the
cache slot of every token (`block_id * block_size + offset`) and its position in its sequence
(rotary embeddings read it), and per decode row and per prefill chunk its block table and its
length in the cache after this step. With several KV groups (sliding-window layers,
`kv_cache.KVGroups`) the top-level slots and tables are group 0's and `groups` holds every
group's (`KVGroupView`); a layer reads its own group's through `kv_view`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_mamba.attention.backend import AttentionBackend, StepLayout
from vllm_mamba.attention.mamba_metadata import MambaMetadata, build_mamba_metadata


@dataclass(frozen=True)
class KVGroupView:
    """One KV group's part of a step: its slot per token and its block tables."""

    slot_mapping: torch.Tensor  # (T,) int32
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) int32
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks) int32


@dataclass
class PagedMetadata(MambaMetadata):
    """`MambaMetadata` plus the attention layers' view of the step.

    Attributes:
        slot_mapping: `(T,)` int32, the KV cache slot each token's key and value go to.
        positions: `(T,)` int32, each token's absolute position in its sequence.
        decode_block_tables: `(num_decodes, max_blocks)` int32, zero-padded.
        decode_seq_lens: `(num_decodes,)` int32, cached tokens after this step (the new
            token included); 0 marks a padding row.
        prefill_block_tables: `(num_prefills, max_blocks)` int32, zero-padded.
        prefill_seq_lens: `(num_prefills,)` int32, context plus this chunk.
        prefill_rope_lens: `(num_prefills,)` int32, the sequence length a RoPE that follows
            it (`dynamic`, `longrope`) rotates the chunk's prompt tokens at: the prompt's
            length (the layout's `prefill_prompt_lens`), else the chunk's end.
        rope_positions: `(T,)` int32, the position each token's RoPE rotates at: `positions`
            itself (the same tensor) unless an M-RoPE request shifts its text after an image.
        mrope_positions: `(3, T)` int32 (time, height, width rows) when the step holds image
            tokens of an M-RoPE model, else None.
        rope_tables: the step's per-token cos / sin of such RoPEs, filled by the first rotary
            layer that needs one and reused by the others (keyed by the frequencies).
        groups: every KV group's slots and tables (the first is the top-level fields').
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_rope_lens: torch.Tensor
    rope_positions: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    rope_tables: dict[Any, torch.Tensor] = field(default_factory=dict)
    groups: list[KVGroupView] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rope_positions is None:
            self.rope_positions = self.positions

    def kv_view(self, group: int) -> KVGroupView:
        """The slots and block tables of KV group `group`."""
        if not self.groups:
            return KVGroupView(
                self.slot_mapping, self.decode_block_tables, self.prefill_block_tables
            )
        return self.groups[group]


def _slots(
    table: list[int], start: int, end: int, block_size: int, groups: int = 1, group: int = 0
) -> list[int]:
    """Cache slots of positions `[start, end)` of a sequence with blocks `table` (group
    `group` of `groups` interleaved tables)."""
    return [
        table[p // block_size * groups + group] * block_size + p % block_size
        for p in range(start, end)
    ]


def _group_views(layout: StepLayout, device: torch.device, dec: torch.Tensor,
                 pre: torch.Tensor) -> list[KVGroupView]:  # fmt: skip
    """Each KV group's slots and tables, from the interleaved tables `dec` and `pre`."""
    groups, bs = layout.kv_groups, layout.block_size
    views = []
    for g in range(groups):
        slots: list[int] = []
        for table, ctx in zip(layout.decode_block_tables, layout.decode_context_lens):
            slots += _slots(table, ctx, ctx + 1, bs, groups, g)
        for table, ctx, n in zip(
            layout.prefill_block_tables, layout.prefill_context_lens, layout.prefill_lens
        ):
            slots += _slots(table, ctx, ctx + n, bs, groups, g)
        slot_t = torch.tensor(slots, dtype=torch.int32).to(device)
        views.append(
            KVGroupView(slot_t, dec[:, g::groups].contiguous(), pre[:, g::groups].contiguous())
        )
    return views


def _padded(tables: list[list[int]]) -> tuple[list[int], int]:
    """Row-major values of `tables` zero-padded to the longest, and that width."""
    width = max((len(t) for t in tables), default=0)
    flat: list[int] = []
    for table in tables:
        flat += table
        flat += [0] * (width - len(table))
    return flat, width


def build_paged_metadata(layout: StepLayout, device: torch.device) -> PagedMetadata:
    """Builds the step's metadata (one more host-to-device copy than `MambaMetadata`).

    Args:
        layout: the step's flat batch, with block tables and context lengths.
        device: where the model runs.
    """
    base = build_mamba_metadata(layout, device)
    bs = layout.block_size
    slot_mapping: list[int] = []
    positions: list[int] = list(layout.decode_context_lens)
    for table, ctx in zip(layout.decode_block_tables, layout.decode_context_lens):
        slot_mapping += _slots(table, ctx, ctx + 1, bs)
    for table, ctx, n in zip(
        layout.prefill_block_tables, layout.prefill_context_lens, layout.prefill_lens
    ):
        slot_mapping += _slots(table, ctx, ctx + n, bs)
        positions += range(ctx, ctx + n)
    decode_lens = [c + 1 for c in layout.decode_context_lens]
    prefill_lens = [c + n for c, n in zip(layout.prefill_context_lens, layout.prefill_lens)]
    rope_lens = layout.prefill_prompt_lens or prefill_lens
    dec_flat, dec_width = _padded(layout.decode_block_tables)
    pre_flat, pre_width = _padded(layout.prefill_block_tables)
    values = slot_mapping + positions + dec_flat + decode_lens + pre_flat + prefill_lens + rope_lens
    packed = torch.tensor(values, dtype=torch.int32).to(device)
    nd, np_ = len(decode_lens), len(prefill_lens)
    slots, pos, dec_t, dec_l, pre_t, pre_l, rope_l = packed.split(
        [len(slot_mapping), len(positions), nd * dec_width, nd, np_ * pre_width, np_, np_]
    )
    dec_t, pre_t = dec_t.view(nd, dec_width), pre_t.view(np_, pre_width)
    groups = _group_views(layout, device, dec_t, pre_t) if layout.kv_groups > 1 else []
    first = groups[0] if groups else KVGroupView(slots, dec_t, pre_t)
    rope_pos, mrope = _rope_positions(layout, pos, device)
    return PagedMetadata(
        **vars(base),
        slot_mapping=first.slot_mapping,
        positions=pos,
        decode_block_tables=first.decode_block_tables,
        decode_seq_lens=dec_l,
        prefill_block_tables=first.prefill_block_tables,
        prefill_seq_lens=pre_l,
        prefill_rope_lens=rope_l,
        rope_positions=rope_pos,
        mrope_positions=mrope,
        groups=groups,
    )


def _rope_positions(
    layout: StepLayout, positions: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(rope_positions (T,), mrope_positions (3, T) or None)` of the step: `positions` when
    no token is shifted; one row when the three M-RoPE rows agree (text only: the plain and
    fused paths rotate at it); all three when image tokens are in the step."""
    rows = layout.rope_positions
    if rows is None:
        return positions, None
    t, h, w = rows
    first = torch.tensor(t, dtype=torch.int32).to(device)
    if t == h == w:
        return first, None
    return first, torch.tensor(rows, dtype=torch.int32).to(device)


class PagedAttentionBackend(AttentionBackend):
    """Selected for models with attention layers (hybrids). Its decode steps run eagerly:
    their metadata carries each step's block tables and context lengths."""

    decode_cuda_graphs = False

    @staticmethod
    def build_metadata(layout: StepLayout, device: torch.device) -> PagedMetadata:
        return build_paged_metadata(layout, device)
