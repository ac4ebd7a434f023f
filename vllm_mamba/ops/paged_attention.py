"""Paged attention over a block KV cache: the cache write, decode and varlen-prefill attention.

Pure-PyTorch references (`*_ref`) of the attention ops of hybrid models. The fast kernels
(C++ on the CPU, `csrc/paged_attention.cpp`; Triton on CUDA,
`vllm_mamba.ops.triton_attention`) share these signatures and are chosen in
`vllm_mamba.ops.dispatch`; layers call them through the ops table with keyword arguments.
`decode_layer` is a whole attention block's decode step in one call (norm, q/k/v projections,
q/k norms, RoPE, the cache write, decode attention, output gate, o_proj, residual: C++ in
`csrc/fused_decode_attention.cpp`), planned by `SelfAttention.fused_mixer_step`.

Glossary:
    T: tokens in the flat batch; B: decode rows; P: prefill sequences; Hq: query heads;
    Hkv: key/value heads (GQA/MQA: query head `h` reads kv head `h // (Hq // Hkv)`);
    D: head dim; NB: blocks in the pool; BS: tokens per block.
    `k_cache`, `v_cache`: `(NB, BS, Hkv, D)`, one pair per attention layer (vLLM's layout).
    A token's slot is `block_id * BS + offset`; `PAD_SLOT_ID` (-1) marks padding.
    `block_tables`: `(rows, max_blocks)` int32; row `i`'s position `p` lives in block
    `block_tables[i, p // BS]` at offset `p % BS`. Entries past a row's used blocks may hold
    anything (0, -1) and are never read.
    `seq_lens`: `(rows,)` int32, the tokens in the cache for each row, the new ones included.
    `sliding_window`: W > 0 limits a query at position `p` to positions `(p - W, p]` (a
    sliding-window layer; the blocks wholly before every query's window may have been freed
    and hold anything); 0 reads all of `[0, p]`.
    `rel`: optional `(T, Hq, E)` additive score bias by backward distance: a query at
    position `p` adds `rel[t, h, p - j]` to its score for the key at `j` when `p - j < E`
    (nothing beyond; Inkling's relative-position bias). `sinks`: optional `(T, Hq)` one more
    logit per query and head whose value vector is zero (it only takes probability mass):
    `softmax([s, sink])[:-1]`. Both are read as float32.
    Math is float32 whatever the input dtype; outputs take the query's dtype. No rotary here:
    the model rotates queries and keys before caching them.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.families import OpFamily, OpSpec
from vllm_mamba.ops.fused_decode import _finish, _linear, _rms_norm
from vllm_mamba.ops.rotary_embedding import rotary_embedding_ref

Tensor = torch.Tensor

__all__ = [
    "reshape_and_cache_ref",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
]


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's key and value into its cache slot, in place.

    Args:
        key, value: `(T, Hkv, D)` the new tokens' keys and (rotated) values.
        k_cache, v_cache: `(NB, BS, Hkv, D)`; written at the tokens' slots (cast to the
            cache dtype).
        slot_mapping: `(T,)` int slot per token; slots `< 0` (`PAD_SLOT_ID`) are skipped.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots > PAD_SLOT_ID  # (T,)
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, start: int, length: int
) -> torch.Tensor:
    """Cached tokens `[start, length)` of one sequence, in float32: `(length - start, Hkv,
    D)`; the blocks before `start`'s are never read (a sliding window may have freed them)."""
    block_size = cache.shape[1]
    positions = torch.arange(start, length, device=cache.device)  # (L,)
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks[positions // block_size], positions % block_size].float()


def window_start(position: int, sliding_window: int) -> int:
    """The first position a query at `position` reads: `position - W + 1` with a window of
    `W` tokens (transformers' `kv_idx > q_idx - sliding_window`), else 0 (`W = 0`)."""
    return max(position - sliding_window + 1, 0) if sliding_window > 0 else 0


def _distance_bias(rel: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """`rel (Q, Hq, E)` read at each query's backward distance to each key: `(Q, Hq, L)`
    float32, zero at distances of `E` or more (and wherever the key is after the query)."""
    dist = q_pos[:, None] - k_pos[None, :]  # (Q, L)
    extent = rel.shape[-1]
    index = dist.clamp(0, extent - 1)[:, None, :].expand(-1, rel.shape[1], -1)
    bias = rel.float().gather(-1, index)
    return bias.masked_fill(((dist < 0) | (dist >= extent))[:, None, :], 0.0)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked softmax attention of one sequence's queries over its context, in float32.

    Args:
        query: `(Q, Hq, D)` float32.
        keys: `(L, Hkv, D)` float32; values: `(L, Hkv, Dv)` float32 (Dv is D but for MLA).
        allowed: `(Q, L)` bool, which positions each query may read.
        scale: the softmax scale.
        bias: `(Q, Hq, L)` float32 added to the scaled scores, or None.
        sinks: `(Q, Hq)` one more zero-valued logit per query and head, or None.

    Returns:
        `(Q, Hq, Dv)` float32; queries with no allowed position get zeros.
    """
    num_q, num_heads, head_dim = query.shape
    num_kv = keys.shape[1]
    group = num_heads // num_kv
    q = query.view(num_q, num_kv, group, head_dim)  # (Q, Hkv, G, D)
    scores = torch.einsum("qkgd,lkd->kgql", q, keys) * scale  # (Hkv, G, Q, L)
    if bias is not None:
        scores = scores + bias.view(num_q, num_kv, group, -1).permute(1, 2, 0, 3)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # (Hkv, G, Q, 1)
    if sinks is not None:
        sink = sinks.float().view(num_q, num_kv, group).permute(1, 2, 0)[..., None]
        row_max = torch.maximum(row_max, sink)
    row_max = row_max.clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 at masked positions
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    probs = weights / denom.clamp(min=torch.finfo(torch.float32).tiny)
    out = torch.einsum("kgql,lkd->qkgd", probs, values)  # (Q, Hkv, G, Dv)
    return out.reshape(num_q, num_heads, values.shape[-1])


def _check_heads(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, "k_cache must be (num_blocks, block_size, num_kv_heads, head_dim)"
    assert query.shape[-1] == k_cache.shape[-1], "query and cache head dims differ"
    assert query.shape[-2] % k_cache.shape[2] == 0, "query heads must be a multiple of kv heads"


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    rel: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row attending to positions `[0, seq_len)` of its sequence's cache (the
    last `sliding_window` of them when it is > 0).

    The row's own key and value were already written (`reshape_and_cache_ref`).

    Args:
        query: `(B, Hq, D)`.
        k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(B, max_blocks)` int32.
        seq_lens: `(B,)` int32; 0 marks a padding row.
        scale: the softmax scale (usually `D ** -0.5`).
        sliding_window: the window W in tokens, or 0 for none.
        rel: `(B, Hq, E)` score bias by backward distance, or None; sinks: `(B, Hq)`, or
            None (see the module docstring).

    Returns:
        `(B, Hq, D)` in the query's dtype; padding rows are zeros.
    """
    _check_heads(query, k_cache)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)  # (B, Hq, D)
    for row, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue
        start = window_start(length - 1, sliding_window)
        keys = _gather_context(k_cache, block_tables[row], start, length)  # (L, Hkv, D)
        values = _gather_context(v_cache, block_tables[row], start, length)
        allowed = torch.ones(1, length - start, dtype=torch.bool, device=query.device)
        q_pos = torch.tensor([length - 1], device=query.device)
        k_pos = torch.arange(start, length, device=query.device)
        bias = None if rel is None else _distance_bias(rel[row : row + 1], q_pos, k_pos)
        sink = None if sinks is None else sinks[row : row + 1]
        out[row] = _attend(query[row : row + 1].float(), keys, values, allowed, scale, bias, sink)[
            0
        ]
    return out.to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    rel: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed prefill chunks over their cached context and themselves.

    Sequence `p` owns queries `[qsl[p], qsl[p + 1])`; with `q_len` of them, query `j` sits at
    absolute position `seq_lens[p] - q_len + j` and reads cache positions up to its own. The
    chunk's keys and values, and those of the earlier chunks, are already in the cache, so a
    prefill split into chunks across block boundaries equals the whole prefill.

    Args:
        query: `(T, Hq, D)`, sequences packed back to back.
        k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(P, max_blocks)` int32.
        query_start_loc: `(P + 1,)` int32, cumulative query starts.
        seq_lens: `(P,)` int32, context plus chunk length of each sequence.
        scale: the softmax scale.
        sliding_window: the window W in tokens, or 0 for none.
        rel: `(T, Hq, E)` score bias by backward distance, or None; sinks: `(T, Hq)`, or
            None (see the module docstring).

    Returns:
        `(T, Hq, D)` in the query's dtype; tokens after `qsl[P]` (padding) are zeros.
    """
    _check_heads(query, k_cache)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)  # (T, Hq, D)
    starts = query_start_loc.tolist()
    for seq, length in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        q_len = end - begin
        if q_len <= 0:
            continue
        assert length >= q_len, "seq_lens must count the chunk's own tokens"
        start = window_start(length - q_len, sliding_window)
        keys = _gather_context(k_cache, block_tables[seq], start, length)  # (L, Hkv, D)
        values = _gather_context(v_cache, block_tables[seq], start, length)
        q_pos = torch.arange(length - q_len, length, device=query.device)  # (Q,)
        k_pos = torch.arange(start, length, device=query.device)  # (L,)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (Q, L)
        if sliding_window > 0:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        bias = None if rel is None else _distance_bias(rel[begin:end], q_pos, k_pos)
        sink = None if sinks is None else sinks[begin:end]
        out[begin:end] = _attend(query[begin:end].float(), keys, values, allowed, scale, bias, sink)
    return out.to(query.dtype)


# The tensors of one attention block for `decode_layer`, in order (the `Param` of
# `csrc/fused_decode_attention.cpp`); `list(AttentionParams(**tensors))`.
ATTENTION_PARAMS = (
    "norm_w", "q_proj_w", "q_proj_b", "k_proj_w", "k_proj_b", "v_proj_w", "v_proj_b",
    "o_proj_w", "o_proj_b", "q_norm_w", "k_norm_w", "q_proj_scale", "k_proj_scale",
    "v_proj_scale", "o_proj_scale",
)  # fmt: skip
AttentionParams = NamedTuple("AttentionParams", [(n, "Tensor | None") for n in ATTENTION_PARAMS])


def decode_layer_ref(
    hidden: torch.Tensor,
    params: list[torch.Tensor | None],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rope_table: torch.Tensor | None,
    rope_rows: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    output_gate: bool,
    scale: float,
    key_multiplier: float,
    norm_eps: float,
    qk_eps: float,
    out_dtype: torch.dtype,
    int_dot: bool = False,
    rows_alone: bool = False,
    sliding_window: int = 0,
    residual_scale: float = 1.0,
) -> torch.Tensor:
    """One attention block's decode step from the reference ops (`SelfAttention` over
    `PagedAttention`): `hidden + o_proj(attention(...))` with the block norm, else the mixer
    alone; the rows' keys and values written into the cache.

    Args:
        hidden: `(B, H)` decode rows.
        params: the tensors named by `ATTENTION_PARAMS`: norm_w `(H,)` float32 or None, the
            q (`(Hq D, H)`, `(2 Hq D, H)` with the output gate: `[query D | gate D]` per head),
            k, v `(Hkv D, H)` and o `(H, Hq D)` weights with their biases (or None) and
            scales (None for float weights, `(rows,)` float32 for int8, `(rows, cols/32)`
            float16 for 4-bit), the per-head q / k norm weights `(D,)` float32 (the effective
            weight: `1 + w` for a zero-centred norm) or None.
        k_cache, v_cache: `(NB, BS, Hkv, D)`; the rows' keys and values are written.
        slot_mapping: `(B,)` each row's cache slot; block_tables `(B, max_blocks)`;
            seq_lens `(B,)` the cached tokens after this step.
        rope_table: `(P, R)` float32 `[cos | sin]` (NeoX pairing over the first R dims) or
            None (no RoPE); rope_rows: `(B,)` each row's table row.
        scale: the softmax scale; key_multiplier: scales the keys after their norm.
        norm_eps, qk_eps: the block norm's and the q / k norms' epsilons.
        out_dtype: the result's dtype.
        int_dot: the integer weights multiply int8-quantised activations (`_linear`).
        rows_alone: every row's products exactly as a one-row call's (the kernel's
            speculative chains; the reference's rows always are).
        sliding_window: the layer's window W in tokens, or 0 for none.
        residual_scale: with the block norm, the layer's residual multiplier rm: `hidden + rm *
            o_proj(...)`.

    Returns:
        `(B, H)` in `out_dtype`.
    """
    p = dict(zip(ATTENTION_PARAMS, params, strict=True))
    rows = hidden.shape[0]
    x = hidden.float()
    xn = _rms_norm(x, p["norm_w"], norm_eps) if p["norm_w"] is not None else x
    q = _linear(xn, p["q_proj_w"], p["q_proj_b"], p["q_proj_scale"], int_dot)  # (B, NQ)
    k = _linear(xn, p["k_proj_w"], p["k_proj_b"], p["k_proj_scale"], int_dot)  # (B, Hkv D)
    v = _linear(xn, p["v_proj_w"], p["v_proj_b"], p["v_proj_scale"], int_dot)  # (B, Hkv D)
    gate = None
    if output_gate:
        qg = q.view(rows, num_heads, 2 * head_dim)
        q, gate = qg[..., :head_dim], qg[..., head_dim:].reshape(rows, -1)
    q = q.reshape(rows, num_heads, head_dim)
    k = k.view(rows, num_kv_heads, head_dim)
    if p["q_norm_w"] is not None:
        q, k = _rms_norm(q, p["q_norm_w"], qk_eps), _rms_norm(k, p["k_norm_w"], qk_eps)
    k = k * key_multiplier
    if rope_table is not None:
        rot = rope_table.shape[1]
        qr, kr = rotary_embedding_ref(rope_rows, q[..., :rot], k[..., :rot], rope_table, True)
        q, k = torch.cat([qr, q[..., rot:]], -1), torch.cat([kr, k[..., rot:]], -1)
    cache = k_cache.dtype
    v = v.view(rows, num_kv_heads, head_dim)
    reshape_and_cache_ref(k.to(cache), v.to(cache), k_cache, v_cache, slot_mapping)
    attn = paged_decode_attention_ref(
        q.to(cache), k_cache, v_cache, block_tables, seq_lens, scale, sliding_window
    )
    attn = attn.float().reshape(rows, -1)  # (B, Hq D)
    if gate is not None:
        attn = attn * torch.sigmoid(gate)
    mixed = _linear(attn, p["o_proj_w"], p["o_proj_b"], p["o_proj_scale"], int_dot)
    return _finish(hidden, mixed, p["norm_w"] is not None, out_dtype, residual_scale)


class ReshapeAndCacheOp(Protocol):
    def __call__(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    ) -> None: ...  # fmt: skip


class PagedDecodeOp(Protocol):
    def __call__(
        self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
        seq_lens: Tensor, scale: float, sliding_window: int = 0, rel: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip


class DecodeLayerOp(Protocol):
    def __call__(
        self, hidden: Tensor, params: list[Tensor | None], k_cache: Tensor, v_cache: Tensor,
        slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor, rope_table: Tensor | None,
        rope_rows: Tensor | None, num_heads: int, num_kv_heads: int, head_dim: int,
        output_gate: bool, scale: float, key_multiplier: float, norm_eps: float, qk_eps: float,
        out_dtype: torch.dtype, int_dot: bool = False, rows_alone: bool = False,
        sliding_window: int = 0, residual_scale: float = 1.0,
    ) -> Tensor: ...  # fmt: skip


class PagedPrefillOp(Protocol):
    def __call__(
        self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
        query_start_loc: Tensor, seq_lens: Tensor, scale: float, sliding_window: int = 0,
        rel: Tensor | None = None, sinks: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip


# The family's ops (`vllm_mamba.ops.families`): each op's signature and its reference, whose
# docstring says what the arguments are.
OPS = OpFamily(
    "paged_attention",
    {
        "reshape_and_cache": OpSpec(ReshapeAndCacheOp, reshape_and_cache_ref),
        "decode": OpSpec(PagedDecodeOp, paged_decode_attention_ref),
        "prefill": OpSpec(PagedPrefillOp, paged_prefill_attention_ref),
        "decode_layer": OpSpec(DecodeLayerOp, decode_layer_ref),
    },
)
