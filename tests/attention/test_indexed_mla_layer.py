"""GLM-5-Next's sparse attention (`IndexedMLAAttention` with its `PoolIndexer`) and its mHC
streams (`HyperConnection`) against transformers' `Glm5NextTextAttention`, `Glm5NextTextIndexer`
and `Glm5NextTextHyperConnection`.

A tiny config (hidden 64, 4 heads, q rank 24, latent 32, nope 16, v 16; an indexer of 16 heads
of 8 keeping 2 pools of 4 tokens and the tail), over 30-token sequences, so the selection drops
pools: the layer, given transformers' weights, equals transformers' forward over the whole
sequence in one step, chunked with cuts inside a pool and then decoded token by token (the
gathered sparse decode against transformers' dense attention restricted to the selection),
with the reference and the C++ ops, with the prefill expanded or gathered; a step mixing decode
rows and prefill chunks equals transformers per sequence; the cached pooled keys equal
transformers' pooling; a shared layer reuses the full layer's selection as transformers does.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.helpers.mixed_steps import LENGTHS, NUM_BLOCKS, run_mixed_steps, step_two_rows
from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import PagedMetadata, build_paged_metadata
from vllm_mamba.cache_specs import IndexerSpec, MLASpec
from vllm_mamba.kv_cache import KVCache, plan_num_blocks
from vllm_mamba.layers.hyper_connection import HyperConnection
from vllm_mamba.layers.indexed_mla_attention import IndexedMLAAttention
from vllm_mamba.layers.pool_indexer import PoolIndexer
from vllm_mamba.models.glm5_next import _layer_kinds
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS

glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
Glm5NextTextConfig = pytest.importorskip("transformers").Glm5NextTextConfig

HIDDEN, HEADS, Q_RANK, RANK, NOPE, V_DIM = 64, 4, 24, 32, 16, 16
INDEX_HEADS, INDEX_DIM, KPOOL, TOPK = 16, 8, 4, 8
BLOCK_SIZE, SEQ = 8, 30
CPU = torch.device("cpu")
needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
IMPLS = ["ref", pytest.param("cpp", marks=needs_cpp)]
TABLE = [5, 2, 7, 0, 3, 6]  # the sequence's shuffled blocks


def _config() -> Glm5NextTextConfig:
    config = Glm5NextTextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=Q_RANK, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=0,
        v_head_dim=V_DIM, index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM,
        index_kpool=KPOOL, index_topk=TOPK, num_hidden_layers=2, vocab_size=32, hc_mult=3,
        layer_types=["indexed_attention", "indexed_attention"], indexer_types=["full", "shared"],
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return module.eval()


def _hf_attention(layer_idx: int = 0) -> torch.nn.Module:
    """transformers' DSA layer (layer 0 full, layer 1 shared) with random weights."""
    return _randomized(glm.Glm5NextTextAttention(_config(), layer_idx), seed=layer_idx)


def _hf_forward(hf: torch.nn.Module, hidden: torch.Tensor, prev=None):  # noqa: ANN202
    """transformers' forward of `hidden (T, H)` as one sequence: `(out (T, H), selection)`."""
    mask = torch.ones(1, hidden.shape[0], dtype=torch.bool)
    with torch.no_grad():
        out, _, topk = hf(hidden[None], attention_mask=mask, prev_topk_indices=prev)
    return out[0], topk


def _layer(hf: torch.nn.Module, impl: str, full: bool = True) -> IndexedMLAAttention:
    ops = REF_OPS if impl == "ref" else cpu_kernels.make_ops()
    indexer = (
        PoolIndexer(HIDDEN, Q_RANK, INDEX_HEADS, INDEX_DIM, KPOOL, TOPK, ops) if full else None
    )
    layer = IndexedMLAAttention(
        HIDDEN, HEADS, Q_RANK, RANK, NOPE, 0, V_DIM, 1e-6, ops, indexer=indexer
    )
    layer.load_state_dict(hf.state_dict())
    layer.process_weights_after_loading()
    return layer


def _bind(layers: list[torch.nn.Module], num_blocks: int = 8) -> KVCache:
    specs = [layer.kv_spec(torch.float32) for layer in layers]
    sizing = plan_num_blocks(specs, BLOCK_SIZE, 4, 64, CPU, None, num_blocks)
    cache = KVCache(specs, sizing, CPU)
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(cache.layer(i))
    return cache


def _prefill(ctx: int, n: int) -> PagedMetadata:
    layout = StepLayout(
        decode_slots=[], prefill_lens=[n], prefill_slots=[0], prefill_context_lens=[ctx],
        block_size=BLOCK_SIZE, prefill_block_tables=[TABLE],
    )  # fmt: skip
    return build_paged_metadata(layout, CPU)


def _decode(ctx: int) -> PagedMetadata:
    layout = StepLayout(
        decode_slots=[0], prefill_lens=[], prefill_slots=[], prefill_context_lens=[],
        decode_context_lens=[ctx], block_size=BLOCK_SIZE, decode_block_tables=[TABLE],
    )  # fmt: skip
    return build_paged_metadata(layout, CPU)


def _hidden(seed: int, n: int = SEQ) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_bytes", [2**30, 0])  # prefill expanded with a mask / gathered
def test_layer_equals_transformers(impl: str, max_bytes: int) -> None:
    """Whole prefill, and chunks cut inside pools followed by decode steps, equal transformers;
    the selections drop pools (fewer selected tokens than the context)."""
    hf = _hf_attention()
    hidden = _hidden(1)
    want, _ = _hf_forward(hf, hidden)
    layer = _layer(hf, impl)
    layer.expand_max_bytes = max_bytes
    assert layer.kv_spec(torch.bfloat16) == MLASpec(
        RANK, torch.bfloat16, IndexerSpec(2 * INDEX_DIM, INDEX_DIM, KPOOL, torch.bfloat16)
    )

    _bind([layer])
    with torch.no_grad():
        whole = layer(hidden, _prefill(0, SEQ))
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    assert int((layer.selection[-1] >= 0).sum()) < SEQ  # the last query drops pools

    _bind([layer])
    outs = []
    with torch.no_grad():
        outs.append(layer(hidden[:6], _prefill(0, 6)))  # cut inside pool 1
        outs.append(layer(hidden[6:19], _prefill(6, 13)))  # and inside pool 4
        outs += [layer(hidden[t : t + 1], _decode(t)) for t in range(19, SEQ)]
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_pooled_keys_equal_transformers(impl: str) -> None:
    """The cache's pooled key of every complete pool equals transformers' pooling."""
    hf = _hf_attention()
    hidden = _hidden(2)
    layer = _layer(hf, impl)
    cache = _bind([layer])
    with torch.no_grad():
        layer(hidden[:11], _prefill(0, 11))
        for t in range(11, SEQ):
            layer(hidden[t : t + 1], _decode(t))
        index = hf.indexer
        key = index.k_norm(index.wk(hidden))[None]
        gate = torch.nn.functional.linear(hidden, index.index_kpool_compress_gate)[None]
        packed = torch.cat([key, gate, torch.ones(1, SEQ, 1)], dim=-1)
        want, _, valid = index.get_pooled_states(packed)
    view = cache.layer(0)
    pools = SEQ // KPOOL
    assert bool(valid.all()) and want.shape[1] == pools
    for j in range(pools):
        block, offset = TABLE[j * KPOOL // BLOCK_SIZE], (j * KPOOL) % BLOCK_SIZE
        got = view.pooled[block, offset // KPOOL]
        torch.testing.assert_close(got, want[0, j], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_step_equals_transformers(impl: str) -> None:
    """One step with two decode rows and two prefill chunks (one continuing a cached context)
    equals transformers per sequence."""
    hf = _hf_attention()
    seqs = [_hidden(10 + i, n) for i, n in enumerate(LENGTHS)]
    wants = [_hf_forward(hf, x)[0] for x in seqs]
    layer = _layer(hf, impl)
    _bind([layer], num_blocks=NUM_BLOCKS)
    got = run_mixed_steps(layer, seqs, BLOCK_SIZE)
    for out, want in zip(got, step_two_rows(wants)):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_shared_layer_reuses_the_selection() -> None:
    """A shared layer after a full one equals transformers' shared layer given the full layer's
    top-k; it caches latents only."""
    hf_full, hf_shared = _hf_attention(0), _hf_attention(1)
    hidden, after = _hidden(3), _hidden(4)
    _, topk = _hf_forward(hf_full, hidden)
    want, _ = _hf_forward(hf_shared, after, prev=topk)
    full, shared = _layer(hf_full, "ref"), _layer(hf_shared, "ref", full=False)
    shared.share_from(full)
    assert shared.kv_spec(torch.float32) == MLASpec(RANK, torch.float32)
    _bind([full, shared])
    with torch.no_grad():
        full(hidden[:17], _prefill(0, 17))
        outs = [shared(after[:17], _prefill(0, 17))]
        for t in range(17, SEQ):
            full(hidden[t : t + 1], _decode(t))
            outs.append(shared(after[t : t + 1], _decode(t)))
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="full indexer layer"):
        full.share_from(shared)


@pytest.mark.parametrize("impl", ["ref", "cpp"])
def test_hyper_connection_equals_transformers(impl: str) -> None:
    """Collapse and expand around a stage equal transformers' mHC arithmetic (its decoder
    layer's `post * out + comb^T @ residual`): the stage's input exactly with the reference
    ops; with the C++ ones (whose projection gives each row as alone) to float32 rounding."""
    config = _config()
    hf = _randomized(glm.Glm5NextTextHyperConnection(config), seed=7)
    ops = REF_OPS if impl == "ref" else cpu_kernels.make_ops()
    ours = HyperConnection(
        HIDDEN, 3, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps, ops
    )
    ours.load_state_dict(hf.state_dict())
    streams = torch.randn(5, 3, HIDDEN, generator=torch.Generator().manual_seed(8))
    out = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        post, comb, collapsed = hf(streams[None])
        want = post.unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams[None]
        )
        x, ctx = ours.collapse(streams)
    exact = 0 if impl == "ref" else 1e-6
    torch.testing.assert_close(x, collapsed[0], atol=exact, rtol=exact)
    torch.testing.assert_close(ours.expand(out, ctx, streams), want[0])
    sums = ctx[1].sum(dim=-1)  # rows (and columns) of the Sinkhorn mix sum to ~1
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-3, rtol=0)


def test_block_size_must_hold_whole_pools() -> None:
    layer = _layer(_hf_attention(), "ref")
    spec = layer.kv_spec(torch.float32)
    sizing = plan_num_blocks([spec], 6, 4, 64, CPU, None, 8)
    with pytest.raises(ValueError, match="block_size 6 must be a multiple"):
        KVCache([spec], sizing, CPU)


@pytest.mark.parametrize(
    ("kinds", "modes", "match"),
    [
        (["linear_attention", "indexed_attention"], ["full", "shared"], "not a full DSA layer"),
        (["indexed_attention", "indexed_attention"], ["shared", "full"], "not a full DSA layer"),
        (["indexed_attention", "full_attention"], ["full", "full"], "layer_types"),
        (["indexed_attention", "indexed_attention"], ["full", "sparse"], "indexer_types"),
    ],
)
def test_layer_schedules_are_checked(kinds: list[str], modes: list[str], match: str) -> None:
    config = types.SimpleNamespace(num_hidden_layers=2, layer_types=kinds, indexer_types=modes)
    with pytest.raises(ValueError, match=match):
        _layer_kinds(config)
