"""Jamba (`JambaForCausalLM`: `ai21labs/Jamba-v0.1`, `Jamba-tiny-dev`, Jamba 1.5 / 1.7 Mini).

A hybrid: layer `i` is an attention layer when `i % attn_layer_period == attn_layer_offset`,
else a Mamba layer; its feed-forward is a sparse mixture of experts when
`i % expert_layer_period == expert_layer_offset` (and `num_experts > 1`), else a dense gated
MLP. Each layer is pre-norm twice (`input_layernorm` before the mixer, `pre_ff_layernorm`
before the feed-forward), with plain residuals.

- Mamba layers are Mamba's selective-SSM mixer whose time step, B and C are RMS-normalised
  with weights (`dt_layernorm`, `b_layernorm`, `c_layernorm`, epsilon `rms_norm_eps`) before
  the time-step projection and the scan; their state lives in `mamba_cache`.
- Attention layers have no rotary embedding and no biases; GQA with `num_key_value_heads`,
  softmax scale `head_dim ** -0.5`; their keys and values live in the paged KV cache.
- The router is transformers': softmax over the expert logits in float32, top-k of those
  probabilities, not renormalised.

Names are the Hugging Face checkpoints' (`model.embed_tokens`, `model.layers.N.mamba.*`,
`model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.feed_forward.router`,
`model.layers.N.feed_forward.experts.E.{gate,up,down}_proj`, `model.final_layernorm`,
`lm_head`), so loading (sharded safetensors) is an identity mapping. The released checkpoints
all have this layout: Jamba-v0.1 and Jamba 1.5 / 1.7 Mini are 32 layers of hidden size 4096
(attention period 8 offset 4, 16 experts top-2 every other layer from layer 1, 32 query and
8 key/value heads, Mamba d_state 16, d_conv 4, expand 2, dt rank 256); Jamba-tiny-dev is a
small model of the same layout.

Tensor parallelism (`tp`): the Mamba mixers by channels (the dt/B/C norms act on the
all-reduced `x_proj` output, so they are replicated), attention by heads, the MLPs' `gate_proj`
and `up_proj` column-parallel and `down_proj` row-parallel (the experts' parts all-reduced
once per MoE layer; the router is replicated), vocabulary-parallel embedding and head.

Glossary: T tokens in the step, H hidden size, F feed-forward size, E experts, k experts per
token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.kv_cache import AttentionSpec, LayerCacheSpec, MambaSpec
from vllm_mamba.layers.attention import PagedAttention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mamba_mixer import MambaMixer
from vllm_mamba.layers.mixer_sharding import kv_head_ranges
from vllm_mamba.layers.parallel_linear import column_linear, lm_head, row_linear, vocab_embedding
from vllm_mamba.mamba_cache import LayerState, MambaCache, MambaStateShape
from vllm_mamba.ops.table import MambaOps


def is_attention_layer(config: Any, index: int) -> bool:
    """Layer `index` is attention (else Mamba)."""
    return index % config.attn_layer_period == config.attn_layer_offset


def is_expert_layer(config: Any, index: int) -> bool:
    """Layer `index` has a sparse MoE feed-forward (else a dense MLP)."""
    return config.num_experts > 1 and index % config.expert_layer_period == (
        config.expert_layer_offset
    )


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class JambaMambaMixer(MambaMixer):
    """Mamba's mixer with weighted RMS norms on the time step, B and C."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(
            hidden_size=config.hidden_size,
            intermediate_size=config.mamba_expand * config.hidden_size,
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            time_step_rank=int(config.mamba_dt_rank),
            use_bias=config.mamba_proj_bias,
            use_conv_bias=config.mamba_conv_bias,
            ops=ops,
            tp=tp,
        )
        eps = config.rms_norm_eps
        self.dt_layernorm = RMSNorm(self.time_step_rank, eps=eps)
        self.b_layernorm = RMSNorm(self.state_size, eps=eps)
        self.c_layernorm = RMSNorm(self.state_size, eps=eps)

    def _ssm_params(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`xc (T, I)` -> dt `(T, I)` (before its bias), B `(T, N)`, C `(T, N)`, normalised."""
        sizes = [self.time_step_rank, self.state_size, self.state_size]
        ts, B, C = self.x_proj(xc).split(sizes, dim=-1)  # (T, R), (T, N), (T, N)
        ts, B, C = self.dt_layernorm(ts), self.b_layernorm(B), self.c_layernorm(C)
        dt = self.ops.linear(ts, self.dt_proj.weight, None)  # (T, I), bias added in the scan
        return dt, B, C


class JambaAttention(nn.Module):
    """GQA attention without rotary or biases over the paged KV cache."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, heads, kv_heads = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        head_dim = _head_dim(config)
        kv_ranges, local_kv = kv_head_ranges(kv_heads, head_dim, tp)
        kv_size = [kv_heads * head_dim]
        self.q_proj = column_linear(hidden, [heads * head_dim], False, ops, tp)
        self.k_proj = column_linear(hidden, kv_size, False, ops, tp, kv_ranges)
        self.v_proj = column_linear(hidden, kv_size, False, ops, tp, kv_ranges)
        self.o_proj = row_linear(heads * head_dim, hidden, False, ops, tp)
        local = tp.split(heads, "num_attention_heads")
        self.attn = PagedAttention(local, local_kv, head_dim, head_dim**-0.5, ops)

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        out = self.attn(self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden), meta)
        return self.o_proj(out)


class JambaMLP(nn.Module):
    """Dense gated MLP: `down(silu(gate(x)) * up(x))` (`reduce=False`: with tensor
    parallelism the caller sums the ranks' parts)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.gate_proj = column_linear(hidden_size, [ffn_size], False, ops, tp)
        self.up_proj = column_linear(hidden_size, [ffn_size], False, ops, tp)
        self.down_proj = row_linear(ffn_size, hidden_size, False, ops, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class JambaRouter(nn.Module):
    """Expert logits `x @ weight^T`; the checkpoint's `router.weight (E, H)`."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class JambaSparseMoe(nn.Module):
    """Top-k of `num_experts` gated MLPs per token, weighted by the router's probabilities."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.tp = tp
        self.router = JambaRouter(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(
            JambaMLP(config.hidden_size, config.intermediate_size, ops, tp, reduce=False)
            for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`: each token's chosen experts, summed by weight."""
        logits = F.linear(x, self.router.weight)  # (T, E)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, k) each
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():  # ascending, as transformers adds them
            token_idx, k_pos = torch.where(chosen == expert)  # (M,), (M,): tokens are distinct
            out[token_idx] += self.experts[expert](x[token_idx]) * weights[token_idx, k_pos, None]
        return all_reduce(out, self.tp)


class JambaLayer(nn.Module):
    """One decoder layer: norm, mixer (`mamba` or `self_attn`), residual; norm, feed-forward,
    residual."""

    def __init__(self, config: Any, index: int, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.is_attention = is_attention_layer(config, index)
        if self.is_attention:
            self.self_attn = JambaAttention(config, ops, tp)
        else:
            self.mamba = JambaMambaMixer(config, ops, tp)
        if is_expert_layer(config, index):
            self.feed_forward: nn.Module = JambaSparseMoe(config, ops, tp)
        else:
            self.feed_forward = JambaMLP(config.hidden_size, config.intermediate_size, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, state: LayerState | None, meta: PagedMetadata
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; `state` is the Mamba layer's cache view."""
        normed = self.input_layernorm(hidden)
        if self.is_attention:
            mixed = self.self_attn(normed, meta)
        else:
            mixed = self.mamba(normed, state, meta)
        hidden = hidden + mixed
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class JambaModel(nn.Module):
    """Embeddings, the layers and the final norm (`model.*` in the checkpoints)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            JambaLayer(config, i, ops, tp) for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class JambaForCausalLM(nn.Module):
    """Jamba language model: Mamba and attention layers, a state slot and KV blocks each."""

    is_attention_free = False
    supports_tensor_parallel = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; the kernels apply SiLU")
        self.config = config
        self.model = JambaModel(config, ops, tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, ops, tp)
        # Per layer, its index in mamba_cache (None for attention layers).
        mamba_index = iter(range(config.num_hidden_layers))
        self.state_index = [
            None if layer.is_attention else next(mamba_index) for layer in self.model.layers
        ]
        self.tie_weights()

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def get_cache_specs(config: Any, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """One spec per layer: KV blocks for attention layers, a state slot for Mamba's."""
        attn = AttentionSpec(config.num_key_value_heads, _head_dim(config), dtype)
        return [
            attn if is_attention_layer(config, i) else MambaSpec()
            for i in range(config.num_hidden_layers)
        ]

    @staticmethod
    def get_mamba_state_shape(config: Any, dtype: torch.dtype) -> MambaStateShape:
        """Per-slot state of the Mamba layers: conv `(I, K - 1)`, ssm `(I, N)` in float32."""
        intermediate = config.mamba_expand * config.hidden_size
        num_mamba = sum(not is_attention_layer(config, i) for i in range(config.num_hidden_layers))
        return MambaStateShape(
            num_layers=num_mamba,
            conv_shape=(intermediate, config.mamba_d_conv - 1),
            ssm_shape=(intermediate, config.mamba_d_state),
            conv_dtype=dtype,
            ssm_dtype=torch.float32,
        )

    def process_weights_after_loading(self) -> None:
        """Lets each Mamba mixer precompute its derived tensors."""
        for layer in self.model.layers:
            if not layer.is_attention:
                layer.mamba.process_weights_after_loading()

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: PagedMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.model.embed_tokens(input_ids)  # (T, H)
        for layer, index in zip(self.model.layers, self.state_index):
            state = None if index is None else cache.layer(index)
            hidden = layer(hidden, state, meta)
        return self.model.final_layernorm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`."""
        return self.lm_head(hidden.to(self.lm_head.compute_dtype)).float()
