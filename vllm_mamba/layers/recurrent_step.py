"""One recurrent step: how every stateful mixer runs its recurrence over a step's flat batch.

A step's rows are `[decode rows] + [prefill chunks]` (see `MambaMetadata`). A stateful mixer
(Mamba's scan, Mamba2's SSD, the delta rules, a conv history, RWKV's WKV and token shift, a
plugin's own) writes only its two ops:

- `decode(rows, slots)`: the one-token update of the decode rows `rows` (a slice of the step's
  rows), each reading and advancing the state of its slot in `slots` in place;
- `prefill(rows)`: the varlen scan of the prefill chunks, `rows` the prefill tokens (from
  `meta.num_decodes` to the end), reading `meta.prefill_query_start_loc`,
  `meta.prefill_state_indices` and `meta.prefill_has_initial_state`;

and `recurrent_step` owns the rest:

- **decode rows**: one `decode` call over all of them at `meta.decode_state_indices`;
- **speculative waves**: when chains verify drafts, the decode rows come in waves (wave w holds
  position w of every chain, a plain decode being a chain of one; `meta.decode_waves`). Each
  wave runs as one `decode` call at its sequences' own slots, so position w reads the state
  position w - 1 left there; after every wave but the last, the chains that go on save that
  state into the spare slot of the position (`meta.wave_copies`, over every tensor in
  `states`). Each row so reads the slot `meta.decode_chain_src` names and leaves its state
  where `meta.decode_chain_dst` names (the spare slots first, the last position the
  sequence's slot), and a rollback after rejected drafts restores a spare slot;
- **padding**: rows and chunks whose slot is `PAD_SLOT_ID` (CUDA-graph padding) go to the ops,
  which skip them (no state read or written); no wave copy names them;
- **the empty cases**: no `decode` call without decode rows, no `prefill` call without prefill
  chunks; a step with neither runs `decode` on zero rows (an output with zero rows);
- **the concatenation** of the decode and prefill outputs along their row dimension.

The fused decode paths are not part of it: a layer's decode plan (`layers.decode_plan`: a
Mamba / Mamba2 mixer's `fused_mixer_step`, RWKV-7's `fused_layer_step`) replaces the whole
mixer (or stage, or layer), projections included, so the layer asks it before any projection
is computed and calls the mixer, which runs this step, where the plan does not take the step.
The per-row kernel choice of a decode (RWKV-7's `fused_update`) is the mixer's `decode`.

Glossary: T tokens in the step, D decode rows, S state slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_mamba.attention.mamba_metadata import MambaMetadata

DecodeFn = Callable[[slice, torch.Tensor], torch.Tensor]
"""`decode(rows, slots)`: advances the states of `slots` (`(rows,)` int) by the step's rows
`rows` in place and returns their outputs."""

PrefillFn = Callable[[slice], torch.Tensor]
"""`prefill(rows)`: runs the varlen scan over the prefill tokens `rows` (chunk bounds, slots
and initial-state flags from the metadata), advancing the states in place; returns the
outputs."""


def recurrent_step(
    meta: MambaMetadata,
    states: Sequence[torch.Tensor],
    decode: DecodeFn,
    prefill: PrefillFn,
    *,
    dim: int = 0,
) -> torch.Tensor:
    """Runs a recurrent op over the step's rows: decodes (in speculative waves when there are
    chains), then the prefill chunks.

    Args:
        meta: the step's metadata.
        states: the state tensors `(S, ...)`, indexed by slot, that `decode` advances (the
            speculative waves copy them into the spare slots).
        decode: the one-token update (see `DecodeFn`).
        prefill: the varlen scan (see `PrefillFn`).
        dim: the outputs' row dimension (RWKV's shift mixes return `(M, rows, C)`).

    Returns:
        The outputs of every row in row order: the decode rows', then the prefill tokens'
        (`T` rows along `dim`).
    """
    nd = meta.num_decodes
    if not meta.num_prefills:
        return run_decode_waves(meta, states, decode, dim)  # zero rows in an empty step
    if not nd:
        return prefill(slice(0, None))
    decoded = run_decode_waves(meta, states, decode, dim)
    return torch.cat([decoded, prefill(slice(nd, None))], dim=dim)


def run_decode_waves(
    meta: MambaMetadata,
    states: Sequence[torch.Tensor],
    update: DecodeFn,
    dim: int = 0,
) -> torch.Tensor:
    """Runs a recurrent op's one-token update over the step's decode rows, wave by wave when
    speculative chains lay them out in waves (see the module docstring).

    Args:
        meta: the step's metadata.
        states: the op's state tensors `(S, ...)`, indexed by slot, that `update` advances.
        update: `update(rows, slots)` advances the states of `slots` by the decode rows
            `rows` (a slice of the step's rows) in place and returns their outputs.
        dim: the outputs' row dimension.

    Returns:
        The outputs of all decode rows `(D along dim)`, in row order.
    """
    if not meta.decode_waves:
        return update(slice(0, meta.num_decodes), meta.decode_state_indices)
    outs, start = [], 0
    for wave, rows in enumerate(meta.decode_waves):
        part = slice(start, start + rows)
        outs.append(update(part, meta.decode_state_indices[part]))
        if wave < len(meta.wave_copies):
            src, dst = meta.wave_copies[wave]  # (n,) int64 each
            for state in states:
                state.index_copy_(0, dst, state.index_select(0, src))
        start += rows
    return torch.cat(outs, dim=dim)
