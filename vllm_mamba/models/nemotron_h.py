"""Nemotron-H (`NemotronHForCausalLM`: `nvidia/NVIDIA-Nemotron-Nano-9B-v2`, `-12B-v2`,
`nvidia/Nemotron-H-8B-Base-8K`, and the MoE `Nemotron-3-Nano-30B-A3B`).

Every layer is one mixer between a pre-norm and a residual: the `hybrid_override_pattern`
(transformers' `layers_block_type`) names each: `M` Mamba2, `*` attention (no position
embedding, no biases), `-` MLP `down(relu(up(x))^2)`, `E` MoE.

- The MoE router is DeepSeek-V3's, as transformers computes it: float32 sigmoid scores of
  `gate.weight`, chosen by score plus `gate.e_score_correction_bias` among the best
  `topk_group` of `n_group` groups (a group scored by its two best), weighted by the raw
  scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`. Experts are
  squared-ReLU MLPs (optionally in a latent space: `fc1_latent_proj`, `fc2_latent_proj`);
  `shared_experts` is added.
- The Mamba2 layers clamp the time step below at `time_step_min` in prefill and not in decode,
  as transformers does; a one-token chunk of a chunked prefill runs as a decode (as in vLLM),
  so where the clamp binds, chunked prefill may differ from whole prefill in the last digits.

Names are the checkpoints' (`backbone.embeddings`, `backbone.layers.N.norm`,
`backbone.layers.N.mixer.*`, `backbone.norm_f`, `lm_head`; transformers' `model.` prefix is
accepted too). NVIDIA-Nemotron-Nano-9B-v2: 56 layers of hidden size 4480 (4 attention with 40
query and 8 key/value heads of 128, 28 MLP of 15680, 24 Mamba2 with 128 heads of 80, 8 groups,
d_state 128, conv 4).

Glossary: T tokens in the step, H hidden size, E experts, k experts per token, F expert size,
L latent size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.communication import all_reduce
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.parallel_linear import column_linear, row_linear, vocab_embedding
from vllm_mamba.layers.self_attention import SelfAttention
from vllm_mamba.mamba_cache import LayerState, MambaCache
from vllm_mamba.models.mamba2_hybrid import Mamba2HybridForCausalLM, check_silu
from vllm_mamba.ops.table import MambaOps

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def block_types(config: Any) -> list[str]:
    """Each layer's kind: `mamba`, `attention`, `mlp` or `moe`."""
    types = getattr(config, "layers_block_type", None)
    if not types:
        pattern = getattr(config, "hybrid_override_pattern", "") or ""
        if set(pattern) - set(_PATTERN):
            raise ValueError(f"hybrid_override_pattern {pattern!r}: only M, *, - and E")
        types = [_PATTERN[c] for c in pattern]
    types = [_NAMES.get(t, t) for t in types]
    unknown = sorted(set(types) - set(_PATTERN.values()))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (mamba, attention, mlp, moe)")
    return types


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU."""
    return F.relu(x).square()


class ReLU2MLP(nn.Module):
    """`down(relu(up(x))^2)`; with tensor parallelism `up_proj` is column-parallel and
    `down_proj` row-parallel (`reduce=False`: the caller sums the ranks' parts)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        bias: bool,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.up_proj = column_linear(hidden_size, [ffn_size], bias, ops, tp)
        self.down_proj = row_linear(ffn_size, hidden_size, bias, ops, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHRouter(nn.Module):
    """`weight (E, H)` and `e_score_correction_bias (E,)`, both float32 in the checkpoints."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = float(config.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x (T, H)` -> float32 weights `(T, k)` and expert ids `(T, k)`."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        choice = scores + self.e_score_correction_bias.float()
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.n_group, num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, n_group)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()  # (T, n_group)
        keep = keep[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        chosen = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class NemotronHMoE(nn.Module):
    """Routed squared-ReLU experts (in the latent space when configured) plus shared ones."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        latent = getattr(config, "moe_latent_size", None)
        inner = latent or hidden
        self.tp = tp
        self.gate = NemotronHRouter(config)
        self.experts = nn.ModuleList(
            ReLU2MLP(inner, config.moe_intermediate_size, False, ops, tp, reduce=False)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = ReLU2MLP(
            hidden, config.moe_shared_expert_intermediate_size, bias, ops, tp
        )
        self.fc1_latent_proj = Linear(hidden, latent, bias, ops) if latent else None
        self.fc2_latent_proj = Linear(latent, hidden, bias, ops) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (T, H)` -> `(T, H)`."""
        weights, chosen = self.gate(x)  # (T, k) each
        inner = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        out = torch.zeros(inner.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(chosen).tolist():  # ascending, as transformers adds them
            token_idx, k_pos = torch.where(chosen == expert)  # (M,), (M,)
            y = self.experts[expert](inner[token_idx])
            out[token_idx] += (y * weights[token_idx, k_pos, None]).float()
        out = all_reduce(out, self.tp).to(x.dtype)  # the experts' parts, summed once
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """`x + mixer(norm(x))`, the mixer one of Mamba2, attention, MLP or MoE."""

    def __init__(self, config: Any, kind: str, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        if kind == "mamba":
            args = NemotronHForCausalLM.mamba2_args(config)
            self.mixer: nn.Module = Mamba2Mixer(**args, ops=ops, tp=tp)
        elif kind == "attention":
            head_dim = NemotronHForCausalLM.head_dim(config)
            self.mixer = SelfAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                head_dim, bias=False, scale=head_dim**-0.5, rotary=None, ops=ops, tp=tp,
            )  # fmt: skip
        elif kind == "mlp":
            self.mixer = ReLU2MLP(
                config.hidden_size, config.intermediate_size, config.mlp_bias, ops, tp
            )
        else:
            self.mixer = NemotronHMoE(config, ops, tp)

    def forward(
        self, hidden: torch.Tensor, state: LayerState | None, meta: PagedMetadata
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`; `state` is the Mamba2 layer's cache view."""
        normed = self.norm(hidden)
        if self.kind == "mamba":
            return hidden + self.mixer(normed, state, meta)
        if self.kind == "attention":
            return hidden + self.mixer(normed, meta)
        return hidden + self.mixer(normed)


class NemotronHBackbone(nn.Module):
    """Embeddings, the blocks and the final norm (`backbone.*` in the checkpoints)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embeddings = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(NemotronHBlock(config, k, ops, tp) for k in block_types(config))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class NemotronHForCausalLM(Mamba2HybridForCausalLM):
    """Nemotron-H language model: Mamba2, attention, MLP and MoE blocks by pattern."""

    supports_tensor_parallel = True

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_silu(config, "mamba_hidden_act")
        act = getattr(config, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"mlp_hidden_act {act!r} is not supported (relu2)")
        args = self.mamba2_args(config)
        if args["num_heads"] % args["n_groups"]:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")
        self.backbone = NemotronHBackbone(config, ops, tp)
        self.init_lm_head(config, ops, tp)

    def input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def tie_weights(self) -> None:
        """Never ties: transformers keeps Nemotron-H's `lm_head` apart from the embeddings even
        when the config says `tie_word_embeddings` (the checkpoints carry both)."""

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """transformers' `model.` prefix is the checkpoints' `backbone.`."""
        return "backbone." + name[len("model.") :] if name.startswith("model.") else name

    @classmethod
    def attention_layers(cls, config: Any) -> list[bool]:
        return [t == "attention" for t in block_types(config)]

    @classmethod
    def mamba_layers(cls, config: Any) -> list[bool]:
        return [t == "mamba" for t in block_types(config)]

    @classmethod
    def mamba2_args(cls, config: Any) -> dict[str, Any]:
        return dict(
            hidden_size=config.hidden_size,
            num_heads=config.mamba_num_heads,
            head_dim=config.mamba_head_dim,
            n_groups=config.n_groups,
            state_size=config.ssm_state_size,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            time_step_limit=(float(config.time_step_min), float("inf")),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            norm_eps=config.layer_norm_epsilon,
        )

    def forward(
        self, input_ids: torch.Tensor, cache: MambaCache, meta: PagedMetadata
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`."""
        hidden = self.backbone.embeddings(input_ids)  # (T, H)
        for layer, index in zip(self.backbone.layers, self.state_index):
            hidden = layer(hidden, None if index is None else cache.layer(index), meta)
        return self.backbone.norm_f(hidden)
