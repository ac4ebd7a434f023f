"""Qwen4-Exp's indexed attention (`IndexedSelfAttention` with its `QSAIndexer`) and gated
hyper-connections (`GatedResidual`) against transformers' `Qwen4ExpTextAttention` and
`Qwen4ExpTextGatedResidual`.

A tiny config (hidden 64, 4 query heads and 2 key/value heads of 32 with partial RoPE; an
indexer of 8 heads of 16 keeping 2 blocks of 4 tokens and the tail) over 30-token sequences,
so the selection drops blocks: the layer, given transformers' weights, equals transformers'
forward over the whole sequence in one step, and chunked with cuts inside a block then decoded
token by token (the gathered decode against transformers' dense attention restricted to the
selection), with the prefill gathered or masked, with the reference and the C++ ops; a step
mixing decode rows and prefill chunks equals transformers per sequence; the cached block keys
equal transformers' pooling.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.mixed_steps import LENGTHS, NUM_BLOCKS, run_mixed_steps, step_two_rows
from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import PagedMetadata, build_paged_metadata
from vllm_mamba.cache_specs import AttentionSpec, IndexerSpec
from vllm_mamba.kv_cache import KVCache, plan_num_blocks
from vllm_mamba.layers import qsa_attention
from vllm_mamba.layers.hyper_connection import GatedResidual
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.layers.qsa_attention import IndexedSelfAttention, QSAIndexer
from vllm_mamba.layers.rotary_embedding import RotaryEmbedding
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS

qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
Qwen4ExpTextConfig = pytest.importorskip("transformers").Qwen4ExpTextConfig

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 32
INDEX_HEADS, INDEX_DIM, RATIO, BUDGET = 8, 16, 4, 8
BLOCK_SIZE, SEQ = 8, 30
CPU = torch.device("cpu")
needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
IMPLS = ["ref", pytest.param("cpp", marks=needs_cpp)]
TABLE = [5, 2, 7, 0, 3, 6]


def _config() -> Qwen4ExpTextConfig:
    config = Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_hidden_layers=1, vocab_size=32, hc_count=3, hc_lowrank=8,
        indexer_n_heads=INDEX_HEADS, indexer_kv_heads=1, indexer_head_dim=INDEX_DIM,
        indexer_budget=BUDGET, indexer_compress_ratio=RATIO,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.1 if "norm" in name else 0.15
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return module.eval()


def _hf_forward(hf: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' forward of `hidden (T, H)` as one sequence."""
    config, tokens = hf.config, hidden.shape[0]
    rotary = qwen4.Qwen4ExpTextRotaryEmbedding(config)
    positions = torch.arange(tokens).view(1, 1, -1).expand(3, 1, -1)
    cos_sin = rotary(hidden[None], positions)
    mask = torch.full((tokens, tokens), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out, _ = hf(hidden[None], cos_sin, attention_mask=mask)
    return out[0]


def _layer(hf: torch.nn.Module, impl: str) -> IndexedSelfAttention:
    config = hf.config
    ops = REF_OPS if impl == "ref" else cpu_kernels.make_ops()
    rot = int(HEAD_DIM * 0.25)
    indexer = QSAIndexer(
        HIDDEN, INDEX_HEADS, INDEX_DIM, RATIO, BUDGET, config.rms_norm_eps,
        RotaryEmbedding.from_config(config, INDEX_DIM, rot_dim=rot), ops,
    )  # fmt: skip
    eps = config.rms_norm_eps
    layer = IndexedSelfAttention(
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM, bias=False, scale=HEAD_DIM**-0.5,
        rotary=RotaryEmbedding.from_config(config, HEAD_DIM), ops=ops, output_gate=True,
        q_norm=ZeroCenteredRMSNorm(HEAD_DIM, eps), k_norm=ZeroCenteredRMSNorm(HEAD_DIM, eps),
        indexer=indexer,
    )  # fmt: skip
    layer.load_state_dict(hf.state_dict())
    return layer


def _bind(layer: IndexedSelfAttention, num_blocks: int = 8) -> KVCache:
    spec = layer.attn.kv_spec(torch.float32)
    sizing = plan_num_blocks([spec], BLOCK_SIZE, 4, 64, CPU, None, num_blocks)
    cache = KVCache([spec], sizing, CPU)
    layer.attn.bind_kv_cache(cache.layer(0))
    return cache


def _step(ctx: int, n: int, decode: bool = False) -> PagedMetadata:
    if decode:
        layout = StepLayout(
            decode_slots=[0], prefill_lens=[], prefill_slots=[], prefill_context_lens=[],
            decode_context_lens=[ctx], block_size=BLOCK_SIZE, decode_block_tables=[TABLE],
        )  # fmt: skip
    else:
        layout = StepLayout(
            decode_slots=[], prefill_lens=[n], prefill_slots=[0], prefill_context_lens=[ctx],
            block_size=BLOCK_SIZE, prefill_block_tables=[TABLE],
        )  # fmt: skip
    return build_paged_metadata(layout, CPU)


def _hidden(seed: int, n: int = SEQ) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return _randomized(qwen4.Qwen4ExpTextAttention(_config(), 0), seed=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dense_factor", [0, 100])  # prefill gathered per query / masked dense
def test_layer_equals_transformers(
    hf: torch.nn.Module, impl: str, dense_factor: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole prefill, and chunks cut inside blocks followed by decode steps, equal
    transformers; the selection drops blocks."""
    monkeypatch.setattr(qsa_attention, "DENSE_FACTOR", dense_factor)
    hidden = _hidden(1)
    want = _hf_forward(hf, hidden)
    layer = _layer(hf, impl)
    assert layer.attn.kv_spec(torch.bfloat16) == AttentionSpec(
        KV_HEADS, HEAD_DIM, torch.bfloat16,
        indexer=IndexerSpec(INDEX_DIM, INDEX_DIM, RATIO, torch.bfloat16),
    )  # fmt: skip
    _bind(layer)
    with torch.no_grad():
        whole = layer(hidden, _step(0, SEQ))
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)

    _bind(layer)
    with torch.no_grad():
        outs = [layer(hidden[:6], _step(0, 6)), layer(hidden[6:19], _step(6, 13))]
        outs += [layer(hidden[t : t + 1], _step(t, 1, decode=True)) for t in range(19, SEQ)]
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)


def test_block_keys_equal_transformers(hf: torch.nn.Module) -> None:
    """Each complete block's cached key: the normed mean of its raw keys, rotated at its
    start (transformers' indexer, inline)."""
    hidden = _hidden(2)
    layer = _layer(hf, "ref")
    cache = _bind(layer)
    with torch.no_grad():
        layer(hidden, _step(0, SEQ))
        index = hf.indexer
        raw = index.index_qk_proj(hidden)[:, INDEX_HEADS * INDEX_DIM :]  # (T, D)
        rotary = qwen4.Qwen4ExpTextRotaryEmbedding(hf.config)
        cos, sin = rotary(hidden[None], torch.arange(SEQ).view(1, 1, -1).expand(3, 1, -1))
        blocks = SEQ // RATIO
        pooled = index.k_layernorm(raw[: blocks * RATIO].view(blocks, RATIO, -1).float().mean(1))
        starts = torch.arange(blocks) * RATIO
        want = qwen4.apply_rotary_pos_emb(pooled[:, None], cos=cos[0, starts], sin=sin[0, starts])
    view = cache.layer(0)
    for j in range(blocks):
        block, offset = TABLE[j * RATIO // BLOCK_SIZE], (j * RATIO) % BLOCK_SIZE
        torch.testing.assert_close(view.pooled[block, offset // RATIO], want[j, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_step_equals_transformers(hf: torch.nn.Module, impl: str) -> None:
    """Two decode rows and two prefill chunks (one continuing its context) in one step equal
    transformers per sequence."""
    seqs = [_hidden(10 + i, n) for i, n in enumerate(LENGTHS)]
    wants = [_hf_forward(hf, x) for x in seqs]
    layer = _layer(hf, impl)
    _bind(layer, num_blocks=NUM_BLOCKS)
    got = run_mixed_steps(layer, seqs, BLOCK_SIZE)
    for out, want in zip(got, step_two_rows(wants)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inject", [True, False])
def test_gated_residual_equals_transformers(inject: bool) -> None:
    """Collapse / expand (and the final merge without injection) equal transformers'."""
    hf = _randomized(qwen4.Qwen4ExpTextGatedResidual(_config(), use_combine=inject), seed=3)
    ours = GatedResidual(HIDDEN, 3, 8, _config().rms_norm_eps, REF_OPS, inject=inject)
    ours.load_state_dict(hf.state_dict())
    streams = torch.randn(5, 3, HIDDEN, generator=torch.Generator().manual_seed(4))
    out = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        if not inject:
            torch.testing.assert_close(ours.merge(streams), hf(streams.flatten(1)[None])[0])
            return
        mixed, hyper_input, weights = hf(streams.flatten(1)[None])
        want = hyper_input[0] + (out[:, None, :] * weights[0][..., None]).flatten(1)
        x, ctx = ours.collapse(streams)
    torch.testing.assert_close(x, mixed[0])
    torch.testing.assert_close(ours.expand(out, ctx, streams).flatten(1), want)
