"""Triton kernels of the `mla` op family: the latent cache write and the absorbed decode and
varlen prefill attention over a paged latent cache `(NB, BS, L)`.

Same signatures and semantics as the references in `vllm_mamba.ops.mla_attention`; imported
by `vllm_mamba.ops.triton_ops`, which registers them as the `triton` backend's `mla` family.
The kernels walk the context in tiles of `_BLOCK_N` positions gathered through the block
table, with an online softmax in float32 (as `triton_attention`). Every head reads the same
latent rows: the key of a position is its whole row (L values), its value the first `v_dim`;
the scores are summed over the latent in chunks of `_BLOCK_D` columns, so no `(rows, L)` query
or key tile is held at once (Kimi's L is 576).
Decode runs one program per (row, block of `_HEADS` heads), so a latent tile is loaded once
for those heads; prefill one program per (tile of `_BLOCK_M` queries, head). Launch grids
depend on shapes only (no host synchronisation: decode can be captured in a CUDA graph). They
run on CUDA, and on the CPU under `TRITON_INTERPRET=1`, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 16  # context positions per tile (tl.dot needs at least 16)
_BLOCK_M = 16  # prefill queries per program
_HEADS = 16  # decode heads per program (tl.dot needs at least 16 rows)
_BLOCK_D = 64  # latent columns per chunk of the score products
_M_INIT = -1.0e30  # running max of a row with no position yet (finite: no inf - inf)


@triton.jit
def _cache_write_kernel(
    latent, cache, slot_mapping, sl_t, sc_b, sc_t,
    BS: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    d = tl.arange(0, L_PAD)
    mask = (d < L) & (d * 0 + slot >= 0)  # PAD_SLOT_ID rows store nothing
    row = tl.load(latent + t * sl_t + d, mask=mask)
    tl.store(cache + (slot // BS) * sc_b + (slot % BS) * sc_t + d, row, mask=mask)


@triton.jit
def _latent_tile(
    cache, tables_row, pos, limit, cols, ncols, sc_b, sc_t, BS: tl.constexpr,
):  # fmt: skip
    """Columns `cols < ncols` of positions `pos (BLOCK_N,)` below `limit`, float32."""
    valid = pos < limit
    block = tl.load(tables_row + pos // BS, mask=valid, other=0).to(tl.int64)
    rows = block * sc_b + (pos % BS) * sc_t  # (BLOCK_N,)
    mask = valid[:, None] & (cols[None, :] < ncols)
    return tl.load(cache + rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scores(
    query_rows, q_mask, scale, cache, tables_row, pos, limit, sc_b, sc_t,
    BS: tl.constexpr, L: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`scale * q . latent` of `ROWS` query rows (`query_rows (ROWS, 1)` pointers, rows masked
    by `q_mask`) against positions `pos (BLOCK_N,)`, summed over the latent in chunks of
    `BLOCK_D` columns so that no `(rows, L)` tile is held at once."""
    s = tl.zeros((ROWS, BLOCK_N), tl.float32)
    for d0 in tl.static_range(0, L, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(
            query_rows + cols[None, :], mask=q_mask[:, None] & (cols[None, :] < L), other=0.0
        )
        k = _latent_tile(cache, tables_row, pos, limit, cols, L, sc_b, sc_t, BS)  # (N, BLOCK_D)
        s += tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
    return s * scale


@triton.jit
def _decode_kernel(
    query, cache, block_tables, seq_lens, out, scale,
    sq_b, sq_h, so_b, so_h, sbt, sc_b, sc_t,
    BS: tl.constexpr, H: tl.constexpr, L: tl.constexpr, V: tl.constexpr,
    HB: tl.constexpr, V_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)  # (HB,)
    dv = tl.arange(0, V_PAD)
    hmask = heads < H
    query_rows = query + b * sq_b + heads[:, None] * sq_h  # (HB, 1)
    length = tl.load(seq_lens + b)
    tables_row = block_tables + b * sbt
    m = tl.full((HB,), _M_INIT, tl.float32)
    l = tl.zeros((HB,), tl.float32)
    acc = tl.zeros((HB, V_PAD), tl.float32)
    for start in range(0, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        # (HB, BLOCK_N) scores of the heads against the tile
        s = _scores(
            query_rows, hmask, scale, cache, tables_row, pos, length, sc_b, sc_t,
            BS, L, BLOCK_D, HB, BLOCK_N,
        )  # fmt: skip
        v = _latent_tile(cache, tables_row, pos, length, dv, V, sc_b, sc_t, BS)  # (N, V_PAD)
        s = tl.where((pos < length)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # padding rows (length 0) stay zero
    omask = hmask[:, None] & (dv[None, :] < V)
    tl.store(out + b * so_b + heads[:, None] * so_h + dv[None, :], o, mask=omask)


@triton.jit
def _prefill_kernel(
    query, cache, block_tables, query_start_loc, seq_lens, out, scale, num_seqs,
    sq_t, sq_h, so_t, so_h, sbt, sc_b, sc_t,
    BS: tl.constexpr, L: tl.constexpr, V: tl.constexpr, V_PAD: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    j = (tile - (q_begin // BLOCK_M + p)) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rows_ok = j < q_len
    dv = tl.arange(0, V_PAD)
    tok = (q_begin + j).to(tl.int64)
    query_rows = query + tok[:, None] * sq_t + head * sq_h  # (BLOCK_M, 1)
    q_pos = length - q_len + j  # absolute positions of the tile's queries
    tables_row = block_tables + p * sbt
    kv_end = tl.minimum(length, tl.max(tl.where(rows_ok, q_pos + 1, 0)))
    m = tl.full((BLOCK_M,), _M_INIT, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, V_PAD), tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        # (BLOCK_M, BLOCK_N) scores of the tile's queries against the context tile
        s = _scores(
            query_rows, rows_ok, scale, cache, tables_row, pos, kv_end, sc_b, sc_t,
            BS, L, BLOCK_D, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        v = _latent_tile(cache, tables_row, pos, kv_end, dv, V, sc_b, sc_t, BS)
        allowed = (pos[None, :] <= q_pos[:, None]) & rows_ok[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    omask = rows_ok[:, None] & (dv[None, :] < V)
    tl.store(out + tok[:, None] * so_t + head * so_h + dv[None, :], o, mask=omask)


def _pad(n: int) -> int:
    """`n` rounded up to a power of two, at least 16 (tl.dot's smallest dimension)."""
    return max(triton.next_power_of_2(n), 16)


def _block_d(dim: int) -> int:
    """Latent columns per chunk of the score products (at most `_BLOCK_D`)."""
    return min(_pad(dim), _BLOCK_D)


def _check(query: torch.Tensor, cache: torch.Tensor, v_dim: int) -> None:
    assert cache.dim() == 3 and cache.stride(2) == 1, "cache must be (NB, BS, L), L contiguous"
    assert query.shape[-1] == cache.shape[2], "query and latent dims differ"
    assert 0 < v_dim <= cache.shape[2], "v_dim must be in (0, latent_dim]"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with a unit stride on its last dimension (other strides stay free)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_cache_write(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes each token's latent row into its cache slot; see `mla_cache_write_ref`.

    Args:
        latent: `(T, L)`; cache: `(NB, BS, L)`, updated in place.
        slot_mapping: `(T,)` int; slots `< 0` are skipped.
    """
    tokens, dim = latent.shape
    if tokens == 0:
        return
    # torch rounds to the cache dtype as the reference does (the interpreter would truncate).
    latent = _rows(latent.to(cache.dtype))
    _cache_write_kernel[(tokens,)](
        latent, cache, slot_mapping, latent.stride(0), cache.stride(0), cache.stride(1),
        BS=cache.shape[1], L=dim, L_PAD=_pad(dim),
    )  # fmt: skip


def mla_decode_attention(
    query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, v_dim: int,
) -> torch.Tensor:  # fmt: skip
    """Absorbed MLA decode over the paged latents; see `mla_decode_attention_ref`.

    Args:
        query: `(B, Hq, L)`; cache: `(NB, BS, L)`.
        block_tables: `(B, max_blocks)` int32; seq_lens: `(B,)` int32, 0 for padding rows.
        scale: the softmax scale; v_dim: the value columns of a latent row.

    Returns:
        `(B, Hq, v_dim)` in the query's dtype.
    """
    _check(query, cache, v_dim)
    batch, heads, dim = query.shape
    query = _rows(query)
    out = torch.empty(batch, heads, v_dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    grid = (batch, triton.cdiv(heads, _HEADS))
    _decode_kernel[grid](
        query, cache, block_tables, seq_lens, out, float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.stride(0), cache.stride(1),
        BS=cache.shape[1], H=heads, L=dim, V=v_dim, HB=_HEADS, V_PAD=_pad(v_dim),
        BLOCK_D=_block_d(dim), BLOCK_N=_BLOCK_N,
    )  # fmt: skip
    return out


def mla_prefill_attention(
    query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, v_dim: int,
) -> torch.Tensor:  # fmt: skip
    """Causal absorbed MLA over the cached latents; see `mla_prefill_attention_ref`.

    Args:
        query: `(T, Hq, L)`; cache: `(NB, BS, L)`.
        block_tables: `(P, max_blocks)` int32; query_start_loc: `(P + 1,)` int32;
            seq_lens: `(P,)` int32, context plus chunk of each sequence.
        scale: the softmax scale; v_dim: the value columns of a latent row.

    Returns:
        `(T, Hq, v_dim)` in the query's dtype; tokens after `qsl[P]` are zeros.
    """
    _check(query, cache, v_dim)
    tokens, heads, dim = query.shape
    seqs = seq_lens.shape[0]
    query = _rows(query)
    out = torch.zeros(tokens, heads, v_dim, dtype=query.dtype, device=query.device)
    if tokens == 0 or seqs == 0:
        return out
    grid = (tokens // _BLOCK_M + seqs, heads)  # room for every sequence's tiles (see kernel)
    _prefill_kernel[grid](
        query, cache, block_tables, query_start_loc, seq_lens, out, float(scale), seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.stride(0), cache.stride(1),
        BS=cache.shape[1], L=dim, V=v_dim, V_PAD=_pad(v_dim),
        P_PAD=max(triton.next_power_of_2(seqs), 1), BLOCK_D=_block_d(dim), BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
    )  # fmt: skip
    return out
