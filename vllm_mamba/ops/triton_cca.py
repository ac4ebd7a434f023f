"""Triton kernels of the `cca` op family's convs (ZAYA1's CCA), registered as the `triton`
backend's `conv_varlen` / `conv_update` by `vllm_mamba.ops.triton_ops.register` (the shifts,
copies, run their references).

Same signatures and semantics as `cca_conv_varlen_ref` / `cca_conv_update_ref` in
`vllm_mamba.ops.cca`, and the same split as the C++ kernels (`csrc/cca.cpp`): one program per
(sequence or decode row, group) computes its tokens' depthwise outputs the grouped conv reads,
`y (G, T, D, K1)` in x's dtype (each input from the chunk or, before it, from the slot's
history; zeros without one), then saves the slot's last `K - 1` inputs; the grouped conv is one
batched GEMM over `y` (`torch.baddbmm`).

Glossary:
    T: tokens; B: sequences (or decode rows); C: channels (G D); G: groups; D: channels per
    group; K0, K1: the convs' widths, K - 1 = K0 + K1 - 2; S: state slots. x: `(T, C)`;
    conv_states: `(S, C, K - 1)`. Rows whose slot is `PAD_SLOT_ID` never touch `conv_states`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

__all__ = ["cca_conv_update", "cca_conv_varlen"]

_BLOCK_T = 16


@triton.jit
def _depthwise_kernel(
    x_ptr, dw_ptr, dwb_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, y_ptr, tokens, channels,
    PAD_SLOT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, K0: tl.constexpr,
    K1: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    group = tl.program_id(1)
    H: tl.constexpr = K0 + K1 - 2
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    has_slot = slot != PAD_SLOT
    read_hist = has_slot & (tl.load(init_ptr + seq) != 0)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    c = group * D + d  # (D_PAD,)
    hist_row = state_ptr + (tl.where(has_slot, slot, 0) * channels + c) * H  # (D_PAD,)
    dw_bias = tl.load(dwb_ptr + c, mask=d_ok, other=0.0).to(tl.float32)
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,) positions in the chunk
        ok = (t < length)[:, None] & d_ok[None, :]
        y_rows = ((group * tokens + start + t).to(tl.int64) * D)[:, None] + d[None, :]
        for j in tl.static_range(K1):
            acc = tl.zeros((BLOCK_T, D_PAD), tl.float32) + dw_bias[None, :]
            for a in tl.static_range(K0):
                src = t + j + a - H  # (BLOCK_T,) the input's position (< 0: history)
                in_chunk = tl.where((src >= 0)[:, None], ok, False)
                xv = tl.load(x_ptr + (start + src)[:, None].to(tl.int64) * channels + c[None, :],
                             mask=in_chunk, other=0.0).to(tl.float32)  # fmt: skip
                in_hist = tl.where(read_hist, tl.where((src < 0)[:, None], ok, False), False)
                hv = tl.load(hist_row[None, :] + (H + src)[:, None], mask=in_hist,
                             other=0.0).to(tl.float32)  # fmt: skip
                w = tl.load(dw_ptr + c * K0 + a, mask=d_ok, other=0.0).to(tl.float32)
                acc += w[None, :] * (xv + hv)
            tl.store(y_ptr + y_rows * K1 + j, acc.to(y_ptr.dtype.element_ty), mask=ok)
    # The slot's new history: its last K - 1 inputs, in increasing order (entry j reads entry
    # j + length of the old history, which no earlier entry has overwritten).
    save = tl.where(has_slot, d_ok, False)  # an empty sequence too (zeros when fresh), as the ref
    for j in tl.static_range(H):
        src = length - H + j
        xv = tl.load(x_ptr + (start + src).to(tl.int64) * channels + c,
                     mask=tl.where(src >= 0, save, False), other=0.0)  # fmt: skip
        hv = tl.load(hist_row + H + src, mask=tl.where(read_hist & (src < 0), save, False),
                     other=0.0)  # fmt: skip
        tl.store(hist_row + j, (xv.to(tl.float32) + hv.to(tl.float32)).to(
            state_ptr.dtype.element_ty), mask=save)  # fmt: skip


def _convs(
    x: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor, g_weight: torch.Tensor,
    g_bias: torch.Tensor, conv_states: torch.Tensor, qsl: torch.Tensor, slots: torch.Tensor,
    initial: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    tokens, channels = x.shape
    dim, k1 = g_weight.shape[1], g_weight.shape[2]
    k0 = dw_weight.shape[1]
    groups = channels // dim
    assert conv_states.is_contiguous() and conv_states.shape[1:] == (channels, k0 + k1 - 2)
    y = torch.zeros(groups, tokens, dim, k1, dtype=x.dtype, device=x.device)
    if slots.shape[0] and tokens:
        _depthwise_kernel[(slots.shape[0], groups)](
            x.contiguous(), dw_weight.contiguous(), dw_bias.contiguous(), conv_states, qsl, slots,
            initial, y, tokens, channels, PAD_SLOT=PAD_SLOT_ID, D=dim,
            D_PAD=triton.next_power_of_2(dim), K0=k0, K1=k1, BLOCK_T=_BLOCK_T,
        )  # fmt: skip
    weight = g_weight.reshape(groups, dim, dim * k1).transpose(1, 2)  # (G, D K1, D out)
    out = torch.baddbmm(g_bias.view(groups, 1, dim), y.view(groups, tokens, -1), weight)
    return out.transpose(0, 1).reshape(tokens, channels)  # (G, T, D) -> (T, C)


def cca_conv_varlen(
    x: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor, g_weight: torch.Tensor,
    g_bias: torch.Tensor, conv_states: torch.Tensor, query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Both convs over packed sequences; see `cca_conv_varlen_ref`."""
    return _convs(
        x, dw_weight, dw_bias, g_weight, g_bias, conv_states, query_start_loc, state_indices,
        has_initial_state.to(torch.int32),
    )  # fmt: skip


def cca_conv_update(
    x: torch.Tensor, conv_states: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
    g_weight: torch.Tensor, g_bias: torch.Tensor, state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One token per row (a one-token sequence each); see `cca_conv_update_ref`."""
    rows = x.shape[0]
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=x.device)
    initial = torch.ones(rows, dtype=torch.int32, device=x.device)
    return _convs(x, dw_weight, dw_bias, g_weight, g_bias, conv_states, qsl, state_indices, initial)
