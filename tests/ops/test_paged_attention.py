"""The paged attention ops: the references against dense causal attention, and the C++ kernels
(`csrc/paged_attention.cpp`, `csrc/reshape_and_cache.cpp`) against the references.

Cases cover GQA ratios (1, 2, 4, MQA), head dims, block sizes, context lengths from 0 to a
few hundred (unaligned to blocks), chunked prefill, padding rows, non-contiguous queries,
float32 / bfloat16 / float16, and sliding windows (against dense attention with a window mask,
the blocks every window has passed poisoned with NaN and dropped from the table), and the
optional score terms (a bias by distance, sink logits) against a float64 softmax written out.
`make_paged_case` is shared with the Triton tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)

needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
# (query heads, kv heads): MHA, GQA 2 and 4, MQA.
GQA = [(4, 4), (4, 2), (8, 2), (4, 1)]
BLOCK_SIZES = [1, 8, 16, 32]
HEAD_DIMS = [32, 64, 80, 128]
# (seq_len, q_len) per prefill sequence: whole prompts, chunks after a cached context, a
# sequence with no query this step, lengths unaligned to blocks.
PREFILL = [(5, 5), (40, 7), (0, 0), (129, 1), (300, 33), (17, 17)]
DECODE_LENS = [1, 5, 16, 17, 100, 257, 0, 333]  # 0: a padding row


@dataclass
class PagedCase:
    """One attention layer's cache with random contents, and the block tables into it."""

    k_cache: torch.Tensor  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (rows, max_blocks) int32, unused entries -1 or 0
    seq_lens: torch.Tensor  # (rows,) int32
    query: torch.Tensor  # (T, Hq, D)
    query_start_loc: torch.Tensor  # (rows + 1,) int32


def make_paged_case(
    lens: list[int], q_lens: list[int], q_heads: int, kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype = torch.float32, pad_tokens: int = 2, seed: int = 0,
    device: torch.device | str = "cpu",
) -> PagedCase:  # fmt: skip
    """Random caches and queries; each row owns shuffled blocks, unused table entries junk."""
    gen = torch.Generator().manual_seed(seed)
    used = [(n + block_size - 1) // block_size for n in lens]
    max_blocks = max(used, default=0) + 2
    num_blocks = sum(used) + 3  # a few blocks nobody owns
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for row, count in enumerate(used):
        tables[row, :count] = torch.tensor(perm[:count], dtype=torch.int32)
        tables[row, count:] = -1 if row % 2 else 0  # never read
        perm = perm[count:]
    tokens = sum(q_lens) + pad_tokens
    query = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedCase(
        k_cache.to(device), v_cache.to(device), tables.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device), query.to(device), qsl.to(device),
    )  # fmt: skip


def dense_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Causal attention of `q (L, Hq, D)` over `k, v (L, Hkv, D)`, heads repeated for GQA;
    with `window` W > 0, query `i` reads keys `j` with `i - W < j <= i` only."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(q.shape[0])
    mask = pos[None, :] <= pos[:, None]  # (L, L)
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def dense_biased(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, rel: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`dense_causal` in float64 with the score terms written out: query i's score for key j
    gains `rel[i, h, i - j]` while `i - j < E`, and `sinks[i, h]` joins each softmax as a
    logit whose value is zero."""
    group = q.shape[1] // k.shape[1]
    q = q.double()
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    length, heads = q.shape[:2]
    scores = torch.einsum("ihd,jhd->hij", q, k) * q.shape[-1] ** -0.5  # (H, L, L)
    for i in range(length):
        for j in range(i + 1):
            if rel is not None and i - j < rel.shape[-1]:
                scores[:, i, j] += rel[i, :, i - j].double()
            if j > i or (window and j <= i - window):
                scores[:, i, j] = float("-inf")
        scores[:, i, i + 1 :] = float("-inf")
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().T[:, :, None]], dim=-1)
    probs = scores.softmax(dim=-1)[..., :length]
    return torch.einsum("hij,jhd->ihd", probs, v).float()


def _drop_passed_blocks(
    table: torch.Tensor, caches: list[torch.Tensor], start: int, window: int
) -> None:
    """Poisons (NaN) and unlists the blocks wholly before the window of position `start`, as
    the engine frees them: a kernel that still read them would return NaN or fail."""
    block_size = caches[0].shape[1]
    for index in range(max(start - window + 1, 0) // block_size):
        if table[0, index] >= 0:
            for cache in caches:
                cache[table[0, index].long()] = float("nan")
            table[0, index] = -1


def _run_chunked(
    attention, chunks: list[int], q_heads: int, kv_heads: int, block_size: int, window: int = 0,
    extent: int = 0, with_sinks: bool = False,
):  # fmt: skip
    """Writes one sequence chunk by chunk, attending each chunk (with a sliding `window`, the
    blocks it has passed dropped before each chunk; with a bias by distance of `extent` > 0
    positions and sink logits if asked); returns (paged, dense) outputs."""
    torch.manual_seed(1)
    head_dim, total = 16, sum(chunks)
    q, k, v = (torch.randn(total, h, head_dim) for h in (q_heads, kv_heads, kv_heads))
    rel = 2 * torch.randn(total, q_heads, extent) if extent else None
    sinks = torch.randn(total, q_heads) if with_sinks else None

    def terms(part: slice) -> dict:
        return {
            **({} if rel is None else {"rel": rel[part]}),
            **({} if sinks is None else {"sinks": sinks[part]}),
        }

    num_blocks = (total + block_size - 1) // block_size + 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_blocks).to(torch.int32)[None, :]  # (1, NB)
    positions = torch.arange(total)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    outs, done = [], 0
    for size in chunks:
        if window:
            _drop_passed_blocks(table, [k_cache, v_cache], done, window)
        part = slice(done, done + size)
        pad = torch.tensor([PAD_SLOT_ID])  # a padding token rides along, stores nothing
        attention["cache"](
            key=torch.cat([k[part], k[:1]]), value=torch.cat([v[part], v[:1]]),
            k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.cat([slots[part], pad]),
        )  # fmt: skip
        done += size
        outs.append(
            attention["prefill"](
                query=q[part], k_cache=k_cache, v_cache=v_cache, block_tables=table,
                query_start_loc=torch.tensor([0, size], dtype=torch.int32),
                seq_lens=torch.tensor([done], dtype=torch.int32), scale=head_dim**-0.5,
                sliding_window=window, **terms(part),
            )
        )  # fmt: skip
    decode = attention["decode"](
        query=q[-1:], k_cache=k_cache, v_cache=v_cache, block_tables=table,
        seq_lens=torch.tensor([total], dtype=torch.int32), scale=head_dim**-0.5,
        sliding_window=window, **terms(slice(total - 1, total)),
    )  # fmt: skip
    if rel is None and sinks is None:
        dense = dense_causal(q, k, v, window)
    else:
        dense = dense_biased(q, k, v, window, rel, sinks)
    torch.testing.assert_close(decode[0], dense[-1], atol=1e-5, rtol=1e-5)
    return torch.cat(outs), dense


REF = {
    "cache": reshape_and_cache_ref,
    "prefill": paged_prefill_attention_ref,
    "decode": paged_decode_attention_ref,
}
CPP = {
    "cache": cpu_kernels.reshape_and_cache,
    "prefill": cpu_kernels.paged_prefill_attention,
    "decode": cpu_kernels.paged_decode_attention,
}


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("chunks", [[40], [1, 5, 17, 23], [16, 16, 3]])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_equals_dense_attention(
    impl: str, chunks: list[int], q_heads: int, kv_heads: int, block_size: int
) -> None:
    """Chunked prefill through the cache (and the last token's decode) equals dense attention."""
    paged, dense = _run_chunked(
        REF if impl == "ref" else CPP, chunks, q_heads, kv_heads, block_size
    )
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize(("chunks", "window"), [([40], 7), ([1, 5, 17, 23], 16), ([16, 16, 3], 1),
                                                ([9, 30, 2], 33), ([50], 100)])  # fmt: skip
@pytest.mark.parametrize("block_size", [1, 8])
def test_sliding_window_equals_dense_windowed_attention(
    impl: str, chunks: list[int], window: int, block_size: int
) -> None:
    """Chunked prefill and decode with a sliding window equal dense attention with the window
    mask, though the blocks every window has passed hold NaN and are dropped from the table
    (windows of 1 token, shorter and longer than a chunk or than the whole sequence)."""
    paged, dense = _run_chunked(REF if impl == "ref" else CPP, chunks, 4, 2, block_size, window)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize(
    ("chunks", "window", "extent", "with_sinks"),
    [([40], 0, 12, True), ([1, 5, 17, 23], 16, 40, False), ([16, 16, 3], 7, 3, True),
     ([9, 30, 2], 0, 100, True), ([20, 3], 0, 0, True)],
)  # fmt: skip
def test_distance_bias_and_sinks_equal_a_float64_softmax(
    impl: str, chunks: list[int], window: int, extent: int, with_sinks: bool
) -> None:
    """Chunked prefill and decode with a score bias by distance (extents shorter and longer
    than the window and the sequence) and sink logits equal the float64 softmax written out
    (`dense_biased`), with and without a sliding window."""
    paged, dense = _run_chunked(
        REF if impl == "ref" else CPP, chunks, 4, 2, 8, window, extent, with_sinks
    )
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


@needs_cpp
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_distance_bias_and_sinks_match_ref(
    q_heads: int, kv_heads: int, window: int, dtype: torch.dtype
) -> None:
    """Decode (a 1500-token row split over threads and merged) and varlen prefill with a bias
    by distance and sinks, against the references."""
    head_dim, block_size = 64, 16
    gen = torch.Generator().manual_seed(window + q_heads)
    lens = [*DECODE_LENS, 1500]
    case = make_paged_case(lens, [1] * len(lens), q_heads, kv_heads, head_dim, block_size, dtype)
    rows = len(lens)
    args = {
        **_decode_args(case, rows), "sliding_window": window,
        "rel": torch.randn(rows, q_heads, 300, generator=gen).to(dtype),
        "sinks": torch.randn(rows, q_heads, generator=gen),
    }  # fmt: skip
    torch.testing.assert_close(
        cpu_kernels.paged_decode_attention(**args), paged_decode_attention_ref(**args),
        **_tolerance(dtype),
    )  # fmt: skip
    lens, q_lens = zip(*PREFILL, strict=True)
    case = make_paged_case(list(lens), list(q_lens), q_heads, kv_heads, head_dim, block_size, dtype)
    tokens = case.query.shape[0]
    args = {
        **_prefill_args(case), "sliding_window": window,
        "rel": torch.randn(tokens, q_heads, 20, generator=gen),
        "sinks": 3 * torch.randn(tokens, q_heads, generator=gen).to(dtype),
    }  # fmt: skip
    torch.testing.assert_close(
        cpu_kernels.paged_prefill_attention(**args), paged_prefill_attention_ref(**args),
        **_tolerance(dtype),
    )  # fmt: skip


@needs_cpp
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("window", [1, 5, 16, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_sliding_window_matches_ref(
    q_heads: int, kv_heads: int, window: int, dtype: torch.dtype
) -> None:
    """Decode (long rows split over threads too) and varlen prefill with a window, against the
    references, at every GQA ratio."""
    head_dim, block_size = 64, 16
    lens = [*DECODE_LENS, 1500]
    case = make_paged_case(lens, [1] * len(lens), q_heads, kv_heads, head_dim, block_size, dtype)
    args = {**_decode_args(case, len(lens)), "sliding_window": window}
    torch.testing.assert_close(
        cpu_kernels.paged_decode_attention(**args), paged_decode_attention_ref(**args),
        **_tolerance(dtype),
    )  # fmt: skip
    lens, q_lens = zip(*PREFILL, strict=True)
    case = make_paged_case(list(lens), list(q_lens), q_heads, kv_heads, head_dim, block_size, dtype)
    args = {**_prefill_args(case), "sliding_window": window}
    torch.testing.assert_close(
        cpu_kernels.paged_prefill_attention(**args), paged_prefill_attention_ref(**args),
        **_tolerance(dtype),
    )  # fmt: skip


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _decode_args(case: PagedCase, rows: int) -> dict:
    return {
        "query": case.query[:rows], "k_cache": case.k_cache, "v_cache": case.v_cache,
        "block_tables": case.block_tables, "seq_lens": case.seq_lens,
        "scale": case.query.shape[-1] ** -0.5,
    }  # fmt: skip


def _prefill_args(case: PagedCase) -> dict:
    return {
        "query": case.query, "k_cache": case.k_cache, "v_cache": case.v_cache,
        "block_tables": case.block_tables, "query_start_loc": case.query_start_loc,
        "seq_lens": case.seq_lens, "scale": case.query.shape[-1] ** -0.5,
    }  # fmt: skip


@needs_cpp
@pytest.mark.parametrize(("q_heads", "kv_heads"), GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_matches_ref(
    q_heads: int, kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    """Decode over contexts of 0 to 333 tokens, padding rows zero, every GQA ratio."""
    head_dim = HEAD_DIMS[(q_heads + kv_heads + block_size) % len(HEAD_DIMS)]
    lens = DECODE_LENS
    case = make_paged_case(lens, [1] * len(lens), q_heads, kv_heads, head_dim, block_size, dtype)
    args = _decode_args(case, len(lens))
    out = cpu_kernels.paged_decode_attention(**args)
    assert out.dtype == dtype and out.shape == args["query"].shape
    torch.testing.assert_close(out, paged_decode_attention_ref(**args), **_tolerance(dtype))
    assert not out[lens.index(0)].any()


@needs_cpp
@pytest.mark.parametrize(("q_heads", "kv_heads"), GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_prefill_matches_ref(
    q_heads: int, kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    """Varlen prefill: whole prompts, chunks after cached context, empty rows, padding tokens."""
    head_dim = HEAD_DIMS[(q_heads * kv_heads + block_size) % len(HEAD_DIMS)]
    lens, q_lens = zip(*PREFILL, strict=True)
    case = make_paged_case(list(lens), list(q_lens), q_heads, kv_heads, head_dim, block_size, dtype)
    args = _prefill_args(case)
    out = cpu_kernels.paged_prefill_attention(**args)
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out, paged_prefill_attention_ref(**args), **_tolerance(dtype))
    assert not out[-2:].any()  # padding tokens after qsl[P]


@needs_cpp
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 80), (8, 2, 256)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_prefill_rows_are_bitwise_the_decode_of_their_position(
    q_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """Each prefill query's output equals decode attention at its position bit for bit (a
    speculative chain's verification is a prefill, its one-by-one twin decodes)."""
    n = 70
    case = make_paged_case([n], [n], q_heads, kv_heads, head_dim, block_size, dtype, pad_tokens=0)
    prefill = cpu_kernels.paged_prefill_attention(**_prefill_args(case))
    for pos in range(n):
        decode = cpu_kernels.paged_decode_attention(
            query=case.query[pos : pos + 1], k_cache=case.k_cache, v_cache=case.v_cache,
            block_tables=case.block_tables[:1], seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
            scale=head_dim**-0.5,
        )  # fmt: skip
        assert torch.equal(decode[0], prefill[pos]), pos


@needs_cpp
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    """Every head dim and dtype, for decode and prefill (GQA 2, block size 16)."""
    lens, q_lens = [23, 70, 0], [23, 9, 0]
    case = make_paged_case(lens, q_lens, 4, 2, head_dim, 16, dtype, seed=head_dim)
    for kernel, ref, args in [
        (cpu_kernels.paged_prefill_attention, paged_prefill_attention_ref, _prefill_args(case)),
        (cpu_kernels.paged_decode_attention, paged_decode_attention_ref, _decode_args(case, 3)),
    ]:
        torch.testing.assert_close(kernel(**args), ref(**args), **_tolerance(dtype))


@needs_cpp
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(8, 1), (4, 2)])
def test_cpp_decode_long_context_splits(q_heads: int, kv_heads: int) -> None:
    """One or two long rows: the kernel splits their contexts over threads and merges."""
    lens = [2000] if kv_heads == 1 else [1500, 3]
    case = make_paged_case(lens, [1] * len(lens), q_heads, kv_heads, 64, 16)
    args = _decode_args(case, len(lens))
    torch.testing.assert_close(
        cpu_kernels.paged_decode_attention(**args), paged_decode_attention_ref(**args),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@needs_cpp
def test_cpp_strided_query_from_fused_qkv() -> None:
    """Queries that are a view into a fused qkv projection are read in place."""
    case = make_paged_case([30, 9], [6, 9], 4, 2, 32, 8)
    tokens = case.query.shape[0]
    qkv = torch.randn(tokens, 8 * 32)
    qkv[:, : 4 * 32] = case.query.reshape(tokens, -1)
    query = qkv[:, : 4 * 32].view(tokens, 4, 32)  # token stride 256
    args = {**_prefill_args(case), "query": query}
    torch.testing.assert_close(
        cpu_kernels.paged_prefill_attention(**args), paged_prefill_attention_ref(**args),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    dargs = {**_decode_args(case, 2), "query": query[:2]}
    torch.testing.assert_close(
        cpu_kernels.paged_decode_attention(**dargs), paged_decode_attention_ref(**dargs),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpp_reshape_and_cache_matches_ref(dtype: torch.dtype, block_size: int) -> None:
    """Tokens land in their slots (the cache's dtype), padding slots write nothing."""
    case = make_paged_case([40, 7], [1, 1], 4, 2, 32, block_size, dtype)
    capacity = case.k_cache.shape[0] * block_size
    slots = torch.tensor([0, PAD_SLOT_ID, 5, capacity - 1, PAD_SLOT_ID, 17])
    key = torch.randn(6, 2, 32)  # float32 into a bfloat16 cache is cast
    value = torch.randn(6, 2, 32)
    expected = [case.k_cache.clone(), case.v_cache.clone()]
    reshape_and_cache_ref(key, value, *expected, slots)
    cpu_kernels.reshape_and_cache(key, value, case.k_cache, case.v_cache, slots)
    torch.testing.assert_close(case.k_cache, expected[0], atol=0, rtol=0)
    torch.testing.assert_close(case.v_cache, expected[1], atol=0, rtol=0)


@needs_cpp
def test_cpp_ops_table_has_attention() -> None:
    """The C++ ops table carries the attention kernels; the reference table the refs."""
    from vllm_mamba.ops.dispatch import REF_OPS

    ops = cpu_kernels.make_ops()
    assert ops.paged_decode_attention is cpu_kernels.paged_decode_attention
    assert ops.paged_prefill_attention is cpu_kernels.paged_prefill_attention
    assert ops.reshape_and_cache is cpu_kernels.reshape_and_cache
    assert REF_OPS.paged_decode_attention is paged_decode_attention_ref


@needs_cpp
def test_cpp_rejects_blocks_and_slots_outside_the_pool() -> None:
    """A used block id or a slot outside the pool raises instead of reading stray memory."""
    case = make_paged_case([20], [1], 4, 2, 32, 8)
    args = _decode_args(case, 1)
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][0, 1] = case.k_cache.shape[0]  # the second of three used blocks
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_decode_attention(**args)
    args["block_tables"][0, 1] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_prefill_attention(
            **{**_prefill_args(case), "block_tables": args["block_tables"]}
        )
    key = torch.randn(1, 2, 32)
    slot = torch.tensor([case.k_cache.shape[0] * 8])
    with pytest.raises(RuntimeError, match="beyond the cache"):
        cpu_kernels.reshape_and_cache(key, key, case.k_cache, case.v_cache, slot)
