"""The `mla` op family: the references against naive expanded attention, and the C++ kernels
(`csrc/mla_attention.cpp`) against the references.

The naive attention expands every cached latent to per-head keys `[c W_UK^T | k_rot]` and
values `c W_UV^T` (what `kv_b_proj` does in transformers) and runs causal softmax attention;
the absorbed ops must give the same values once `W_UV` maps their output. Cases cover head
counts, latent shapes (kv_lora_rank 16/32/64, rope 0/8/16), block sizes 1 to 32, contexts
crossing blocks, decode rows and padding rows, prefill chunks after cached context, padding
tokens and slots, non-contiguous queries and float32 / bfloat16 / float16 caches.
`make_mla_case` is shared with the Triton tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.ops.test_paged_attention import make_paged_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.families import family_ops
from vllm_mamba.ops.mla_attention import (
    FAMILY,
    mla_cache_write_ref,
    mla_decode_attention_ref,
    mla_prefill_attention_ref,
)

needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
HEADS = [1, 4, 5, 16]
# (kv_lora_rank, qk_rope_head_dim): the latent is R + Dr values per token.
LATENTS = [(16, 0), (32, 8), (64, 16)]
BLOCK_SIZES = [1, 8, 16, 32]
# (seq_len, q_len) per prefill sequence: a whole prompt, chunks after a cached context, a
# sequence with no query this step, lengths unaligned to blocks.
PREFILL = [(5, 5), (40, 7), (0, 0), (129, 1), (70, 33), (17, 17)]
DECODE_LENS = [1, 5, 16, 17, 100, 0, 133]  # 0: a padding row


@dataclass
class MLACase:
    """One MLA layer's latent cache with random contents, block tables and absorbed queries."""

    cache: torch.Tensor  # (NB, BS, L)
    block_tables: torch.Tensor  # (rows, max_blocks) int32
    seq_lens: torch.Tensor  # (rows,) int32
    query: torch.Tensor  # (T, Hq, L)
    query_start_loc: torch.Tensor  # (rows + 1,) int32


def make_mla_case(
    lens: list[int], q_lens: list[int], heads: int, latent_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device | str = "cpu",
) -> MLACase:  # fmt: skip
    """A paged case with one kv head of dim L (the latent), its cache viewed `(NB, BS, L)`."""
    case = make_paged_case(
        lens, q_lens, heads, 1, latent_dim, block_size, dtype, seed=seed, device=device
    )
    return MLACase(
        case.k_cache[:, :, 0], case.block_tables, case.seq_lens, case.query, case.query_start_loc
    )


def _impls() -> list:
    return ["ref", pytest.param("cpp", marks=needs_cpp)]


def _ops(impl: str):
    return family_ops(FAMILY, impl)


def _expanded_attention(
    q_nope: torch.Tensor, q_rot: torch.Tensor, latents: torch.Tensor, w_uk: torch.Tensor,
    w_uv: torch.Tensor, rank: int, scale: float, q_pos: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Naive MLA of queries at positions `q_pos (Q,)` over `latents (S, L)` of one sequence.

    Keys per head `[c W_UK^T | k_rot]`, values `c W_UV^T`, causal softmax -> `(Q, Hq, Dv)`.
    """
    c, k_rot = latents[:, :rank].double(), latents[:, rank:].double()
    k_nope = torch.einsum("sr,hnr->hsn", c, w_uk.double())  # (Hq, S, Dn)
    keys = torch.cat([k_nope, k_rot.expand(k_nope.shape[0], -1, -1)], dim=-1)
    values = torch.einsum("sr,hvr->hsv", c, w_uv.double())  # (Hq, S, Dv)
    queries = torch.cat([q_nope, q_rot], dim=-1).double().transpose(0, 1)  # (Hq, Q, Dn + Dr)
    scores = queries @ keys.transpose(1, 2) * scale  # (Hq, Q, S)
    allowed = torch.arange(latents.shape[0])[None, :] <= q_pos[:, None]  # (Q, S)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ values).transpose(0, 1).float()  # (Q, Hq, Dv)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return cache[table[pos // cache.shape[1]].long(), pos % cache.shape[1]].float()


@pytest.mark.parametrize(("rank", "rope"), LATENTS)
@pytest.mark.parametrize("heads", [1, 4])
def test_refs_match_expanded_attention(rank: int, rope: int, heads: int) -> None:
    """Absorbed decode and chunked prefill, mapped by W_UV, equal naive expanded attention."""
    nope, v_dim, block_size = 8, 12, 8
    gen = torch.Generator().manual_seed(3)
    w_uk = torch.randn(heads, nope, rank, generator=gen) / rank**0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) / rank**0.5
    scale = (nope + rope) ** -0.5
    lens, q_lens = [23, 9, 40], [23, 4, 1]
    case = make_mla_case(lens, q_lens, heads, rank + rope, block_size)
    tokens = case.query.shape[0]
    q_nope = torch.randn(tokens, heads, nope, generator=gen)
    q_rot = torch.randn(tokens, heads, rope, generator=gen)
    query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], dim=-1)
    out_lat = mla_prefill_attention_ref(
        query, case.cache, case.block_tables, case.query_start_loc, case.seq_lens, scale, rank
    )
    out = torch.einsum("thr,hvr->thv", out_lat, w_uv)
    qsl = case.query_start_loc.tolist()
    for p, (length, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        latents = _gather(case.cache, case.block_tables[p], length)
        part = slice(qsl[p], qsl[p + 1])
        q_pos = torch.arange(length - q_len, length)
        want = _expanded_attention(
            q_nope[part], q_rot[part], latents, w_uk, w_uv, rank, scale, q_pos
        )
        torch.testing.assert_close(out[part], want, atol=1e-5, rtol=1e-5)
        # The sequence's last token as a decode row reads the same.
        dec = mla_decode_attention_ref(
            query[qsl[p + 1] - 1 : qsl[p + 1]], case.cache, case.block_tables[p : p + 1],
            case.seq_lens[p : p + 1], scale, rank,
        )  # fmt: skip
        torch.testing.assert_close(dec[0], out_lat[qsl[p + 1] - 1], atol=1e-6, rtol=1e-6)
    assert not out[qsl[-1] :].any()  # padding tokens


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_matches_ref(impl: str, dtype: torch.dtype) -> None:
    """Rows land at their slots in the cache dtype; padding slots write nothing."""
    cache = torch.randn(5, 8, 24).to(dtype)
    latent = torch.randn(6, 24)
    slots = torch.tensor([0, PAD_SLOT_ID, 9, 39, 17, PAD_SLOT_ID], dtype=torch.int32)
    expected = cache.clone()
    mla_cache_write_ref(latent, expected, slots)
    assert torch.equal(expected[1, 1], latent[2].to(dtype))
    _ops(impl).cache_write(latent=latent, cache=cache, slot_mapping=slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@needs_cpp
@pytest.mark.parametrize(("rank", "rope"), LATENTS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cpp_decode_matches_ref(rank: int, rope: int, heads: int, block_size: int) -> None:
    case = make_mla_case(DECODE_LENS, [1] * len(DECODE_LENS), heads, rank + rope, block_size)
    rows = len(DECODE_LENS)
    args = {
        "query": case.query[:rows], "cache": case.cache, "block_tables": case.block_tables,
        "seq_lens": case.seq_lens, "scale": 0.3, "v_dim": rank,
    }  # fmt: skip
    out = cpu_kernels.mla_decode_attention(**args)
    assert out.shape == (rows, heads, rank)
    torch.testing.assert_close(out, mla_decode_attention_ref(**args), atol=1e-5, rtol=1e-5)
    assert not out[DECODE_LENS.index(0)].any()


@needs_cpp
@pytest.mark.parametrize(("rank", "rope"), LATENTS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cpp_prefill_matches_ref(rank: int, rope: int, heads: int, block_size: int) -> None:
    lens, q_lens = (list(x) for x in zip(*PREFILL, strict=True))
    case = make_mla_case(lens, q_lens, heads, rank + rope, block_size)
    args = {
        "query": case.query, "cache": case.cache, "block_tables": case.block_tables,
        "query_start_loc": case.query_start_loc, "seq_lens": case.seq_lens, "scale": 0.3,
        "v_dim": rank,
    }  # fmt: skip
    out = cpu_kernels.mla_prefill_attention(**args)
    torch.testing.assert_close(out, mla_prefill_attention_ref(**args), atol=1e-5, rtol=1e-5)
    assert not out[-2:].any()  # padding tokens


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpp_low_precision_matches_ref(dtype: torch.dtype) -> None:
    """Low-precision caches (and queries): float32 math, outputs in the query dtype."""
    case = make_mla_case([37, 9], [6, 1], 4, 40, 8, dtype)
    common = {"cache": case.cache, "block_tables": case.block_tables, "scale": 0.2, "v_dim": 32}
    prefill = {**common, "query": case.query, "query_start_loc": case.query_start_loc,
               "seq_lens": case.seq_lens}  # fmt: skip
    decode = {**common, "query": case.query[:2], "seq_lens": case.seq_lens}
    for kernel, ref, args in [
        (cpu_kernels.mla_prefill_attention, mla_prefill_attention_ref, prefill),
        (cpu_kernels.mla_decode_attention, mla_decode_attention_ref, decode),
    ]:
        out = kernel(**args)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref(**args), atol=2e-2, rtol=2e-2)
        # A float32 query over the low-precision cache: float32 out, close to the reference.
        args32 = {**args, "query": args["query"].float()}
        out32 = kernel(**args32)
        assert out32.dtype == torch.float32
        torch.testing.assert_close(out32, ref(**args32), atol=1e-5, rtol=1e-5)


@needs_cpp
def test_cpp_non_contiguous_query() -> None:
    """A query sliced out of a wider tensor (the layer's concatenation) reads the same."""
    case = make_mla_case([30, 12], [1, 1], 4, 24, 8)
    wide = torch.randn(2, 4, 40)
    wide[..., :24] = case.query[:2]
    args = {"cache": case.cache, "block_tables": case.block_tables, "seq_lens": case.seq_lens,
            "scale": 0.25, "v_dim": 16}  # fmt: skip
    out = cpu_kernels.mla_decode_attention(query=wide[..., :24], **args)
    want = mla_decode_attention_ref(query=case.query[:2], **args)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def run_chunked(ops, chunks: list[int], heads: int, rank: int, rope: int, block_size: int):
    """Writes one sequence chunk by chunk through `ops`, attending each chunk, then decodes its
    last token; returns (chunked outputs, whole-prefill reference, decode output)."""
    torch.manual_seed(1)
    total, dim = sum(chunks), rank + rope
    latents = torch.randn(total, dim)
    query = torch.randn(total, heads, dim)
    num_blocks = (total + block_size - 1) // block_size + 2
    cache = torch.zeros(num_blocks, block_size, dim)
    table = torch.randperm(num_blocks).to(torch.int32)[None, :]  # (1, NB)
    positions = torch.arange(total)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    scale = dim**-0.5
    outs, done = [], 0
    for size in chunks:
        part = slice(done, done + size)
        pad = torch.tensor([PAD_SLOT_ID])  # a padding token rides along, stores nothing
        ops.cache_write(
            latent=torch.cat([latents[part], latents[:1]]), cache=cache,
            slot_mapping=torch.cat([slots[part], pad]),
        )  # fmt: skip
        done += size
        outs.append(
            ops.prefill_attention(
                query=query[part], cache=cache, block_tables=table,
                query_start_loc=torch.tensor([0, size], dtype=torch.int32),
                seq_lens=torch.tensor([done], dtype=torch.int32), scale=scale, v_dim=rank,
            )
        )  # fmt: skip
    decode = ops.decode_attention(
        query=query[-1:], cache=cache, block_tables=table,
        seq_lens=torch.tensor([total], dtype=torch.int32), scale=scale, v_dim=rank,
    )  # fmt: skip
    whole_cache = latents.view(total, 1, dim)  # one block holding the whole sequence
    whole = mla_prefill_attention_ref(
        query, whole_cache.view(1, total, dim), torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, total], dtype=torch.int32), torch.tensor([total], dtype=torch.int32),
        scale, rank,
    )  # fmt: skip
    return torch.cat(outs), whole, decode


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("chunks", [[40], [1, 5, 17, 23], [16, 16, 3]])
@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_equals_whole(impl: str, chunks: list[int], block_size: int) -> None:
    chunked, whole, decode = run_chunked(_ops(impl), chunks, 4, 32, 8, block_size)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode[0], whole[-1], atol=1e-5, rtol=1e-5)
