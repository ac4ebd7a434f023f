"""`recurrent_step` (the one split of a step into decode rows, speculative waves and prefill
chunks) against running every sequence's tokens one by one.

The op is a toy recurrence written here (nonlinear, two state tensors, `PAD_SLOT_ID` rows
skipped) whose decode gathers and scatters by slot, so rows of one chain run in a single call
would each read the chain's starting state: only the waves make it right. The metadata comes
from the engine's own builder (`build_mamba_metadata`), wave copies included.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.attention import mamba_metadata
from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.mamba_metadata import MambaMetadata, build_mamba_metadata
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.layers import recurrent_step as recurrent_step_module
from vllm_mamba.layers.recurrent_step import recurrent_step

C = 3  # channels
S = 9  # state slots
DECAY = torch.tensor([0.9, 0.5, -0.7], dtype=torch.float64)


def _cell(h: torch.Tensor, prev: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The new hidden state of one token: nonlinear in the old one, so order matters."""
    return torch.tanh(DECAY * h + x + 0.3 * prev)


def toy_update(x: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, slots: torch.Tensor):
    """One token per row: `h, prev (S, C)` advanced in place at `slots`; PAD rows give zeros
    and touch no state. Returns `(rows, C)`."""
    out = torch.zeros_like(x)
    keep = slots != PAD_SLOT_ID
    idx = slots[keep].long()
    new = _cell(h[idx], prev[idx], x[keep])  # (rows, C)
    h[idx], prev[idx] = new, x[keep]
    out[keep] = new * 2.0
    return out


def toy_scan(x: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, meta: MambaMetadata):
    """The varlen scan of the prefill chunks `x (T, C)`, from their slot's state where
    `has_initial_state`, else zeros; PAD chunks give zeros. Returns `(T, C)`."""
    out = torch.zeros_like(x)
    qsl = meta.prefill_query_start_loc.tolist()
    for i, slot in enumerate(meta.prefill_state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        if bool(meta.prefill_has_initial_state[i]):
            state, last = h[slot].clone(), prev[slot].clone()
        else:
            state, last = torch.zeros(C, dtype=x.dtype), torch.zeros(C, dtype=x.dtype)
        for t in range(qsl[i], qsl[i + 1]):
            state = _cell(state, last, x[t])
            last = x[t]
            out[t] = state * 2.0
        h[slot], prev[slot] = state, last
    return out


def run(meta: MambaMetadata, x: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, dim: int = 0):
    """The helper over the toy op, with a call log; `dim=1` stacks the outputs as RWKV's
    shift mixes do, `(2, rows, C)`."""
    calls: list[tuple[str, slice]] = []

    def lift(y: torch.Tensor) -> torch.Tensor:
        return torch.stack([y, -y]) if dim == 1 else y

    def decode(rows: slice, slots: torch.Tensor) -> torch.Tensor:
        calls.append(("decode", rows))
        return lift(toy_update(x[rows], h, prev, slots))

    def prefill(rows: slice) -> torch.Tensor:
        calls.append(("prefill", rows))
        return lift(toy_scan(x[rows], h, prev, meta))

    return recurrent_step(meta, [h, prev], decode=decode, prefill=prefill, dim=dim), calls


def one_by_one(
    h0: torch.Tensor, prev0: torch.Tensor, slot: int, fresh: bool, xs: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A sequence's tokens through one-row decode calls on a copy of its slot (zeros when
    `fresh`): per token its output and the state after it."""
    h, prev = h0.clone(), prev0.clone()
    if fresh:
        h[slot], prev[slot] = 0.0, 0.0
    steps = []
    for x in xs:
        y = toy_update(x[None], h, prev, torch.tensor([slot], dtype=torch.int32))[0]
        steps.append((y, h[slot].clone(), prev[slot].clone()))
    return steps


def states(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(S, C, generator=g, dtype=torch.float64),
        torch.randn(S, C, generator=g, dtype=torch.float64),
    )


def layout(decode_slots: list[int], prefill: list[tuple[int, int, int]]) -> StepLayout:
    """`prefill`: `(slot, tokens, tokens computed before)` per chunk."""
    return StepLayout(
        decode_slots=decode_slots,
        prefill_lens=[n for _, n, _ in prefill],
        prefill_slots=[s for s, _, _ in prefill],
        prefill_context_lens=[c for _, _, c in prefill],
    )


CHAINS = {0: [0, 3, 5], 1: [1, 4], 2: [2]}  # sequence slot -> its decode rows, in order
PREFILLS = [(3, 4, 7), (7, 3, 0), (PAD_SLOT_ID, 2, 0)]  # slot, tokens, computed before


def spec_layout() -> StepLayout:
    """Two speculative chains (3 and 2 positions, spare slots 4, 5 and 6), a plain decode, a
    chunk that continues slot 3, a fresh chunk on slot 7 and a padding chunk; slot 8 idle."""
    lay = layout([0, 1, 2, 0, 1, 0], PREFILLS)
    lay.decode_waves = [3, 2, 1]
    lay.decode_chain_src = [0, 1, 2, 4, 6, 5]
    lay.decode_chain_dst = [4, 6, 2, 5, 1, 0]
    return lay


@pytest.mark.parametrize("dim", [0, 1])
def test_waves_and_prefill_equal_tokens_one_by_one(dim: int) -> None:
    """Every row's output, every chain position's state in the slot `decode_chain_dst` names
    (spare slots, then the sequence's), and every chunk's state equal the one-by-one run bit
    for bit; padding and idle slots are untouched; one decode call per wave, one prefill."""
    meta = build_mamba_metadata(spec_layout(), torch.device("cpu"))
    x = torch.randn(15, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h0, prev0 = states(2)
    h, prev = h0.clone(), prev0.clone()
    out, calls = run(meta, x, h, prev, dim)
    out = out[0] if dim == 1 else out
    assert out.shape == (15, C)
    assert calls == [
        ("decode", slice(0, 3)), ("decode", slice(3, 5)), ("decode", slice(5, 6)),
        ("prefill", slice(6, None)),
    ]  # fmt: skip
    dst = meta.decode_chain_dst.tolist()
    for slot, rows in CHAINS.items():
        steps = one_by_one(h0, prev0, slot, False, [x[r] for r in rows])
        for r, (y, h_after, prev_after) in zip(rows, steps):
            assert torch.equal(out[r], y), r
            assert torch.equal(h[dst[r]], h_after) and torch.equal(prev[dst[r]], prev_after), r
    start = 6
    for slot, n, before in PREFILLS:
        rows = range(start, start + n)
        start += n
        if slot == PAD_SLOT_ID:
            assert torch.equal(out[rows.start : rows.stop], torch.zeros(n, C, dtype=x.dtype))
            continue
        steps = one_by_one(h0, prev0, slot, before == 0, [x[r] for r in rows])
        for r, (y, _, _) in zip(rows, steps):
            assert torch.equal(out[r], y), r
        assert torch.equal(h[slot], steps[-1][1]) and torch.equal(prev[slot], steps[-1][2])
    assert torch.equal(h[8], h0[8]) and torch.equal(prev[8], prev0[8])


def test_chain_in_one_call_would_be_wrong() -> None:
    """The toy op is one the waves matter for: the chains' rows in one call (what a mixer
    that ignores the waves does) give other outputs and leave the spare slots unwritten."""
    meta = build_mamba_metadata(spec_layout(), torch.device("cpu"))
    x = torch.randn(15, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h0, prev0 = states(2)
    h, prev = h0.clone(), prev0.clone()
    waves, _ = run(meta, x, h, prev)
    hw, pw = h0.clone(), prev0.clone()
    flat = toy_update(x[:6], hw, pw, meta.decode_state_indices)
    assert not torch.equal(flat, waves[:6])
    assert torch.equal(hw[4], h0[4]) and not torch.equal(h[4], h0[4])


def test_plain_decodes_with_padding_rows() -> None:
    """Without waves: one decode call at `decode_state_indices`; a padding row (CUDA-graph
    padding) gives zeros and no state is read or written for it."""
    meta = build_mamba_metadata(layout([5, PAD_SLOT_ID, 2], []), torch.device("cpu"))
    x = torch.randn(3, C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    h0, prev0 = states(4)
    h, prev = h0.clone(), prev0.clone()
    out, calls = run(meta, x, h, prev)
    assert calls == [("decode", slice(0, 3))]
    assert torch.equal(out[1], torch.zeros(C, dtype=torch.float64))
    for r, slot in ((0, 5), (2, 2)):
        ((y, h_after, prev_after),) = one_by_one(h0, prev0, slot, False, [x[r]])
        assert torch.equal(out[r], y) and torch.equal(h[slot], h_after)
        assert torch.equal(prev[slot], prev_after)
    untouched = [s for s in range(S) if s not in (5, 2)]
    assert torch.equal(h[untouched], h0[untouched])
    assert torch.equal(prev[untouched], prev0[untouched])


def test_prefill_only_and_empty_step() -> None:
    """A prefill-only step makes one prefill call over every row; a step with no rows makes
    one decode call on zero rows and changes nothing."""
    meta = build_mamba_metadata(layout([], [(1, 3, 0), (4, 2, 5)]), torch.device("cpu"))
    x = torch.randn(5, C, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    h0, prev0 = states(6)
    h, prev = h0.clone(), prev0.clone()
    out, calls = run(meta, x, h, prev)
    assert calls == [("prefill", slice(0, None))]
    for rows, slot, fresh in ((range(0, 3), 1, True), (range(3, 5), 4, False)):
        steps = one_by_one(h0, prev0, slot, fresh, [x[r] for r in rows])
        assert all(torch.equal(out[r], y) for r, (y, _, _) in zip(rows, steps))
        assert torch.equal(h[slot], steps[-1][1])
    meta = build_mamba_metadata(layout([], []), torch.device("cpu"))
    h, prev = h0.clone(), prev0.clone()
    out, calls = run(meta, torch.empty(0, C, dtype=torch.float64), h, prev)
    assert out.shape == (0, C) and calls == [("decode", slice(0, 0))]
    assert torch.equal(h, h0) and torch.equal(prev, prev0)


def test_run_decode_waves_is_reexported_from_the_metadata_module() -> None:
    """Plugins written against `mamba_metadata.run_decode_waves` get the one implementation."""
    assert mamba_metadata.run_decode_waves is recurrent_step_module.run_decode_waves
