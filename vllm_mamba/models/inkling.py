"""Inkling (`InklingForCausalLM`: the language model of `thinkingmachines/Inkling`).

Attention layers of two kinds by `layer_types` (`hybrid_sliding` / `hybrid`; by default every
sixth layer is full), each with four short convs (`layers.residual_short_conv`, `(x +
conv(x))` of width `conv_kernel_size`, float32, each with its own per-sequence history):

    a = self_attn(input_layernorm(h))
    h = h + attn_sconv(a)
    h = h + mlp_sconv(mlp(post_attention_layernorm(h)))

- Embeddings: `embed_tokens` followed by its own RMSNorm (`embed_tokens.embed_norm`); no
  position embedding anywhere. The final norm is `norm`; the hidden states are divided by
  `logits_mup_width_multiplier` before the head `lm_head` (never tied), and the logits of the
  rows past `unpadded_vocab_size` (a head padded to `vocab_size`) are dropped: this engine
  keeps them at -inf, so they are never sampled and the logprobs are those of the real rows.
- Attention (`self_attn.*`): `q_proj`; `k_proj` and `v_proj` each through a short conv
  (`k_sconv`, `v_sconv`) before the cache; RMSNorms per head of the queries and the convolved
  keys (`q_norm`, `k_norm`); GQA, softmax scale `1 / D` (q and k are normed); a bias
  conditioned on the query token: `rel = r_proj(x)` per head `(d_rel,)` times
  `rel_logits_proj.proj (d_rel, E)` gives one bias per backward distance `< E`
  (`layers.relative_bias_attention`). Sliding layers (`swa_*` heads and head dim) read the
  last `sliding_window_size` keys and their bias extent E is that window; full layers read
  every key with E = `rel_extent`, and past `log_scaling_n_floor` their queries and biases
  are scaled by `tau = 1 + log_scaling_alpha * log((p + 1) / n_floor)` at position p.
- Feed-forward (`mlp.*`) by `mlp_layer_types`: `dense`, a SwiGLU of `intermediate_size` times
  its learned `global_scale`, or `sparse`, the MoE whose router also weighs the shared
  experts (`layers.shared_sink_moe`; transformers always routes so, whatever
  `shared_expert_sink` says). Activation `hidden_act`.

Checkpoint names are transformers' `InklingForCausalLM` names (`save_pretrained`): the stacked
experts `mlp.experts.gate_up_proj (E, 2F, H)` / `down_proj (E, H, F)` and shared experts
`mlp.shared_experts.{gate,up,down}_proj (S, ...)` are split one by one (`expand_weight`); the
multi-token prediction layers (`model.mtp.*`) are skipped.

The release (`InklingForConditionalGeneration`, `thinkingmachines/Inkling`) is served text-only
from its `text_config`: its audio and vision towers (`model.audio.*`, `model.visual.*`) are
skipped, and its own names are mapped (`InklingForConditionalGeneration.remap_weight_name`):
`model.llm.*` with `embed`, `embed_norm`, `unembed`, `attn.wq_du` / `wk_dv` / `wv_dv` /
`wr_du` / `wo_ud`, `attn_norm`, `mlp_norm`, `mlp.gate.bias`, and the gate and up rows
interleaved in one tensor: the experts' `w13_weight (E, 2F, H)`, the shared experts'
`shared_w13_weight (S, 2F, H)` and a dense layer's `w13_dn (2F, H)` (even rows gate, odd up).

Tensor parallelism (`tp`): attention by heads (queries, relative states and the key/value
convs' channels with their heads), every MLP and expert column- then row-parallel; the router,
the convs over the hidden state and the bias tables replicated; vocabulary-parallel embedding
and head.

Glossary: T tokens in the step, H hidden size, Hq / Hkv query / key-value heads, D head dim,
E bias extent, F expert width, S shared experts.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.relative_bias_attention import RelativeLogits, log_scale
from vllm_mamba.layers.residual_short_conv import ResidualShortConv
from vllm_mamba.layers.shared_sink_moe import SharedSinkMoE
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.qwen3_5 import Qwen3_5ForCausalLM
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
KINDS = ("hybrid_sliding", "hybrid")
_SHARED = ("gate_proj", "up_proj", "down_proj")  # the shared experts' stacked tensors
_RELEASE = (  # the release's names -> transformers' text model's, in order (module docstring)
    (r"^model\.llm\.unembed\.", "lm_head."),
    (r"^model\.llm\.embed\.", "model.embed_tokens."),
    (r"^model\.llm\.embed_norm\.", "model.embed_tokens.embed_norm."),
    (r"^model\.llm\.", "model."),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj."),
    (r"\.attn\.w([kvr])_d[uv]\.", r".self_attn.\1_proj."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj."),
    (r"\.attn\.([kv])_sconv\.weight$", r".self_attn.\1_sconv.conv1d.weight"),
    (r"\.attn\.", ".self_attn."),  # q_norm, k_norm, rel_logits_proj
    (r"\.(attn|mlp)_sconv\.weight$", r".\1_sconv.conv1d.weight"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.mlp\.w2_md\.", ".mlp.down_proj."),
)
_INTERLEAVED = {  # the release's gate/up tensors: (name suffix, dim, the gate's and up's names)
    ".mlp.experts.w13_weight": (1, "mlp.experts.gate_up_proj", None),
    ".mlp.shared_experts.shared_w13_weight": (
        1,
        "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.up_proj",
    ),
    ".mlp.w13_dn.weight": (0, "mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ".mlp.experts.w2_weight": (None, "mlp.experts.down_proj", None),
    ".mlp.shared_experts.shared_w2_weight": (None, "mlp.shared_experts.down_proj", None),
}


class InklingAttention(nn.Module):
    """Queries, convolved keys and values, the relative bias and the paged attention of one
    layer (see the module docstring)."""

    def __init__(self, config: Any, sliding: bool, ops: MambaOps, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        prefix = "swa_" if sliding else ""
        heads = getattr(config, f"{prefix}num_attention_heads")
        kv_heads = getattr(config, f"{prefix}num_key_value_heads")
        head_dim = self.head_dim = getattr(config, f"{prefix}head_dim")
        extent = config.sliding_window_size if sliding else config.rel_extent
        kv_ranges, local_kv = kv_head_ranges(kv_heads, head_dim, tp)
        kv_size, kernel = kv_heads * head_dim, config.conv_kernel_size
        conv_ranges = None if tp.size == 1 else kv_ranges or [tp.range(kv_size, "kv channels")]
        self.q_proj = column_linear(hidden, [heads * head_dim], False, ops, tp)
        self.k_proj = column_linear(hidden, [kv_size], False, ops, tp, kv_ranges)
        self.v_proj = column_linear(hidden, [kv_size], False, ops, tp, kv_ranges)
        self.r_proj = column_linear(hidden, [heads * config.d_rel], False, ops, tp)
        self.o_proj = row_linear(heads * head_dim, hidden, False, ops, tp)
        self.k_sconv = ResidualShortConv(kv_size, kernel, ops, ranges=conv_ranges)
        self.v_sconv = ResidualShortConv(kv_size, kernel, ops, ranges=conv_ranges)
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.rel_logits_proj = RelativeLogits(config.d_rel, extent)
        self.attn = PagedAttention(
            tp.split(heads, "num_attention_heads"), local_kv, head_dim, 1.0 / head_dim, ops,
            config.sliding_window_size if sliding else None,
        )  # fmt: skip
        floor = None if sliding else config.log_scaling_n_floor
        self.log_scaling = None if floor is None else (int(floor), float(config.log_scaling_alpha))

    def forward(self, x: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`; the key/value histories and the cache advanced."""
        num_tokens, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(num_tokens, -1, d))  # (T, Hq, D)
        k = self.k_norm(self.k_sconv(self.k_proj(x), meta).view(num_tokens, -1, d))
        v = self.v_sconv(self.v_proj(x), meta).view(num_tokens, -1, d)  # (T, Hkv, D)
        rel_states = self.r_proj(x).view(num_tokens, q.shape[1], -1)  # (T, Hq, d_rel)
        rel = self.rel_logits_proj(rel_states)  # (T, Hq, E)
        if self.log_scaling is not None:
            tau = log_scale(meta.positions, *self.log_scaling)[:, None, None]  # (T, 1, 1)
            q, rel = (q.float() * tau).to(q.dtype), (rel.float() * tau).to(rel.dtype)
        return self.o_proj(self.attn(q, k, v, meta, rel=rel))


class ScaledGatedMLP(GatedMLP):
    """A SwiGLU times its learned scalar `global_scale (1,)`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.global_scale = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        return super().forward(x) * self.global_scale


class InklingDecoderLayer(nn.Module):
    """Norm, attention, its short conv, residual; norm, MLP or MoE, its short conv,
    residual."""

    def __init__(
        self, config: Any, sliding: bool, sparse: bool, ops: MambaOps, tp: TensorParallel
    ) -> None:
        super().__init__()
        hidden, eps, act = config.hidden_size, config.rms_norm_eps, config.hidden_act
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = InklingAttention(config, sliding, ops, tp)
        self.attn_sconv = ResidualShortConv(hidden, config.conv_kernel_size, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if sparse:
            self.mlp: nn.Module = SharedSinkMoE(
                hidden, config.n_routed_experts, config.n_shared_experts,
                config.num_experts_per_tok, config.moe_intermediate_size, config.route_scale,
                ops, tp, act,
            )  # fmt: skip
        else:
            self.mlp = ScaledGatedMLP(hidden, config.intermediate_size, False, ops, tp, act=act)
        self.mlp_sconv = ResidualShortConv(hidden, config.conv_kernel_size, ops)

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        mixed = self.self_attn(self.input_layernorm(hidden), meta)
        hidden = hidden + self.attn_sconv(mixed, meta)
        fed = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_sconv(fed, meta)


def mlp_kinds(config: Any) -> list[str]:
    """Each layer's feed-forward kind, `dense` or `sparse` (`mlp_layer_types`)."""
    kinds = list(config.mlp_layer_types)
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ValueError(
            f"mlp_layer_types must name {config.num_hidden_layers} layers, each 'dense' or "
            f"'sparse'; got {kinds}"
        )
    return kinds


class InklingForCausalLM(CausalLM):
    """Inkling's language model (see the module docstring)."""

    ties_word_embeddings: ClassVar[bool] = False
    skipped_weights: ClassVar[dict[str, str]] = {"model.mtp.": "the multi-token prediction layers"}

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        layers = [
            InklingDecoderLayer(config, kind == "hybrid_sliding", mlp == "sparse", ops, tp)
            for kind, mlp in zip(layer_types(config, KINDS), mlp_kinds(config))
        ]
        super().__init__(config, ops, tp, names=NAMES, layers=layers, norm_eps=config.rms_norm_eps)
        self.stack.token_embedding.add_module(
            "embed_norm", RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        )
        self.logits_divisor = float(config.logits_mup_width_multiplier)
        self.real_vocab = min(config.unpadded_vocab_size or config.vocab_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)` from their normed embeddings; returns the
        normed hidden states `(T, H)`."""
        embedding = self.stack.token_embedding
        hidden = embedding.embed_norm(embedding(input_ids))  # (T, H)
        for layer in self.stack.layers:
            hidden = layer(hidden, meta)
        return self.stack.last_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` divided by the muP width multiplier -> float32 logits `(R, V)`."""
        return super().compute_logits(hidden / self.logits_divisor)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The padded head's rows past the real vocabulary at -inf (float32 `(R, V)`)."""
        if self.real_vocab < logits.shape[-1]:
            logits[:, self.real_vocab :] = -math.inf
        return logits

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The stacked routed experts (Qwen3.5's layout) and shared experts `(S, out, in)` one
        by one."""
        base, _, kind = name.rpartition(".")
        if not base.endswith(".mlp.shared_experts") or kind not in _SHARED:
            return Qwen3_5ForCausalLM.expand_weight(name, tensor)
        return [(f"{base}.{s}.{kind}.weight", w) for s, w in enumerate(tensor[...])]


class InklingForConditionalGeneration(InklingForCausalLM):
    """The released image-text checkpoint served text-only: its `text_config`, the release's
    names (see the module docstring)."""

    skipped_weights: ClassVar[dict[str, str]] = {
        "model.visual.": "the vision tower (served text-only)",
        "model.audio.": "the audio tower (served text-only)",
        "model.mtp.": "the multi-token prediction layers",
    }

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config.text_config, ops, tp)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The release's names onto transformers' text model's."""
        for pattern, new in _RELEASE:
            name = re.sub(pattern, new, name)
        return name

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The interleaved gate/up tensors split (even rows gate, odd up), then the stacked
        experts one by one as the text model's."""
        suffix = next((s for s in _INTERLEAVED if name.endswith(s)), None)
        if suffix is None:
            return [(name, tensor)]
        dim, gate, up = _INTERLEAVED[suffix]
        head = name[: -len(suffix) + 1]  # "....layers.i."
        whole = tensor[...]
        if dim is None:  # a down projection: renamed only
            parts = [(head + gate, whole)]
        elif up is None:  # routed experts: transformers' gate-then-up halves
            rows = whole.unflatten(dim, (-1, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1)
            parts = [(head + gate, rows)]
        else:
            even, odd = whole.unflatten(dim, (-1, 2)).unbind(dim + 1)
            parts = [(head + gate, even), (head + up, odd)]
        return [pair for n, t in parts for pair in InklingForCausalLM.expand_weight(n, t)]
