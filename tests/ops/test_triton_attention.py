"""The Triton paged attention kernels against the references in `ops/paged_attention.py`.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_ssd`);
the interpreter cases are tiny. The GPU tests (larger cases, CUDA-graph capture of decode)
carry the `cuda` marker and skip without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_paged_attention import _run_chunked, make_paged_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops import triton_attention as ta  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
# (query heads, kv heads, head dim, block size): MHA, GQA 2 and 4, MQA; head dims that are
# not powers of two; block sizes under and over the kernels' 16-position tiles.
SHAPES = [(4, 4, 32, 16), (4, 2, 16, 1), (8, 2, 20, 8), (4, 1, 32, 32)]
# (seq_len, q_len): a whole prompt, a chunk after cached context, an empty row, one token.
PREFILL = [(5, 5), (40, 7), (0, 0), (17, 17), (33, 1)]
DECODE_LENS = [1, 17, 0, 40]  # 0: a padding row
TRITON = {
    "cache": ta.reshape_and_cache,
    "prefill": ta.paged_prefill_attention,
    "decode": ta.paged_decode_attention,
}


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


def _scale(case) -> float:
    return case.query.shape[-1] ** -0.5


def _scaled(lens: list[int], device: torch.device) -> list[int]:
    """Longer contexts on a GPU, the tiny ones in the interpreter."""
    return lens if device.type == "cpu" else [n * 7 for n in lens]


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_ref(device: torch.device, shape: tuple[int, int, int, int]) -> None:
    q_heads, kv_heads, head_dim, block_size = shape
    lens = _scaled(DECODE_LENS, device)
    case = make_paged_case(lens, [1] * 4, q_heads, kv_heads, head_dim, block_size, device=device)
    args = {
        "query": case.query[:4], "k_cache": case.k_cache, "v_cache": case.v_cache,
        "block_tables": case.block_tables, "seq_lens": case.seq_lens, "scale": _scale(case),
    }  # fmt: skip
    out = ta.paged_decode_attention(**args)
    torch.testing.assert_close(out, paged_decode_attention_ref(**args), atol=1e-5, rtol=1e-5)
    assert not out[2].any()


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_matches_ref(device: torch.device, shape: tuple[int, int, int, int]) -> None:
    q_heads, kv_heads, head_dim, block_size = shape
    lens, q_lens = (list(x) for x in zip(*PREFILL, strict=True))
    if device.type == "cuda":
        lens = [n + 100 * (n > 0) for n in lens]  # longer cached contexts
    case = make_paged_case(lens, q_lens, q_heads, kv_heads, head_dim, block_size, device=device)
    args = {
        "query": case.query, "k_cache": case.k_cache, "v_cache": case.v_cache,
        "block_tables": case.block_tables, "query_start_loc": case.query_start_loc,
        "seq_lens": case.seq_lens, "scale": _scale(case),
    }  # fmt: skip
    out = ta.paged_prefill_attention(**args)
    torch.testing.assert_close(out, paged_prefill_attention_ref(**args), atol=1e-5, rtol=1e-5)
    assert not out[-2:].any()  # padding tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_ref(device: torch.device, dtype: torch.dtype) -> None:
    case = make_paged_case([20, 9], [6, 1], 4, 2, 32, 8, dtype, device=device)
    common = {"k_cache": case.k_cache, "v_cache": case.v_cache, "block_tables": case.block_tables}
    prefill = {**common, "query": case.query, "query_start_loc": case.query_start_loc,
               "seq_lens": case.seq_lens, "scale": _scale(case)}  # fmt: skip
    decode = {**common, "query": case.query[:2], "seq_lens": case.seq_lens, "scale": _scale(case)}
    for kernel, ref, args in [
        (ta.paged_prefill_attention, paged_prefill_attention_ref, prefill),
        (ta.paged_decode_attention, paged_decode_attention_ref, decode),
    ]:
        out = kernel(**args)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref(**args), atol=2e-2, rtol=2e-2)


def test_reshape_and_cache_matches_ref(device: torch.device) -> None:
    case = make_paged_case([20, 7], [1, 1], 4, 2, 16, 8, torch.bfloat16, device=device)
    capacity = case.k_cache.shape[0] * 8
    slots = torch.tensor([0, PAD_SLOT_ID, 5, capacity - 1, 17], device=device)
    key, value = (torch.randn(5, 2, 16, device=device) for _ in range(2))
    expected = [case.k_cache.clone(), case.v_cache.clone()]
    reshape_and_cache_ref(key, value, *expected, slots)
    ta.reshape_and_cache(key, value, case.k_cache, case.v_cache, slots)
    torch.testing.assert_close(case.k_cache, expected[0], atol=0, rtol=0)
    torch.testing.assert_close(case.v_cache, expected[1], atol=0, rtol=0)


@pytest.mark.skipif(not IN_INTERPRETER, reason="the chunked flow runs on CPU tensors")
def test_chunked_prefill_equals_dense_attention() -> None:
    """Chunks of 1, 5 and 17 tokens through the cache (block size 8, MQA) equal one dense pass."""
    paged, dense = _run_chunked(TRITON, [1, 5, 17], 4, 1, 8)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not IN_INTERPRETER, reason="the chunked flow runs on CPU tensors")
@pytest.mark.parametrize(("chunks", "window"), [([1, 5, 17], 6), ([20, 3], 1), ([9, 9], 40)])
def test_sliding_window_equals_dense_windowed_attention(chunks: list[int], window: int) -> None:
    """With a sliding window (the blocks it has passed poisoned and dropped from the table),
    chunked prefill and decode equal dense attention with the window mask."""
    paged, dense = _run_chunked(TRITON, chunks, 4, 2, 8, window)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not IN_INTERPRETER, reason="the chunked flow runs on CPU tensors")
@pytest.mark.parametrize(
    ("chunks", "window", "extent", "with_sinks"),
    [([1, 5, 17], 0, 9, True), ([20, 3], 6, 40, False), ([9, 9], 0, 0, True)],
)
def test_distance_bias_and_sinks_equal_a_float64_softmax(
    chunks: list[int], window: int, extent: int, with_sinks: bool
) -> None:
    """With a score bias by distance and sink logits, chunked prefill and decode equal the
    float64 softmax written out (with and without a window)."""
    paged, dense = _run_chunked(TRITON, chunks, 4, 2, 8, window, extent, with_sinks)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


def test_distance_bias_and_sinks_match_ref(device: torch.device) -> None:
    """Varlen prefill and decode rows with the score terms, padding rows and tokens too."""
    gen = torch.Generator().manual_seed(5)
    lens, q_lens = (list(x) for x in zip(*PREFILL, strict=True))
    case = make_paged_case(_scaled(lens, device), q_lens, 4, 2, 32, 8, device=device)
    tokens = case.query.shape[0]
    terms = {
        "rel": torch.randn(tokens, 4, 13, generator=gen).to(device),
        "sinks": torch.randn(tokens, 4, generator=gen).to(device),
    }
    common = {"k_cache": case.k_cache, "v_cache": case.v_cache, "block_tables": case.block_tables}
    prefill = {**common, **terms, "query": case.query, "query_start_loc": case.query_start_loc,
               "seq_lens": case.seq_lens, "scale": _scale(case)}  # fmt: skip
    rows = len(lens)
    decode = {**common, "query": case.query[:rows], "seq_lens": case.seq_lens,
              "scale": _scale(case), "sliding_window": 5,
              "rel": terms["rel"][:rows], "sinks": terms["sinks"][:rows]}  # fmt: skip
    for kernel, ref, args in [
        (ta.paged_prefill_attention, paged_prefill_attention_ref, prefill),
        (ta.paged_decode_attention, paged_decode_attention_ref, decode),
    ]:
        torch.testing.assert_close(kernel(**args), ref(**args), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@_NEEDS_CUDA
def test_decode_cuda_graph_replays_with_new_tables() -> None:
    """Decode captured in a CUDA graph follows new block tables and lengths on replay."""
    case = make_paged_case([50, 300, 0, 129], [1] * 4, 8, 2, 64, 16, device="cuda")
    query, tables, lens = case.query[:4].clone(), case.block_tables.clone(), case.seq_lens.clone()
    args = {"query": query, "k_cache": case.k_cache, "v_cache": case.v_cache,
            "block_tables": tables, "seq_lens": lens, "scale": 0.125}  # fmt: skip
    ta.paged_decode_attention(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.paged_decode_attention(**args)
    tables.copy_(tables.flip(0))
    lens.copy_(lens.flip(0))
    graph.replay()
    torch.testing.assert_close(out, paged_decode_attention_ref(**args), atol=1e-5, rtol=1e-5)
