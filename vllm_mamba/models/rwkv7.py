"""RWKV-7 "Goose" (`RWKV7ForCausalLM`): fla-hub's Hugging Face format (`fla-hub/rwkv7-0.4B-world`
... `rwkv7-2.9B-world`, `config.json` with `model_type: rwkv7`) and BlinkDL's `.pth` releases
(`RWKV-x070-World-0.4B-...pth`: the format `models.rwkv_pth_format` declares, names and shapes
mapped onto fla's as they load).

Every layer is a pre-norm time mix and channel mix with LayerNorms (with bias unless
`norm_bias` is false); layer 0 first normalises the embeddings (`pre_norm`, BlinkDL's `ln0`):

    h = pre_norm(h)                              (layer 0 only)
    h = h + attn(attn_norm(h))                   time mix (`layers.rwkv7`)
    h = h + ffn(ffn_norm(h))                     channel mix
    logits = lm_head(norm(h))

fla's converter of January to April 2025 wrote the six token-shift mixes of each time mix as one
`attn.x_x` of shape `(6, H)` (rows r, w, k, v, a, g) instead of six `attn.x_*` tensors; such a
checkpoint is split as it loads (`expand_weight`), as fla itself does.

The time mix's group norm uses `head_dim * norm_eps` (fla's) unless the config sets
`group_norm_eps` (BlinkDL's 64e-5). fla's `value_dim` may be wider than `hidden_size`; the
released models have it equal. RWKV-7 has no attention, so the engine runs it on the
placeholder backend with the state cache alone.

transformers has no RWKV-7 config: `Rwkv7Config` (model type `rwkv7`, fla's field names and
defaults) is registered with `AutoConfig` when this module is imported.

Glossary: H hidden size, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.rwkv7 import MIXES, Rwkv7ChannelMix, Rwkv7TimeMix, ValueFirst
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embeddings", final_norm="norm")


class Rwkv7Config(PretrainedConfig):
    """fla's `RWKV7Config` fields that define the model (the others are kept as given)."""

    model_type = "rwkv7"

    def __init__(
        self,
        vocab_size: int = 65536,
        hidden_size: int = 2048,
        num_hidden_layers: int = 24,
        head_dim: int | None = 64,
        num_heads: int | None = None,
        decay_low_rank_dim: int = 64,
        gate_low_rank_dim: int = 128,
        a_low_rank_dim: int = 64,
        v_low_rank_dim: int = 16,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        hidden_act: str = "sqrelu",
        norm_first: bool = True,
        norm_bias: bool = True,
        norm_eps: float = 1e-5,
        group_norm_eps: float | None = None,
        value_dim: int | list[int] | None = None,
        max_position_embeddings: int = 2048,
        tie_word_embeddings: bool = False,
        bos_token_id: int = 0,
        eos_token_id: int = 0,
        **kwargs: Any,
    ) -> None:
        if head_dim is None and num_heads is not None:
            head_dim = hidden_size // num_heads
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.head_dim = head_dim
        self.num_heads = hidden_size // head_dim if head_dim else num_heads
        self.decay_low_rank_dim, self.gate_low_rank_dim = decay_low_rank_dim, gate_low_rank_dim
        self.a_low_rank_dim, self.v_low_rank_dim = a_low_rank_dim, v_low_rank_dim
        self.hidden_ratio, self.intermediate_size = hidden_ratio, intermediate_size
        self.hidden_act, self.norm_first, self.norm_bias = hidden_act, norm_first, norm_bias
        self.norm_eps, self.group_norm_eps = norm_eps, group_norm_eps
        self.value_dim = value_dim
        self.max_position_embeddings = max_position_embeddings
        super().__init__(
            tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, **kwargs,
        )  # fmt: skip


AutoConfig.register("rwkv7", Rwkv7Config, exist_ok=True)


def ffn_size(config: Any) -> int:
    """The channel mix's width: `intermediate_size`, else `hidden_ratio * H` rounded up to a
    multiple of 32 (fla's rule)."""
    if config.intermediate_size is not None:
        return int(config.intermediate_size)
    size = int(config.hidden_size * (config.hidden_ratio or 4))
    return 32 * ((size + 31) // 32)


def value_dims(config: Any) -> list[int]:
    """Each layer's value width (`value_dim`: None, one int, or one per layer)."""
    dims = config.value_dim
    if dims is None:
        return [config.hidden_size] * config.num_hidden_layers
    if isinstance(dims, int):
        return [dims] * config.num_hidden_layers
    if len(dims) != config.num_hidden_layers:
        raise ValueError(f"value_dim has {len(dims)} entries for {config.num_hidden_layers} layers")
    return [int(d) for d in dims]


def check_config(config: Any) -> None:
    """Refuses the fla options this engine does not implement, naming the field."""
    if config.hidden_act != "sqrelu":
        raise ValueError(f"hidden_act {config.hidden_act!r}: RWKV-7 runs 'sqrelu' only")
    if not config.norm_first:
        raise ValueError("norm_first false: RWKV-7 runs with the first layer's pre_norm only")
    if getattr(config, "attn", None):
        raise ValueError("attn: RWKV-7 hybrids with attention layers are not supported")


class RWKV7ForCausalLM(CausalLM):
    """RWKV-7: time-mix and channel-mix layers, LayerNorms, an untied head by default."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        check_config(config)
        hidden, eps = config.hidden_size, config.norm_eps
        norm = functools.partial(nn.LayerNorm, bias=bool(config.norm_bias))
        gn_eps = config.group_norm_eps or config.head_dim * eps
        ranks = {
            "w": config.decay_low_rank_dim, "a": config.a_low_rank_dim,
            "v": config.v_low_rank_dim, "g": config.gate_low_rank_dim,
        }  # fmt: skip
        value_first = ValueFirst()
        layers = []
        for index, value_dim in enumerate(value_dims(config)):
            attn = Rwkv7TimeMix(
                hidden_size=hidden, head_dim=config.head_dim, value_dim=value_dim, ranks=ranks,
                layer_idx=index, group_norm_eps=gn_eps, value_first=value_first, ops=ops, tp=tp,
            )  # fmt: skip
            layers.append(
                DecoderLayer(
                    pre_norm=("pre_norm", norm(hidden, eps=eps)) if index == 0 else None,
                    norm=("attn_norm", norm(hidden, eps=eps)),
                    mixers=[MixerPart("attn", attn)],
                    ffn_norm=("ffn_norm", norm(hidden, eps=eps)),
                    ffns=[("ffn", Rwkv7ChannelMix(hidden, ffn_size(config), ops, tp))],
                )
            )
        super().__init__(
            config, ops, tp, names=NAMES, layers=layers, norm_eps=eps, final_norm_cls=norm
        )

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """fla's older `attn.x_x (6, H)` -> the six `attn.x_r ... attn.x_g (1, 1, H)`."""
        if not name.endswith("attn.x_x"):
            return [(name, tensor)]
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # (6, H)
        if whole.dim() != 2 or whole.shape[0] != len(MIXES):
            return [(name, tensor)]  # left for the loader to name as misshaped
        prefix = name[: -len("x_x")]
        return [(prefix + mix, row.reshape(1, 1, -1)) for mix, row in zip(MIXES, whole)]
