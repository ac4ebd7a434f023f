"""The sparse attention layers (GLM-5-Next's DSA over MLA latents, Qwen4-Exp's QSA over GQA
keys and values) on the Triton kernels against the same layers on the references.

The layers read each query's selected tokens through a block table of one-token blocks
(`layers.block_indexer.selected_slots`), which the `mla` and paged-attention families' Triton
decode kernels take as any block table: a whole prefill, then decode steps, of a sequence whose
selection drops pools equal the reference layer's. On the CPU the kernels run in the Triton
interpreter, in the child process of `test_triton_interpreter` (see `test_triton_ssd`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.attention.backend import StepLayout  # noqa: E402
from vllm_mamba.attention.backends.paged import build_paged_metadata  # noqa: E402
from vllm_mamba.kv_cache import KVCache, plan_num_blocks  # noqa: E402
from vllm_mamba.layers.indexed_mla_attention import IndexedMLAAttention  # noqa: E402
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm  # noqa: E402
from vllm_mamba.layers.pool_indexer import PoolIndexer  # noqa: E402
from vllm_mamba.layers.qsa_attention import IndexedSelfAttention, QSAIndexer  # noqa: E402
from vllm_mamba.layers.rope_scaling import plain_frequencies  # noqa: E402
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from vllm_mamba.ops import triton_ops  # noqa: E402
from vllm_mamba.ops.dispatch import REF_OPS  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]
HIDDEN, SEQ, BLOCK_SIZE, TABLE = 32, 21, 4, [3, 0, 5, 1, 4, 2]


def _dsa(ops):  # noqa: ANN001, ANN202
    indexer = PoolIndexer(HIDDEN, 16, 16, 8, 2, 4, ops)
    return IndexedMLAAttention(HIDDEN, 2, 16, 16, 8, 0, 8, 1e-6, ops, indexer=indexer)


def _qsa(ops):  # noqa: ANN001, ANN202
    rotary = RotaryEmbedding(8, 4, 64, plain_frequencies(10000.0, 4))
    index_rotary = RotaryEmbedding(8, 4, 64, plain_frequencies(10000.0, 4))
    indexer = QSAIndexer(HIDDEN, 16, 8, 2, 4, 1e-6, index_rotary, ops)
    return IndexedSelfAttention(
        HIDDEN, 4, 2, 8, bias=False, scale=8**-0.5, rotary=rotary, ops=ops, output_gate=True,
        q_norm=ZeroCenteredRMSNorm(8), k_norm=ZeroCenteredRMSNorm(8), indexer=indexer,
    )  # fmt: skip


def ops_name(layer: torch.nn.Module) -> str:
    """The backend whose decode kernel the layer's attention calls."""
    attn = layer.attn if isinstance(layer, IndexedSelfAttention) else layer
    kernel = attn.ops.paged_decode_attention if attn is not layer else attn.mla.decode_attention
    return "triton" if "triton" in kernel.__module__ else kernel.__module__


def _run(layer: torch.nn.Module, hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 9-token prefill then decode steps to `SEQ` tokens -> every token's output."""
    attn = layer.attn if isinstance(layer, IndexedSelfAttention) else layer
    spec = attn.kv_spec(torch.float32)
    cache = KVCache([spec], plan_num_blocks([spec], BLOCK_SIZE, 1, 32, device, None, 8), device)
    attn.bind_kv_cache(cache.layer(0))
    outs = []
    with torch.no_grad():
        layout = StepLayout(
            decode_slots=[], prefill_lens=[9], prefill_slots=[0], prefill_context_lens=[0],
            block_size=BLOCK_SIZE, prefill_block_tables=[TABLE],
        )  # fmt: skip
        outs.append(layer(hidden[:9], build_paged_metadata(layout, device)))
        for t in range(9, SEQ):
            layout = StepLayout(
                decode_slots=[0], prefill_lens=[], prefill_slots=[], prefill_context_lens=[],
                decode_context_lens=[t], block_size=BLOCK_SIZE, decode_block_tables=[TABLE],
            )  # fmt: skip
            outs.append(layer(hidden[t : t + 1], build_paged_metadata(layout, device)))
    return torch.cat(outs)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("build", [_dsa, _qsa], ids=["dsa", "qsa"])
def test_triton_layer_equals_reference(device: str, build) -> None:  # noqa: ANN001
    device = torch.device(device)
    torch.manual_seed(0)
    ref = build(REF_OPS)
    with torch.no_grad():
        for param in ref.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    fast = build(triton_ops.make_ops())
    fast.load_state_dict(ref.state_dict())
    ref, fast = ref.to(device), fast.to(device)
    hidden = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    want = _run(ref, hidden, device)
    assert (ref.indexer.width, ops_name(fast)) == (5, "triton")  # 5 of up to 21 tokens a query
    torch.testing.assert_close(_run(fast, hidden, device), want, atol=1e-4, rtol=1e-4)
