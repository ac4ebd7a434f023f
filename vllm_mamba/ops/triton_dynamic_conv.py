"""Triton kernels of the `dynamic_conv` op family (Inkling 2's per-token-tap convs), registered
as the `triton` backend's versions by `vllm_mamba.ops.triton_ops.register`.

Same signatures and semantics as `dynamic_conv_varlen_ref` / `dynamic_conv_update_ref` in
`vllm_mamba.ops.dynamic_conv`: `y[t, c] = sum_l (static_weight[l, c] + dynamic_taps[t, head(c),
l]) * x[t - l, c]` in lag order, inputs before a sequence's first token from its slot's history
(zeros without one), float32 math, history and output. One program handles one sequence (or
decode row) and `BLOCK_C` channels: its tokens in tiles of `BLOCK_T`, each lag's inputs read
from the chunk or, before it, from the history; then the slot's new history.

Glossary:
    T: tokens; B: sequences (or decode rows); C: channels; Hc: heads of dynamic taps; K: conv
    width; S: state slots. x: `(T, C)`; static_weight: `(K, C)`; dynamic_taps: `(T, Hc, K)`;
    conv_states: `(S, C, K - 1)` float32. Rows whose slot is `PAD_SLOT_ID` never touch
    `conv_states`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

__all__ = ["dynamic_conv_update", "dynamic_conv_varlen"]

_BLOCK_C = 32
_BLOCK_T = 16


@triton.jit
def _dynamic_conv_kernel(
    x_ptr, w_ptr, dyn_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr, channels, per_head,
    heads, PAD_SLOT: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    has_slot = slot != PAD_SLOT
    read_hist = has_slot & (tl.load(init_ptr + seq) != 0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    c_ok = c < channels
    hist_row = state_ptr + (tl.where(has_slot, slot, 0) * channels + c) * (K - 1)  # (BLOCK_C,)
    head = c // per_head
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,) positions in the chunk
        t_ok = t < length
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for lag in tl.static_range(K):
            src = t - lag  # (BLOCK_T,) the input's position in the chunk (< 0: history)
            ok = t_ok[:, None] & c_ok[None, :]
            in_chunk = ok & (src >= 0)[:, None]
            x = tl.load(x_ptr + (start + src)[:, None].to(tl.int64) * channels + c[None, :],
                        mask=in_chunk, other=0.0).to(tl.float32)  # fmt: skip
            in_hist = tl.where(read_hist, ok & (src < 0)[:, None], False)
            h = tl.load(hist_row[None, :] + (K - 1 + src)[:, None], mask=in_hist, other=0.0)
            w = tl.load(w_ptr + lag * channels + c, mask=c_ok, other=0.0).to(tl.float32)
            d = tl.load(dyn_ptr + ((start + t)[:, None].to(tl.int64) * heads + head[None, :]) * K
                        + lag, mask=ok, other=0.0).to(tl.float32)  # fmt: skip
            acc += (w[None, :] + d) * (x + h)
        out_rows = (start + t)[:, None].to(tl.int64) * channels + c[None, :]
        tl.store(out_ptr + out_rows, acc, mask=t_ok[:, None] & c_ok[None, :])
    # The slot's new history: its last K - 1 inputs, in increasing order (entry j reads entry
    # j + length of the old history, which no earlier entry has overwritten).
    save = tl.where(has_slot & (length > 0), c_ok, False)
    for j in tl.static_range(K - 1):
        src = length - (K - 1) + j  # position in the chunk (< 0: the old history)
        x = tl.load(x_ptr + (start + src).to(tl.int64) * channels + c,
                    mask=tl.where(src >= 0, save, False), other=0.0).to(tl.float32)  # fmt: skip
        h = tl.load(hist_row + K - 1 + src, mask=tl.where(read_hist & (src < 0), save, False),
                    other=0.0)  # fmt: skip
        tl.store(hist_row + j, x + h, mask=save)


def _launch(
    x: torch.Tensor, static_weight: torch.Tensor, dynamic_taps: torch.Tensor,
    conv_states: torch.Tensor, qsl: torch.Tensor, slots: torch.Tensor, initial: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    tokens, channels = x.shape
    width = static_weight.shape[0]
    heads = dynamic_taps.shape[1]
    assert conv_states.dtype == torch.float32 and conv_states.is_contiguous()
    assert conv_states.shape[1:] == (channels, width - 1), "conv_states must be (S, C, K - 1)"
    assert dynamic_taps.shape == (tokens, heads, width) and channels % heads == 0
    out = torch.zeros(tokens, channels, dtype=torch.float32, device=x.device)
    seqs = slots.shape[0]
    if seqs == 0 or tokens == 0:
        return out
    grid = (seqs, triton.cdiv(channels, _BLOCK_C))
    _dynamic_conv_kernel[grid](
        x.contiguous(), static_weight.contiguous(), dynamic_taps.float().contiguous(),
        conv_states, qsl, slots, initial, out, channels, channels // heads, heads,
        PAD_SLOT=PAD_SLOT_ID, K=width, BLOCK_C=_BLOCK_C, BLOCK_T=_BLOCK_T,
    )  # fmt: skip
    return out


def dynamic_conv_varlen(
    x: torch.Tensor, static_weight: torch.Tensor, dynamic_taps: torch.Tensor,
    conv_states: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The conv over packed sequences; see `dynamic_conv_varlen_ref`."""
    return _launch(
        x, static_weight, dynamic_taps, conv_states, query_start_loc, state_indices,
        has_initial_state.to(torch.int32),
    )  # fmt: skip


def dynamic_conv_update(
    x: torch.Tensor, conv_states: torch.Tensor, static_weight: torch.Tensor,
    dynamic_taps: torch.Tensor, state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One token per row (a one-token sequence each); see `dynamic_conv_update_ref`."""
    rows = x.shape[0]
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=x.device)
    initial = torch.ones(rows, dtype=torch.int32, device=x.device)
    return _launch(x, static_weight, dynamic_taps, conv_states, qsl, state_indices, initial)
