"""The multi-token prediction head (`vllm_mamba.models.mtp`) of Qwen3.5 (dense and MoE) and
Qwen3-Next, loaded through the engine's loader, against a pure-PyTorch reference written from
vLLM's `Qwen3NextMultiTokenPredictor` / `Qwen3_5MultiTokenPredictor`:

    out = norm(layer(fc(cat([pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)]))))
    logits = lm_head(out)

with the layer's gated attention dense and causal over each whole sequence at the target's
positions (no paged cache). The head runs over the paged KV cache: a prefill of several rows,
then chunks and single-token rows that read the keys and values written before, one of them a
chained draft (its hidden the head's previous output). Also: the head is built only when asked
for (otherwise `mtp.*` is skipped), and asking a model, config or checkpoint without one is a
`ValueError` that says what is missing.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.helpers.mtp_checkpoints import VARIANTS, save_tiny_with_mtp
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import build_paged_metadata
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.kv_cache import KVCache, plan_num_blocks
from vllm_mamba.layers.cache_layers import kv_cache_layers
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models.mtp import MultiTokenPredictor

CPU = torch.device("cpu")
FAMILIES = sorted(VARIANTS)
BLOCK_SIZE = 4
TABLES = {"a": [3, 0, 5], "b": [1, 6, 2]}  # shuffled blocks of the two sequences
LENGTHS = {"a": 7, "b": 6}  # MTP rows of each sequence


def _checkpoint(family: str) -> str:
    return save_tiny_with_mtp(family, make_tmp_dir(f"tiny-{family}-mtp-"))


def _zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def _rope(x: torch.Tensor, positions: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """NeoX-style RoPE on the first `rot` dims of each head of `x (T, heads, D)`."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = (positions[:, None].double() * inv_freq[None]).float()  # (T, rot / 2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


class Reference:
    """The MTP head from the checkpoint's tensors, one whole sequence at a time."""

    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            self.cfg = json.load(f)
        self.t = load_file(os.path.join(path, "model.safetensors"))
        self.embed = self.t["model.embed_tokens.weight"]
        self.head = self.t.get("lm_head.weight", self.embed)
        self.eps = self.cfg["rms_norm_eps"]

    def _w(self, name: str) -> torch.Tensor:
        return self.t["mtp." + name]

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.cfg, x.shape[0]
        heads, kv_heads, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        rope = c["rope_parameters"]
        rot, base = int(dim * rope["partial_rotary_factor"]), rope["rope_theta"]
        qg = (x @ self._w("layers.0.self_attn.q_proj.weight").T).view(n, heads, 2 * dim)
        q, gate = qg[..., :dim], qg[..., dim:].reshape(n, heads * dim)
        k = (x @ self._w("layers.0.self_attn.k_proj.weight").T).view(n, kv_heads, dim)
        v = (x @ self._w("layers.0.self_attn.v_proj.weight").T).view(n, kv_heads, dim)
        q = _zc_norm(q, self._w("layers.0.self_attn.q_norm.weight"), self.eps)
        k = _zc_norm(k, self._w("layers.0.self_attn.k_norm.weight"), self.eps)
        positions = torch.arange(n)
        q, k = _rope(q, positions, rot, base), _rope(k, positions, rot, base)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
        out = out * torch.sigmoid(gate)
        return out @ self._w("layers.0.self_attn.o_proj.weight").T

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = x @ self._w(prefix + "gate_proj.weight").T
        up = x @ self._w(prefix + "up_proj.weight").T
        return (F.silu(gate) * up) @ self._w(prefix + "down_proj.weight").T

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        fused = self.t.get("mtp.layers.0.mlp.experts.gate_up_proj")
        if fused is None:
            return self._mlp(x, f"layers.0.mlp.experts.{e}.")
        gate_w, up_w = fused[e].chunk(2, dim=0)  # (F, H) each: gate rows first
        down_w = self.t["mtp.layers.0.mlp.experts.down_proj"][e]  # (H, F)
        return (F.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        if "mtp.layers.0.mlp.gate.weight" not in self.t:
            return self._mlp(x, "layers.0.mlp.")
        c = self.cfg
        probs = (x @ self._w("layers.0.mlp.gate.weight").T).float().softmax(-1)
        weights, chosen = probs.topk(c["num_experts_per_tok"], dim=-1)
        if c.get("norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for row in range(x.shape[0]):
            for w, e in zip(weights[row], chosen[row]):
                out[row] += w * self._expert(x[row : row + 1], int(e))[0]
        shared = self._mlp(x, "layers.0.mlp.shared_expert.")
        return out + shared * torch.sigmoid(x @ self._w("layers.0.mlp.shared_expert_gate.weight").T)

    def __call__(
        self, hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden (n, H)` and the following tokens `(n,)` of one whole sequence -> the head's
        output `(n, H)` and logits `(n, V)`."""
        e = _zc_norm(self.embed[next_ids], self._w("pre_fc_norm_embedding.weight"), self.eps)
        h = _zc_norm(hidden, self._w("pre_fc_norm_hidden.weight"), self.eps)
        x = torch.cat([e, h], -1) @ self._w("fc.weight").T
        normed = _zc_norm(x, self._w("layers.0.input_layernorm.weight"), self.eps)
        x = x + self._attention(normed)
        normed = _zc_norm(x, self._w("layers.0.post_attention_layernorm.weight"), self.eps)
        x = x + self._ffn(normed)
        out = _zc_norm(x, self._w("norm.weight"), self.eps)
        return out, out @ self.head.T


def _load(path: str, mtp: bool = True) -> torch.nn.Module:
    model, _ = build_model(path, load_hf_config(path), torch.float32, CPU, mtp=mtp)
    return model


def _bind_kv(model: torch.nn.Module) -> KVCache:
    specs = [layer.kv_spec(torch.float32) for layer in kv_cache_layers(model)]
    sizing = plan_num_blocks(specs, BLOCK_SIZE, 2, 64, CPU, None, 8)
    cache = KVCache(specs, sizing, CPU)
    cache.bind(model)
    return cache


def _step(decodes: list[tuple[str, int]], prefills: list[tuple[str, int, int]]):  # noqa: ANN202
    """Metadata of decode rows `(seq, position)` then prefill chunks `(seq, start, rows)`."""
    layout = StepLayout(
        decode_slots=list(range(len(decodes))),
        prefill_lens=[n for _, _, n in prefills],
        prefill_slots=list(range(len(decodes), len(decodes) + len(prefills))),
        prefill_context_lens=[start for _, start, _ in prefills],
        decode_context_lens=[pos for _, pos in decodes],
        block_size=BLOCK_SIZE,
        decode_block_tables=[TABLES[s] for s, _ in decodes],
        prefill_block_tables=[TABLES[s] for s, _, _ in prefills],
    )
    return build_paged_metadata(layout, CPU)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_matches_reference_over_the_paged_cache(family: str) -> None:
    path = _checkpoint(family)
    model = _load(path)
    head = model.mtp
    assert isinstance(head, MultiTokenPredictor)
    assert torch.equal(
        head.fc.weight, load_file(os.path.join(path, "model.safetensors"))["mtp.fc.weight"]
    )
    attention = kv_cache_layers(model)
    assert attention[-1] is kv_cache_layers(head)[0]  # the engine's KV cache binds it last
    _bind_kv(model)

    g = torch.Generator().manual_seed(7)
    vocab, hidden_size = model.config.vocab_size, model.config.hidden_size
    tokens = {s: torch.randint(0, vocab, (n + 1,), generator=g) for s, n in LENGTHS.items()}
    hidden = {s: torch.randn(n, hidden_size, generator=g) for s, n in LENGTHS.items()}
    got: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {"a": {}, "b": {}}

    def run(decodes: list[tuple[str, int]], prefills: list[tuple[str, int, int]]) -> None:
        rows = [(s, p) for s, p in decodes] + [
            (s, p) for s, start, n in prefills for p in range(start, start + n)
        ]
        h = torch.stack([hidden[s][p] for s, p in rows])
        ids = torch.stack([tokens[s][p + 1] for s, p in rows])
        with torch.no_grad():
            out = head(h, ids, _step(decodes, prefills))
            logits = head.compute_logits(out)
        assert out.shape == (len(rows), hidden_size) and logits.dtype == torch.float32
        for i, (s, p) in enumerate(rows):
            got[s][p] = (out[i], logits[i])

    run([], [("a", 0, 5), ("b", 0, 3)])  # two prompts
    run([("a", 5)], [("b", 3, 2)])  # a decode row beside a second chunk
    hidden["a"][6] = got["a"][5][0]  # a chained draft: the head's output is the next hidden
    run([("a", 6), ("b", 5)], [])  # single-token rows reading the cache

    ref = Reference(path)
    for s, n in LENGTHS.items():
        want_out, want_logits = ref(hidden[s], tokens[s][1:])
        got_out = torch.stack([got[s][p][0] for p in range(n)])
        got_logits = torch.stack([got[s][p][1] for p in range(n)])
        torch.testing.assert_close(got_out, want_out, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got_logits, want_logits, atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_not_built_unless_asked(family: str) -> None:
    path = _checkpoint(family)
    model = _load(path, mtp=False)
    assert getattr(model, "mtp", None) is None
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())
    assert "mtp." in model.skipped_weights
    layer_types = model.config.layer_types
    assert len(kv_cache_layers(model)) == layer_types.count("full_attention")
    assert type(model).supports_mtp


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_tensor_parallel_ranks_load_their_shard(family: str) -> None:
    """Each of 2 ranks holds half the head's attention heads and expert rows; `fc` whole."""
    path = _checkpoint(family)
    full = _load(path).mtp
    for rank in range(2):
        config = load_hf_config(path)
        model, _ = build_model(path, config, torch.float32, CPU, TensorParallel(rank, 2), mtp=True)
        head = model.mtp
        assert torch.equal(head.fc.weight, full.fc.weight)
        q_rows = full.layers[0].self_attn.q_proj.weight.shape[0]
        assert head.layers[0].self_attn.q_proj.weight.shape[0] == q_rows // 2
        expert, whole = head.layers[0].mlp.experts[1].down_proj, full.layers[0].mlp.experts[1]
        inter = whole.down_proj.weight.shape[1] // 2
        part = whole.down_proj.weight[:, rank * inter : (rank + 1) * inter]
        assert torch.equal(expert.weight, part)


def test_model_without_head_class_is_refused() -> None:
    with pytest.raises(ValueError, match="mtp.*no multi-token prediction head"):
        _load(tiny_model_dir("tied"))  # Mamba


def test_config_without_mtp_layers_is_refused() -> None:
    # The plain tiny Qwen3.5 config names no mtp_num_hidden_layers.
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is None"):
        _load(tiny_model_dir("qwen3_5-gqa"))
    path = _checkpoint("qwen3_next")
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 0
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is 0"):
        _load(path)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_checkpoint_without_mtp_tensors_is_refused(family: str) -> None:
    path = _checkpoint(family)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    del tensors["mtp.fc.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="multi-token prediction head.*mtp.fc.weight"):
        _load(path)
    if family == "qwen3_next":  # no mtp_num_hidden_layers: one layer assumed, no tensors
        with pytest.raises(ValueError, match="missing tensors: mtp.fc.weight, mtp.layers.0"):
            _load(tiny_model_dir(VARIANTS[family]))
