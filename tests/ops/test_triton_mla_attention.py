"""The Triton kernels of the `mla` op family against the references in `ops/mla_attention.py`.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_ssd`);
the interpreter cases are tiny. The GPU tests (larger cases, CUDA-graph capture of decode)
carry the `cuda` marker and skip without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_mla_attention import make_mla_case, run_chunked
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.mla_attention import (
    mla_cache_write_ref,
    mla_decode_attention_ref,
    mla_prefill_attention_ref,
)

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops import triton_mla as tm  # noqa: E402
from vllm_mamba.ops.families import family_ops  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
# (query heads, kv_lora_rank, qk_rope_head_dim, block size): a single head, head counts under
# and over the decode kernel's 16 heads per program, rope 0, latents not powers of two, one
# over the 64-column chunks of the score products (two chunks, the second partial), block
# sizes under and over the 16-position tiles.
SHAPES = [(1, 16, 0, 16), (4, 32, 8, 1), (5, 24, 16, 8), (20, 16, 8, 32), (3, 64, 16, 8)]
# (seq_len, q_len): a whole prompt, a chunk after cached context, an empty row, one token.
PREFILL = [(5, 5), (40, 7), (0, 0), (17, 17), (33, 1)]
DECODE_LENS = [1, 17, 0, 40]  # 0: a padding row


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


def _scaled(lens: list[int], device: torch.device) -> list[int]:
    """Longer contexts on a GPU, the tiny ones in the interpreter."""
    return lens if device.type == "cpu" else [n * 7 for n in lens]


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_ref(device: torch.device, shape: tuple[int, int, int, int]) -> None:
    heads, rank, rope, block_size = shape
    lens = _scaled(DECODE_LENS, device)
    case = make_mla_case(lens, [1] * 4, heads, rank + rope, block_size, device=device)
    args = {
        "query": case.query[:4], "cache": case.cache, "block_tables": case.block_tables,
        "seq_lens": case.seq_lens, "scale": 0.3, "v_dim": rank,
    }  # fmt: skip
    out = tm.mla_decode_attention(**args)
    torch.testing.assert_close(out, mla_decode_attention_ref(**args), atol=1e-5, rtol=1e-5)
    assert not out[2].any()


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_matches_ref(device: torch.device, shape: tuple[int, int, int, int]) -> None:
    heads, rank, rope, block_size = shape
    lens, q_lens = (list(x) for x in zip(*PREFILL, strict=True))
    if device.type == "cuda":
        lens = [n + 100 * (n > 0) for n in lens]  # longer cached contexts
    case = make_mla_case(lens, q_lens, heads, rank + rope, block_size, device=device)
    args = {
        "query": case.query, "cache": case.cache, "block_tables": case.block_tables,
        "query_start_loc": case.query_start_loc, "seq_lens": case.seq_lens, "scale": 0.3,
        "v_dim": rank,
    }  # fmt: skip
    out = tm.mla_prefill_attention(**args)
    torch.testing.assert_close(out, mla_prefill_attention_ref(**args), atol=1e-5, rtol=1e-5)
    assert not out[-2:].any()  # padding tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_ref(device: torch.device, dtype: torch.dtype) -> None:
    case = make_mla_case([20, 9], [6, 1], 4, 40, 8, dtype, device=device)
    common = {"cache": case.cache, "block_tables": case.block_tables, "scale": 0.2, "v_dim": 32}
    prefill = {**common, "query": case.query, "query_start_loc": case.query_start_loc,
               "seq_lens": case.seq_lens}  # fmt: skip
    decode = {**common, "query": case.query[:2], "seq_lens": case.seq_lens}
    for kernel, ref, args in [
        (tm.mla_prefill_attention, mla_prefill_attention_ref, prefill),
        (tm.mla_decode_attention, mla_decode_attention_ref, decode),
    ]:
        out = kernel(**args)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref(**args), atol=2e-2, rtol=2e-2)


def test_cache_write_matches_ref(device: torch.device) -> None:
    cache = torch.randn(5, 8, 24).to(torch.bfloat16).to(device)
    slots = torch.tensor([0, PAD_SLOT_ID, 5, 39, 17], device=device)
    latent = torch.randn(5, 24, device=device)
    expected = cache.clone()
    mla_cache_write_ref(latent, expected, slots)
    tm.mla_cache_write(latent, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.skipif(not IN_INTERPRETER, reason="the chunked flow runs on CPU tensors")
def test_chunked_prefill_equals_whole() -> None:
    """Chunks of 1, 5 and 17 tokens through the latent cache (block size 8) equal one pass,
    and the family's `triton` ops are these kernels."""
    ops = family_ops("mla", "triton")
    assert ops.decode_attention is tm.mla_decode_attention
    chunked, whole, decode = run_chunked(ops, [1, 5, 17], 4, 32, 8, 8)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode[0], whole[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@_NEEDS_CUDA
def test_decode_cuda_graph_replays_with_new_tables() -> None:
    """Decode captured in a CUDA graph follows new block tables and lengths on replay."""
    case = make_mla_case([50, 300, 0, 129], [1] * 4, 16, 576, 16, device="cuda")
    query, tables, lens = case.query[:4].clone(), case.block_tables.clone(), case.seq_lens.clone()
    args = {"query": query, "cache": case.cache, "block_tables": tables, "seq_lens": lens,
            "scale": 0.07, "v_dim": 512}  # fmt: skip
    tm.mla_decode_attention(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tm.mla_decode_attention(**args)
    tables.copy_(tables.flip(0))
    lens.copy_(lens.flip(0))
    graph.replay()
    torch.testing.assert_close(out, mla_decode_attention_ref(**args), atol=1e-5, rtol=1e-5)
