"""Triton kernels of the paged attention ops: the KV cache write, decode and varlen prefill.

Same signatures and semantics as the references in `vllm_mamba.ops.paged_attention` (vLLM's
cache layout `(NB, BS, Hkv, D)`, block tables, GQA/MQA, padding rows). Every kernel walks the
context in tiles of `_BLOCK_N` positions whose blocks it gathers from the block table, with an
online softmax in float32, so any block size works and memory does not grow with the context.
The launch grids depend on tensor shapes only, never on tensor values: no host
synchronisation, so the decode step can be captured in a CUDA graph with the block tables and
sequence lengths as graph inputs. They run on CUDA, and on the CPU under `TRITON_INTERPRET=1`.
The optional score terms (`rel (T, Hq, E)` bias by distance, `sinks (T, Hq)`) are read as
float32 and compiled in only when given (`HAS_REL`, `HAS_SINKS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 16  # context positions per tile (tl.dot needs at least 16)
_BLOCK_M = 16  # prefill queries per program
_M_INIT = -1.0e30  # running max of a row with no position yet (finite: no inf - inf)


@triton.jit
def _reshape_and_cache_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    sk_t, sk_h, sv_t, sv_h, sc_b, sc_t, sc_h,
    BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < H) & (d < D) & ((h + d) * 0 + slot >= 0)  # PAD_SLOT_ID rows store nothing
    dst = (slot // BS) * sc_b + (slot % BS) * sc_t + h * sc_h + d
    k = tl.load(key + t * sk_t + h * sk_h + d, mask=mask)
    v = tl.load(value + t * sv_t + h * sv_h + d, mask=mask)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _kv_tile(
    cache, tables_row, pos, low, limit, kv_head, d, sc_b, sc_t, sc_h,
    BS: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Loads positions `pos (BLOCK_N,)` in `[low, limit)` of one kv head as float32
    (BLOCK_N, D_PAD); the blocks of the others are never read (a window may have freed them)."""
    valid = (pos >= low) & (pos < limit)
    block = tl.load(tables_row + pos // BS, mask=valid, other=0).to(tl.int64)
    rows = block * sc_b + (pos % BS) * sc_t + kv_head * sc_h  # (BLOCK_N,)
    mask = valid[:, None] & (d[None, :] < D)
    return tl.load(cache + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _distance_bias(rel, rows, dist, ok, extent):
    """`rel (T, Hq, E)` float32 contiguous at `rows` (row offsets `(t Hq + h) E`, shape `(M,)`)
    and distances `dist (M, N)`: the bias where `ok` and `0 <= dist < E`, else 0."""
    inside = ok & (dist >= 0) & (dist < extent)
    return tl.load(rel + rows[:, None] + dist, mask=inside, other=0.0)


@triton.jit
def _finish(acc, m, l, sinks, sink_rows, sink_ok, HAS_SINKS: tl.constexpr):
    """`acc / l` per row (zeros where l == 0), with a sink logit per row in the denominator
    when `HAS_SINKS` (`sinks + sink_rows (M,)`, where `sink_ok`)."""
    if HAS_SINKS:
        sink = tl.load(sinks + sink_rows, mask=sink_ok, other=0.0)
        top = tl.maximum(m, sink)
        w = tl.where(l > 0, tl.exp(m - top), 0.0)
        return acc * (w / (l * w + tl.exp(sink - top)))[:, None]
    return acc / tl.where(l > 0, l, 1.0)[:, None]


@triton.jit
def _decode_kernel(
    query, k_cache, v_cache, block_tables, seq_lens, out, scale, window, rel, sinks, extent,
    sq_b, sq_h, so_b, so_h, sbt, sc_b, sc_t, sc_h,
    BS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HQ: tl.constexpr, HAS_REL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * G + g  # (G_PAD,) the query heads that read this kv head
    qmask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(query + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32) * scale  # (G_PAD, D_PAD)
    length = tl.load(seq_lens + b)
    low = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the window's first position
    tables_row = block_tables + b * sbt
    m = tl.full((G_PAD,), _M_INIT, tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    for start in range(low, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k = _kv_tile(k_cache, tables_row, pos, low, length, kv_head, d, sc_b, sc_t, sc_h, BS, D)
        v = _kv_tile(v_cache, tables_row, pos, low, length, kv_head, d, sc_b, sc_t, sc_h, BS, D)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G_PAD, BLOCK_N)
        if HAS_REL:
            rows = (b * HQ + heads).to(tl.int64) * extent  # (G_PAD,)
            dist = (length - 1 - pos)[None, :]  # (1, BLOCK_N)
            s += _distance_bias(rel, rows, dist, (g < G)[:, None], extent)
        s = tl.where((pos < length)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    o = _finish(acc, m, l, sinks, b * HQ + heads, g < G, HAS_SINKS)  # padding rows stay zero
    tl.store(out + b * so_b + heads[:, None] * so_h + d[None, :], o, mask=qmask)


@triton.jit
def _prefill_kernel(
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, num_seqs,
    window, rel, sinks, extent, sq_t, sq_h, so_t, so_h, sbt, sc_b, sc_t, sc_h,
    BS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HQ: tl.constexpr,
    HAS_REL: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    # Program i serves tile i - first[p] of the sequence p with first[p] <= i, where
    # first[p] = qsl[p] // BLOCK_M + p: every sequence gets room for all its tiles.
    tile = tl.program_id(0)
    head = tl.program_id(1)
    idx = tl.arange(0, P_PAD)
    starts = tl.load(query_start_loc + idx, mask=idx < num_seqs, other=0)
    first = tl.where(idx < num_seqs, starts // BLOCK_M + idx, 2**30)
    p = tl.sum((first <= tile).to(tl.int32)) - 1
    q_begin = tl.load(query_start_loc + p)
    q_len = tl.load(query_start_loc + p + 1) - q_begin
    length = tl.load(seq_lens + p)
    j0 = (tile - (q_begin // BLOCK_M + p)) * BLOCK_M  # the tile's first query in the chunk
    j = j0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rows_ok = j < q_len
    d = tl.arange(0, D_PAD)
    qmask = rows_ok[:, None] & (d[None, :] < D)
    tok = (q_begin + j).to(tl.int64)
    q = tl.load(query + tok[:, None] * sq_t + head * sq_h + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32) * scale  # (BLOCK_M, D_PAD)
    q_pos = length - q_len + j  # absolute positions of the tile's queries
    kv_head = head // G
    tables_row = block_tables + p * sbt
    kv_end = tl.minimum(length, tl.max(tl.where(rows_ok, q_pos + 1, 0)))
    # The first position the tile's first query reads (0 without a window).
    kv_low = tl.where(window > 0, tl.maximum(length - q_len + j0 - window + 1, 0), 0)
    m = tl.full((BLOCK_M,), _M_INIT, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    for start in range(kv_low, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k = _kv_tile(k_cache, tables_row, pos, kv_low, kv_end, kv_head, d, sc_b, sc_t, sc_h, BS, D)
        v = _kv_tile(v_cache, tables_row, pos, kv_low, kv_end, kv_head, d, sc_b, sc_t, sc_h, BS, D)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BLOCK_M, BLOCK_N)
        if HAS_REL:
            rows = (tok * HQ + head) * extent  # (BLOCK_M,)
            s += _distance_bias(rel, rows, q_pos[:, None] - pos[None, :], rows_ok[:, None], extent)
        allowed = (pos[None, :] <= q_pos[:, None]) & rows_ok[:, None]
        allowed &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        m = m_new
    o = _finish(acc, m, l, sinks, tok * HQ + head, rows_ok, HAS_SINKS)
    tl.store(out + tok[:, None] * so_t + head * so_h + d[None, :], o, mask=qmask)


def _pad(n: int) -> int:
    return max(triton.next_power_of_2(n), 1)


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Checks the shapes; returns the GQA group size `Hq // Hkv`."""
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches must be (NB, BS, Hkv, D)"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert query.shape[-1] == k_cache.shape[3], "query and cache head dims differ"
    assert query.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of kv heads"
    return query.shape[1] // k_cache.shape[2]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with a unit stride on its last dimension (other strides stay free)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _terms(
    rel: torch.Tensor | None, sinks: torch.Tensor | None, query: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The optional score terms as float32 contiguous tensors (the query itself stands in for
    an absent one: its kernel branch is compiled out), and the bias extent."""
    tokens, heads = query.shape[:2]
    if rel is not None:
        assert rel.shape[:2] == (tokens, heads), "rel must be (tokens, Hq, E)"
    if sinks is not None:
        assert sinks.shape == (tokens, heads), "sinks must be (tokens, Hq)"
    rel_t = query if rel is None else rel.float().contiguous()
    sinks_t = query if sinks is None else sinks.float().contiguous()
    return rel_t, sinks_t, 0 if rel is None else rel.shape[-1]


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """Writes each token's key and value into its cache slot; see `reshape_and_cache_ref`.

    Args:
        key, value: `(T, Hkv, D)`.
        k_cache, v_cache: `(NB, BS, Hkv, D)`, updated in place.
        slot_mapping: `(T,)` int; slots `< 0` are skipped.
    """
    tokens, heads, dim = key.shape
    if tokens == 0:
        return
    # torch rounds to the cache dtype as the reference does (the interpreter would truncate).
    key, value = _rows(key.to(k_cache.dtype)), _rows(value.to(v_cache.dtype))
    _reshape_and_cache_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BS=k_cache.shape[1], H=heads, D=dim, H_PAD=_pad(heads), D_PAD=_pad(dim),
    )  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
    rel: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One query per row over its paged context; see `paged_decode_attention_ref`.

    Args:
        query: `(B, Hq, D)`; k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(B, max_blocks)` int32; seq_lens: `(B,)` int32, 0 for padding rows.
        scale: the softmax scale; sliding_window: the window W in tokens, 0 for none.
        rel: `(B, Hq, E)` score bias by distance, or None; sinks: `(B, Hq)`, or None.

    Returns:
        `(B, Hq, D)` in the query's dtype.
    """
    group = _check(query, k_cache, v_cache)
    batch, _, dim = query.shape
    query = _rows(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    rel_t, sinks_t, extent = _terms(rel, sinks, query)
    _decode_kernel[(batch, k_cache.shape[2])](
        query, k_cache, v_cache, block_tables, seq_lens, out, float(scale), int(sliding_window),
        rel_t, sinks_t, extent,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BS=k_cache.shape[1], G=group, D=dim, G_PAD=_pad(group), D_PAD=_pad(dim),
        BLOCK_N=_BLOCK_N, HQ=query.shape[1], HAS_REL=rel is not None,
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
    rel: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal varlen attention over the cached context; see `paged_prefill_attention_ref`.

    Args:
        query: `(T, Hq, D)`; k_cache, v_cache: `(NB, BS, Hkv, D)`.
        block_tables: `(P, max_blocks)` int32; query_start_loc: `(P + 1,)` int32;
            seq_lens: `(P,)` int32, context plus chunk of each sequence.
        scale: the softmax scale; sliding_window: the window W in tokens, 0 for none.
        rel: `(T, Hq, E)` score bias by distance, or None; sinks: `(T, Hq)`, or None.

    Returns:
        `(T, Hq, D)` in the query's dtype; tokens after `qsl[P]` are zeros.
    """
    group = _check(query, k_cache, v_cache)
    tokens, heads, dim = query.shape
    seqs = seq_lens.shape[0]
    query = _rows(query)
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if tokens == 0 or seqs == 0:
        return out
    grid = (tokens // _BLOCK_M + seqs, heads)  # room for every sequence's tiles (see kernel)
    rel_t, sinks_t, extent = _terms(rel, sinks, query)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, float(scale), seqs,
        int(sliding_window), rel_t, sinks_t, extent,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BS=k_cache.shape[1], G=group, D=dim, D_PAD=max(_pad(dim), 16), P_PAD=_pad(seqs),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, HQ=heads, HAS_REL=rel is not None,
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out
