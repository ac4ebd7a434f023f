"""What the Mamba2-based hybrids share (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1): the cache
spec of each layer, the per-slot Mamba2 state, the map from layer to `mamba_cache` layer, and
the LM head.

A subclass says which layers mix with Mamba2 (`mamba_layers`: one bool per layer; attention
or a feed-forward-only layer otherwise) and with attention (`attention_layers`), how its config
names the Mamba2 shapes (`mamba2_args`), and builds its modules; `Mamba2HybridForCausalLM`
gives the engine what it asks of every model. Attention layers hold KV blocks, Mamba2 layers a
state slot (conv `(CD, K - 1)` in the model dtype, ssm `(NH, P, N)` in float32).

Glossary: T tokens in the step, H hidden size, V vocabulary, CD conv channels, K conv width,
NH Mamba2 heads, P head dim, N state size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.kv_cache import AttentionSpec, LayerCacheSpec, MambaSpec
from vllm_mamba.layers.mamba2_mixer import Mamba2Mixer
from vllm_mamba.layers.parallel_linear import lm_head
from vllm_mamba.mamba_cache import MambaStateShape
from vllm_mamba.ops.table import MambaOps


def mamba2_args_from_mamba_prefix(config: Any) -> dict[str, Any]:
    """`Mamba2Mixer` arguments from the `mamba_*` config names (Bamba, Granite 4.0-H)."""
    limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        n_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        time_step_limit=tuple(limit),
        use_bias=config.mamba_proj_bias,
        use_conv_bias=config.mamba_conv_bias,
        norm_eps=config.rms_norm_eps,
    )


def check_mamba2_args(args: dict[str, Any], intermediate: int) -> None:
    """Raises ValueError when the Mamba2 shapes do not fit together."""
    if args["num_heads"] * args["head_dim"] != intermediate:
        raise ValueError(
            f"Mamba2 heads ({args['num_heads']}) x head dim ({args['head_dim']}) must equal the "
            f"Mamba intermediate size ({intermediate})"
        )
    if args["num_heads"] % args["n_groups"]:
        raise ValueError(
            f"Mamba2 heads ({args['num_heads']}) must be a multiple of its groups "
            f"({args['n_groups']})"
        )


def check_silu(config: Any, key: str = "hidden_act") -> None:
    """Raises ValueError when the conv activation is not SiLU (the kernels apply SiLU)."""
    act = getattr(config, key, "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{key} {act!r} is not supported; the Mamba2 kernels apply SiLU")


class Mamba2HybridForCausalLM(nn.Module):
    """Base of the Mamba2 hybrids; subclasses build `self.model` and list their layers."""

    is_attention_free = False

    @classmethod
    def mamba_layers(cls, config: Any) -> list[bool]:
        """One bool per layer: that layer has a Mamba2 mixer."""
        raise NotImplementedError

    @classmethod
    def attention_layers(cls, config: Any) -> list[bool]:
        """One bool per layer: that layer has an attention mixer."""
        raise NotImplementedError

    @classmethod
    def mamba2_args(cls, config: Any) -> dict[str, Any]:
        """`Mamba2Mixer` arguments (without `ops`) from the config."""
        raise NotImplementedError

    @classmethod
    def head_dim(cls, config: Any) -> int:
        """The attention head dim."""
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def init_lm_head(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        """The LM head (this rank's vocabulary rows) and the per-layer `mamba_cache` index
        (None for other layers)."""
        self.config = config
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, ops, tp)
        index = iter(range(len(self.mamba_layers(config))))
        self.state_index = [next(index) if m else None for m in self.mamba_layers(config)]
        self.tie_weights()

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding (tied to the LM head when the config says so)."""
        return self.model.embed_tokens

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.input_embeddings().weight

    @classmethod
    def get_cache_specs(cls, config: Any, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """One spec per layer holding a cache: KV blocks for attention, a slot for Mamba2."""
        attn = AttentionSpec(config.num_key_value_heads, cls.head_dim(config), dtype)
        specs: list[LayerCacheSpec] = []
        for is_mamba, is_attn in zip(cls.mamba_layers(config), cls.attention_layers(config)):
            if is_mamba:
                specs.append(MambaSpec())
            if is_attn:
                specs.append(attn)
        return specs

    @classmethod
    def get_mamba_state_shape(cls, config: Any, dtype: torch.dtype) -> MambaStateShape:
        """Per-slot state of the Mamba2 layers: conv `(CD, K - 1)`, ssm `(NH, P, N)` float32."""
        args = cls.mamba2_args(config)
        conv_dim = args["num_heads"] * args["head_dim"] + 2 * args["n_groups"] * args["state_size"]
        return MambaStateShape(
            num_layers=sum(cls.mamba_layers(config)),
            conv_shape=(conv_dim, args["conv_kernel"] - 1),
            ssm_shape=(args["num_heads"], args["head_dim"], args["state_size"]),
            conv_dtype=dtype,
            ssm_dtype=torch.float32,
        )

    def process_weights_after_loading(self) -> None:
        """Lets each Mamba2 mixer precompute its derived tensors."""
        for module in self.modules():
            if isinstance(module, Mamba2Mixer):
                module.process_weights_after_loading()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`."""
        return self.lm_head(hidden.to(self.lm_head.compute_dtype)).float()
