"""`RotaryEmbedding`: rotary position embedding (RoPE) of one attention layer's queries and keys.

The hybrids' attention layers rotate queries and keys at each token's absolute position (the
paged metadata's `positions`) before the keys enter the KV cache. NeoX pairing
(`rotate_half`, as transformers' Llama-style models), optionally partial (`partial_rotary_factor`:
the first `rot_dim` dimensions of each head rotate, the rest pass through). The cos/sin table is
built on first use on the tensors' device (not a parameter, so nothing to load) from the
config's frequencies, plain or scaled (`rope_scaling.py`).

`dynamic` and `longrope` change the frequencies with the sequence's length. transformers
recomputes them once per forward call from `max(position_ids) + 1` and keeps the keys it has
cached as they were rotated: `generate` on one sequence rotates the prompt at the prompt's
length and each later token at its position plus one. Here every token is rotated at
`max(position + 1, prompt length)` (`step_lengths`, from the paged metadata) and its key enters
the cache so rotated: that behaviour per sequence, whatever shares the batch, however the prompt
is chunked, and after a preemption's recompute. Where it differs, transformers itself depends on
more than the sequence: a padded batch of several sequences (it takes the longest), a rotary
module reused after a longer sequence (`dynamic` keeps its longest length until a call shorter
than `max_position_embeddings`), assisted generation (a chain of drafts at its last length); and
with `enable_prefix_caching`, a hit reuses the cached keys as they were rotated, at the prompt
length of the request that computed them.

M-RoPE (Qwen3.5's image-text checkpoints: `mrope_section` in the RoPE parameters) gives each
token three positions (time, height, width); frequency `j` of the rotated half turns at the
height row when `j % 3 == 1` and `j < 3 * section[1]`, at the width row when `j % 3 == 2` and
`j < 3 * section[2]`, else at the time row (transformers' interleaved layout). Text tokens have
three equal positions, so only a step holding image tokens (the paged metadata's
`mrope_positions`) takes this path; the others rotate at `rope_positions`.

Glossary: T tokens in the step, H heads, D head dim, R rotated dims per head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm_mamba.layers.rope_scaling import RopeFrequencies, rope_frequencies, rope_parameters
from vllm_mamba.ops.rotary_embedding import rotary_cos_sin_cache, rotary_embedding_ref

if TYPE_CHECKING:
    from vllm_mamba.attention.backends.paged import PagedMetadata


def step_lengths(meta: PagedMetadata) -> torch.Tensor:
    """`(T,)` int64: the sequence length each token rotates at, `max(position + 1, L)`: a decode
    row's position plus one, a prefill token's `prefill_rope_lens` (its prompt's length) or,
    past the prompt (a recompute), its position plus one."""
    nd = meta.num_decodes
    after = meta.positions.long() + 1  # (T,)
    chunk_sizes = meta.prefill_query_start_loc.diff()  # (num_prefills,)
    prompts = meta.prefill_rope_lens.long().repeat_interleave(
        chunk_sizes, output_size=meta.positions.shape[0] - nd
    )  # (T - num_decodes,)
    return torch.cat([after[:nd], torch.maximum(after[nd:], prompts)])


def _frequency_key(freqs: RopeFrequencies) -> tuple[Any, ...]:
    """What a length-following RoPE's per-token table depends on besides the step, by value
    (layers built from one config share their tables)."""
    rule = freqs.by_length
    assert rule is not None
    long = None if rule.long_inv_freq is None else tuple(rule.long_inv_freq.tolist())
    return (
        tuple(freqs.inv_freq.tolist()), freqs.attention_factor, rule.threshold, rule.rot_dim,
        rule.base, rule.ntk_factor, long,
    )  # fmt: skip


DEFAULT_TABLE_POSITIONS = 8192  # the CPU table's first size (and a config without a length's)


class RotaryEmbedding(nn.Module):
    """Rotates `q (T, Hq * D)` and `k (T, Hkv * D)` at `positions (T,)`: NeoX pairing (dims
    `i` and `i + R/2`), or GPT-J's interleaved pairing (dims `2i` and `2i + 1`) when
    `interleaved` (DeepSeek's `rope_interleave`, Ling's MLA: transformers de-interleaves and
    rotates NeoX-style, which permutes q and k alike, so the dot products are the same)."""

    def __init__(
        self,
        head_dim: int,
        rot_dim: int,
        max_position: int,
        freqs: RopeFrequencies,
        mrope_section: list[int] | None = None,
        *,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        if rot_dim % 2 or not 0 < rot_dim <= head_dim:
            raise ValueError(f"rotary dims ({rot_dim}) must be even and at most head_dim")
        if freqs.inv_freq.shape != (rot_dim // 2,):
            raise ValueError(f"{tuple(freqs.inv_freq.shape)} frequencies for {rot_dim} dims")
        self.head_dim = head_dim
        self.rot_dim = rot_dim
        self.positions = max_position  # what the config names; a CUDA table covers it all
        # The CPU table starts small and grows with the positions it meets: a config may name
        # millions (MiniMax-Text-01: 10,240,000, 5 GB of cos / sin at 128 dims).
        self.max_position = min(max_position, DEFAULT_TABLE_POSITIONS)
        self.freqs = freqs
        self._cos_sin: torch.Tensor | None = None  # (max_position, R) float32
        # The last positions checked against the table (a step's layers share one tensor).
        self._checked: torch.Tensor | None = None
        self._step_key = _frequency_key(freqs) if freqs.by_length is not None else None
        # M-RoPE: per rotated frequency, the position row (0 time, 1 height, 2 width) it reads
        self.mrope_rows = None if mrope_section is None else _mrope_rows(mrope_section, rot_dim)

    @classmethod
    def from_config(
        cls,
        config: Any,
        head_dim: int,
        rot_dim: int | None = None,
        mrope_section: list[int] | None = None,
        *,
        interleaved: bool = False,
    ) -> RotaryEmbedding:
        """`config`'s RoPE (`rope_parameters`: plain or scaled, `rope_scaling.py`) over
        `head_dim`-wide heads; `rot_dim` defaults to `partial_rotary_factor * head_dim`;
        M-RoPE by the parameters' `mrope_section`, else by `mrope_section` (the model's
        default), else none."""
        if rot_dim is None:
            params = rope_parameters(config)
            factor = params.get("partial_rotary_factor") or getattr(
                config, "partial_rotary_factor", None
            )
            rot_dim = int(head_dim * (factor or 1.0))
        freqs = rope_frequencies(config, rot_dim)
        # RecurrentGemma's config names no length: the table grows from the default.
        max_position = getattr(config, "max_position_embeddings", None) or DEFAULT_TABLE_POSITIONS
        section = rope_parameters(config).get("mrope_section") or mrope_section
        section = list(section) if section else None
        return cls(head_dim, rot_dim, max_position, freqs, section, interleaved=interleaved)

    def _table(self, device: torch.device, positions: torch.Tensor) -> torch.Tensor:
        # A position past the table (a max_model_len beyond max_position_embeddings) grows it
        # (checked on the CPU only: on CUDA it would synchronise every layer, so the CUDA table
        # covers the config's positions from the start).
        if positions is self._checked and self._cos_sin is not None:
            needed = 0  # checked at this step's first layer (positions.max() costs ~10 us)
        elif positions.is_cuda:
            needed = self.positions
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 0
            self._checked = positions
        if needed > self.max_position:
            self.max_position = max(needed, 2 * self.max_position)
            self._cos_sin = None
        if self._cos_sin is None or self._cos_sin.device != device:
            freqs = self.freqs
            table = rotary_cos_sin_cache(freqs.inv_freq, self.max_position, freqs.attention_factor)
            self._cos_sin = table.to(device)
        return self._cos_sin

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """The `(P, R)` float32 cos / sin table covering `positions` (a RoPE whose frequencies
        do not follow the sequence's length: `freqs.by_length` None), grown as needed."""
        assert self.freqs.by_length is None, "a dynamic or longrope RoPE has per-token tables"
        return self._table(positions.device, positions)

    def _token_table(
        self, device: torch.device, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """`(T, R)`: each token's cos / sin at its sequence's `lengths (T,)` (`by_length`)."""
        rule = self.freqs.by_length
        assert rule is not None
        within = self._table(device, positions)[positions.long()]  # (T, R)
        past = lengths > rule.threshold  # (T,)
        inv_freq = rule.frequencies(lengths.clamp(min=rule.threshold))  # (T, R/2)
        angles = positions.float()[:, None] * inv_freq  # (T, R/2)
        beyond = torch.cat([angles.cos(), angles.sin()], dim=-1) * self.freqs.attention_factor
        return torch.where(past[:, None], beyond, within)

    def _mrope_table(self, device: torch.device, mrope: torch.Tensor) -> torch.Tensor:
        """`(T, R)`: each token's cos / sin, frequency `j` at its `mrope_rows[j]` position of
        `mrope (3, T)`."""
        assert self.mrope_rows is not None and self.freqs.by_length is None
        rows = self._table(device, mrope.flatten())[mrope.long()]  # (3, T, R)
        half = torch.tensor(self.mrope_rows, device=device)  # (R/2,)
        index = torch.cat([half, half])[None, None, :].expand(1, *rows.shape[1:])  # (1, T, R)
        return rows.gather(0, index)[0]

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        meta: PagedMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the rotated `(q, k)` in their shapes and dtypes. A RoPE whose frequencies
        follow the sequence's length (`dynamic`, `longrope`) needs the step's `meta`."""
        num_tokens = q.shape[0]
        q3 = q.view(num_tokens, -1, self.head_dim)  # (T, Hq, D)
        k3 = k.view(num_tokens, -1, self.head_dim)  # (T, Hkv, D)
        mrope = getattr(meta, "mrope_positions", None)
        if mrope is not None and self.mrope_rows is not None:
            table = self._mrope_table(q.device, mrope)  # (T, R)
            positions = torch.arange(num_tokens, device=q.device)
        elif self.freqs.by_length is None:
            table = self._table(q.device, positions)
        else:
            if meta is None:
                raise ValueError("a dynamic or longrope RoPE needs the step's metadata")
            # One table per step for all layers of the same frequencies (at the step's positions).
            memo = meta.rope_tables if positions is meta.rope_positions else {}
            table = memo.get(self._step_key)
            if table is None or table.device != q.device:
                table = self._token_table(q.device, positions, step_lengths(meta))
                memo[self._step_key] = table
            positions = torch.arange(num_tokens, device=q.device)
        q3, k3 = rotary_embedding_ref(positions, q3, k3, table, is_neox=not self.interleaved)
        return q3.reshape(q.shape), k3.reshape(k.shape)


def _mrope_rows(section: list[int], rot_dim: int) -> tuple[int, ...]:
    """The position row of each of the `rot_dim / 2` rotated frequencies in transformers'
    interleaved M-RoPE layout (see the module docstring; sections past the rotated
    frequencies are cut off, as transformers' slices are). A tuple: models are built on the
    meta device."""
    if len(section) != 3:
        raise ValueError(f"mrope_section {section} must have three sizes (time, height, width)")
    rows = [0] * (rot_dim // 2)
    for row in (1, 2):  # height at 1, 4, 7, ...; width at 2, 5, 8, ...
        for j in range(row, min(3 * section[row], rot_dim // 2), 3):
            rows[j] = row
    return tuple(rows)
