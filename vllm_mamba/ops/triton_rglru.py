"""Triton kernels of the `rglru` op family (RecurrentGemma's RG-LRU), registered as the
`triton` backend's versions by `vllm_mamba.ops.triton_ops.register`.

Same signatures and semantics as `rglru_varlen_ref` / `rglru_update_ref` in
`vllm_mamba.ops.rglru`: per channel `h = a * h + x * sigmoid(gx) * sqrt(1 - a^2)` with
`log a = c * sigmoid(ga)`, a reset (`h = x * sigmoid(gx)`) on a sequence's first token without
an initial state, float32 math and state, outputs in x's dtype. The recurrence is diagonal: one
program handles one sequence (or decode row) and `BLOCK_L` channels, walking its tokens.

Glossary:
    T: tokens; B: sequences (or decode rows); L: channels; S: state slots. x: `(T, L)`;
    gates: `(T, 2L)` as `[gx | ga]`; h_states: `(S, L)` float32. Rows whose slot is
    `PAD_SLOT_ID` never touch `h_states` and output zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mamba.cache_specs import PAD_SLOT_ID

__all__ = ["rglru_update", "rglru_varlen"]

_BLOCK_L = 64


@triton.jit
def _rglru_kernel(
    x_ptr, g_ptr, c_ptr, h_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr, width,
    PAD_SLOT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    if VARLEN:
        start = tl.load(qsl_ptr + seq)
        end = tl.load(qsl_ptr + seq + 1)
        reset = tl.load(init_ptr + seq) == 0
    else:
        start = seq
        end = seq + 1
        reset = False
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,)
    mask = offs < width
    live = tl.where(slot != PAD_SLOT, mask, False)  # channels of a real slot
    h_row = h_ptr + tl.where(slot != PAD_SLOT, slot, 0) * width + offs
    h = tl.load(h_row, mask=live, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0)
    for t in range(start, end):
        x = tl.load(x_ptr + t * width + offs, mask=live, other=0.0).to(tl.float32)
        gx = tl.load(g_ptr + t * 2 * width + offs, mask=live, other=0.0).to(tl.float32)
        ga = tl.load(g_ptr + t * 2 * width + width + offs, mask=live, other=0.0).to(tl.float32)
        gated = x * tl.sigmoid(gx)
        log_a = c * tl.sigmoid(ga)
        step = tl.exp(log_a) * h + gated * tl.sqrt(1.0 - tl.exp(2.0 * log_a))
        h = tl.where(reset & (t == start), gated, step)
        tl.store(out_ptr + t * width + offs, h.to(out_ptr.dtype.element_ty), mask=live)
    tl.store(h_row, h, mask=live)


def _launch(x, gates, log_a_scale, h_states, state_indices, qsl=None, init=None) -> torch.Tensor:  # noqa: ANN001
    """Runs the kernel over `state_indices.numel()` sequences (varlen when `qsl` is given)."""
    x, gates = x.contiguous(), gates.contiguous()
    assert h_states.dtype == torch.float32 and h_states.is_contiguous(), "h_states: (S, L) f32"
    out = torch.zeros_like(x)
    rows, width = state_indices.numel(), x.shape[1]
    if rows == 0 or x.shape[0] == 0:
        return out
    varlen = qsl is not None
    grid = (rows, triton.cdiv(width, _BLOCK_L))
    _rglru_kernel[grid](
        x, gates, log_a_scale.float().contiguous(), h_states,
        qsl if varlen else state_indices, state_indices, init if varlen else state_indices,
        out, width, PAD_SLOT=PAD_SLOT_ID, VARLEN=varlen, BLOCK_L=_BLOCK_L,
    )  # fmt: skip
    return out


def rglru_varlen(
    x: torch.Tensor, gates: torch.Tensor, log_a_scale: torch.Tensor, h_states: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The recurrence over packed sequences; see `rglru_varlen_ref`."""
    init = has_initial_state.to(torch.int32)
    return _launch(x, gates, log_a_scale, h_states, state_indices, query_start_loc, init)


def rglru_update(
    x: torch.Tensor, gates: torch.Tensor, log_a_scale: torch.Tensor, h_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One token per row; see `rglru_update_ref`."""
    return _launch(x, gates, log_a_scale, h_states, state_indices)
