"""`MLAAttention` over the paged latent cache against transformers' `KimiLinearAttention`.

A tiny Kimi config (hidden 64, 4 heads, kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head 16),
with and without the low-rank query: the layer, given transformers' weights, equals
transformers' causal forward over a whole sequence, in one engine step and chunked over two
steps (and a decode step), with the reference and the C++ ops and with either prefill form
(expanded, absorbed, expanded falling back to absorbed); a step mixing decode rows and
several prefill chunks equals transformers per sequence; with tensor parallelism the ranks'
head shards sum to the single-rank output; a rotary module rotates q_rot and k_rot.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import PagedMetadata, build_paged_metadata
from vllm_mamba.cache_specs import MLASpec
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.kv_cache import KVCache, plan_num_blocks
from vllm_mamba.layers.mla_attention import MLAAttention
from vllm_mamba.layers.parallel_linear import named_shards
from vllm_mamba.layers.quantization import quantize_model
from vllm_mamba.layers.rope_scaling import plain_frequencies
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
KimiLinearConfig = pytest.importorskip("transformers").KimiLinearConfig

HIDDEN, HEADS, RANK, NOPE, ROPE, V_DIM = 64, 4, 32, 16, 8, 16
BLOCK_SIZE = 4
CPU = torch.device("cpu")
needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
IMPLS = ["ref", pytest.param("cpp", marks=needs_cpp)]
# (prefill_form, expand_max_bytes): expanded, absorbed, expanded over the limit (absorbed).
FORMS = [("expanded", 2**30), ("absorbed", 2**30), ("expanded", 0)]


def _ops(impl: str):
    return REF_OPS if impl == "ref" else cpu_kernels.make_ops()


def _hf_attention(q_lora_rank: int | None) -> torch.nn.Module:
    """transformers' layer with random weights (norm weights too)."""
    config = KimiLinearConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        kv_lora_rank=RANK, q_lora_rank=q_lora_rank, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_DIM, vocab_size=32, num_hidden_layers=1,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = kimi.KimiLinearAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "layernorm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    return hf


def _hf_forward(hf: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' causal forward of `hidden (T, H)` as one sequence."""
    tokens = hidden.shape[0]
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]  # (1, 1, T, T)
    with torch.no_grad():
        out, _ = hf(hidden[None], attention_mask=mask)
    return out[0]


def _layer(hf: torch.nn.Module, impl: str, q_lora_rank: int | None, **kw) -> MLAAttention:
    layer = MLAAttention(
        HIDDEN, HEADS, q_lora_rank, RANK, NOPE, ROPE, V_DIM, 1e-6, _ops(impl), **kw
    )
    layer.load_state_dict(hf.state_dict())
    layer.process_weights_after_loading()
    return layer


def _bind(layer: torch.nn.Module, num_blocks: int = 8, dtype=torch.float32) -> KVCache:
    spec = layer.kv_spec(dtype)
    sizing = plan_num_blocks([spec], BLOCK_SIZE, 4, 64, torch.device("cpu"), None, num_blocks)
    cache = KVCache([spec], sizing, torch.device("cpu"))
    cache.bind(layer)
    return cache


TABLE = [5, 2, 7, 0, 3, 6]  # the sequence's shuffled blocks


def _prefill(ctx: int, n: int) -> PagedMetadata:
    layout = StepLayout(
        decode_slots=[], prefill_lens=[n], prefill_slots=[0], prefill_context_lens=[ctx],
        block_size=BLOCK_SIZE, prefill_block_tables=[TABLE],
    )  # fmt: skip
    return build_paged_metadata(layout, torch.device("cpu"))


def _decode(ctx: int) -> PagedMetadata:
    layout = StepLayout(
        decode_slots=[0], prefill_lens=[], prefill_slots=[], prefill_context_lens=[],
        decode_context_lens=[ctx], block_size=BLOCK_SIZE, decode_block_tables=[TABLE],
    )  # fmt: skip
    return build_paged_metadata(layout, torch.device("cpu"))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize(("form", "max_bytes"), FORMS)
def test_layer_equals_transformers(
    impl: str, q_lora_rank: int | None, form: str, max_bytes: int
) -> None:
    """Whole prefill, two chunks, and two chunks then a decode step all equal transformers."""
    hf = _hf_attention(q_lora_rank)
    hidden = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(1))
    want = _hf_forward(hf, hidden)
    layer = _layer(hf, impl, q_lora_rank, prefill_form=form)
    layer.expand_max_bytes = max_bytes
    assert layer.kv_spec(torch.bfloat16) == MLASpec(RANK + ROPE, torch.bfloat16)

    _bind(layer)
    with torch.no_grad():
        whole = layer(hidden, _prefill(0, 13))
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)

    _bind(layer)
    with torch.no_grad():
        first = layer(hidden[:6], _prefill(0, 6))
        second = layer(hidden[6:], _prefill(6, 7))
    torch.testing.assert_close(torch.cat([first, second]), want, atol=1e-5, rtol=1e-5)

    cache = _bind(layer)
    with torch.no_grad():
        layer(hidden[:5], _prefill(0, 5))
        layer(hidden[5:12], _prefill(5, 7))
        last = layer(hidden[12:], _decode(12))
    torch.testing.assert_close(last, want[12:], atol=1e-5, rtol=1e-5)
    # The cache holds the latents: 13 rows of R + Dr values, nothing per head.
    assert cache.layer(0).latent.shape == (8, BLOCK_SIZE, RANK + ROPE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("form", "max_bytes"), FORMS)
def test_mixed_step_equals_transformers(impl: str, form: str, max_bytes: int) -> None:
    """One step with two decode rows and three prefill chunks, one of them continuing a
    cached context, equals transformers per sequence."""
    hf = _hf_attention(None)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randn(n, HIDDEN, generator=gen) for n in (6, 3, 9, 5, 11)]
    wants = [_hf_forward(hf, x) for x in seqs]
    layer = _layer(hf, impl, None, prefill_form=form)
    layer.expand_max_bytes = max_bytes
    tables = [[0, 1], [2], [3, 4, 5], [6, 7], [8, 9, 10]]
    cache = _bind(layer, num_blocks=12)
    # Step 1: the two decoding sequences' prompts but their last token, and 4 tokens of seq 4.
    step1 = StepLayout(
        decode_slots=[], prefill_lens=[5, 2, 4], prefill_slots=[0, 1, 4],
        prefill_context_lens=[0, 0, 0], block_size=BLOCK_SIZE,
        prefill_block_tables=[tables[0], tables[1], tables[4]],
    )  # fmt: skip
    with torch.no_grad():
        layer(torch.cat([seqs[0][:5], seqs[1][:2], seqs[4][:4]]), build_paged_metadata(step1, CPU))
    # Step 2: decodes of seqs 0 and 1, whole prompts of seqs 2 and 3, the rest of seq 4.
    step2 = StepLayout(
        decode_slots=[0, 1], prefill_lens=[9, 5, 7], prefill_slots=[2, 3, 4],
        prefill_context_lens=[0, 0, 4], decode_context_lens=[5, 2], block_size=BLOCK_SIZE,
        decode_block_tables=[tables[0], tables[1]],
        prefill_block_tables=[tables[2], tables[3], tables[4]],
    )  # fmt: skip
    hidden = torch.cat([seqs[0][5:], seqs[1][2:], seqs[2], seqs[3], seqs[4][4:]])
    with torch.no_grad():
        out = layer(hidden, build_paged_metadata(step2, CPU))
    got = out.split([1, 1, 9, 5, 7])
    torch.testing.assert_close(got[0], wants[0][5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], wants[1][2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], wants[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3], wants[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[4], wants[4][4:], atol=1e-5, rtol=1e-5)
    assert cache.nbytes() == 12 * BLOCK_SIZE * (RANK + ROPE) * 4


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_layer_close_to_transformers(impl: str) -> None:
    """A bfloat16 layer with a bfloat16 latent cache stays close to float32 transformers."""
    hf = _hf_attention(None)
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    want = _hf_forward(hf, hidden)
    layer = _layer(hf, impl, None).to(torch.bfloat16)
    layer.process_weights_after_loading()
    _bind(layer, dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.cat([
            layer(hidden[:4].bfloat16(), _prefill(0, 4)),
            layer(hidden[4:].bfloat16(), _prefill(4, 5)),
        ])  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


def test_rotary_rotates_rope_parts() -> None:
    """With a rotary module, q_rot and k_rot are rotated at the tokens' positions before the
    latent is cached: chunked equals whole, and differs from the unrotated layer."""
    hf = _hf_attention(None)
    hidden = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(3))
    rotary = RotaryEmbedding(ROPE, ROPE, 64, plain_frequencies(10000.0, ROPE))
    layer = _layer(hf, "ref", None, rotary=rotary)
    _bind(layer)
    with torch.no_grad():
        whole = layer(hidden, _prefill(0, 10))
    _bind(layer)
    with torch.no_grad():
        chunked = torch.cat([layer(hidden[:3], _prefill(0, 3)), layer(hidden[3:], _prefill(3, 7))])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(whole, _hf_forward(hf, hidden), atol=1e-3)


def test_tensor_parallel_shards_sum_to_single_rank() -> None:
    """Two ranks' head shards (o_proj partial sums added here instead of all-reduced) equal
    one rank; heads that do not divide over the ranks are refused."""
    hf = _hf_attention(24)
    hidden = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4))
    full = hf.state_dict()
    total = torch.zeros(7, HIDDEN)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        layer = MLAAttention(HIDDEN, HEADS, 24, RANK, NOPE, ROPE, V_DIM, 1e-6, REF_OPS, tp)
        shards = named_shards(layer)
        assert set(shards) == {"q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight"}
        state = {n: shards[n].read(t, n) if n in shards else t for n, t in full.items()}
        layer.load_state_dict(state)
        assert layer.num_heads == 2 and layer.kv_b_proj.weight.shape == (2 * (NOPE + V_DIM), RANK)
        layer.o_proj.reduce = False  # the test sums the ranks' partial outputs
        _bind(layer)
        with torch.no_grad():
            total += layer(hidden, _prefill(0, 7))
    torch.testing.assert_close(total, _hf_forward(hf, hidden), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_attention_heads"):
        MLAAttention(HIDDEN, 3, None, RANK, NOPE, ROPE, V_DIM, 1e-6, REF_OPS, TensorParallel(0, 2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_layer_close_to_transformers(impl: str, method: str) -> None:
    """Quantised projections stay close; `kv_b_proj` stays float (`FLOAT_LINEARS`: decode
    reads its float32 W_UK / W_UV copies, so prefill's expansion must use the same weights)."""
    hf = _hf_attention(None)
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(6))
    want = _hf_forward(hf, hidden)
    layer = _layer(hf, impl, None)
    quantize_model(layer, _ops(impl), method)
    assert layer.kv_b_proj.weight.dtype == torch.float32
    assert layer.o_proj.weight.dtype in (torch.int8, torch.uint8)
    _bind(layer)
    with torch.no_grad():
        out = torch.cat([layer(hidden[:4], _prefill(0, 4)), layer(hidden[4:], _prefill(4, 5))])
    atol = 2e-2 if method == "int8" else 1e-1
    torch.testing.assert_close(out, want, atol=atol, rtol=atol)
