"""RWKV-4 (`RwkvForCausalLM`): transformers' RWKV (`RWKV/rwkv-4-169m-pile` ...
`rwkv-raven-14b`, `config.json` with `model_type: rwkv`), under its checkpoint names.

Every block is a pre-norm time mix and channel mix with LayerNorms (with bias,
`layer_norm_epsilon`); block 0 first normalises the embeddings (`pre_ln`):

    h = pre_ln(h)                                 (block 0 only)
    h = h + attention(ln1(h))                     time mix (`layers.rwkv4`)
    h = h + feed_forward(ln2(h))                  channel mix
    h = h / 2                                     after every `rescale_every`-th block
    logits = head(ln_out(h))

`rescale_every` (transformers', default 6) is reproduced: block `i`'s `attention.output` and
`feed_forward.value` weights are divided by `2 ** (i // rescale_every)` after loading and the
hidden states halved after every `rescale_every` blocks, as transformers does in eval mode.
Every later block's residual and the final norm then see `h / 2**n`; LayerNorm is
scale-invariant except for its epsilon, so the rescaled model is the plain one up to
epsilon. Reproducing it costs one multiply per `rescale_every` blocks and buys both: the same
logits as transformers (not only up to epsilon), and the point of it, hidden states that stay
within float16's range in the deep released models. Powers of two make the divisions exact.
`rescale_every` of 0 (or less) turns it off.

Glossary: H hidden size, V vocabulary, A `attention_hidden_size`, F `intermediate_size`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.rwkv4 import Rwkv4ChannelMix, Rwkv4TimeMix
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="rwkv", embeddings="embeddings", final_norm="ln_out")


def rescale_factors(config: Any) -> list[int]:
    """Each block's divisor of its output weights, `2 ** (i // rescale_every)` (all 1 when
    `rescale_every` is 0 or less)."""
    every = int(getattr(config, "rescale_every", 0) or 0)
    return [2 ** (i // every) if every > 0 else 1 for i in range(config.num_hidden_layers)]


class RwkvForCausalLM(CausalLM):
    """RWKV-4: time-mix and channel-mix blocks, LayerNorms, an untied `head` by default."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        attention_size = config.attention_hidden_size or hidden
        ffn_size = config.intermediate_size or 4 * hidden
        norm = functools.partial(nn.LayerNorm, hidden, eps=eps)
        layers = []
        for index, rescale in enumerate(rescale_factors(config)):
            attn = Rwkv4TimeMix(hidden, attention_size, ops, tp, rescale)
            ffn = Rwkv4ChannelMix(hidden, ffn_size, ops, tp, rescale)
            layers.append(
                DecoderLayer(
                    pre_norm=("pre_ln", norm()) if index == 0 else None,
                    norm=("ln1", norm()),
                    mixers=[MixerPart("attention", attn)],
                    ffn_norm=("ln2", norm()),
                    ffns=[("feed_forward", ffn)],
                )
            )
        every = int(getattr(config, "rescale_every", 0) or 0)
        # The blocks after which the hidden states are halved.
        self._halve_after = {i for i in range(len(layers)) if every > 0 and (i + 1) % every == 0}
        super().__init__(
            config, ops, tp, names=NAMES, layers=layers, norm_eps=eps, final_norm_cls=nn.LayerNorm
        )

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """transformers' `rwkv.blocks.N.` and `head.` -> `rwkv.layers.N.` and `lm_head.`."""
        if name.startswith("head."):
            return "lm_head." + name[len("head.") :]
        return name.replace("rwkv.blocks.", "rwkv.layers.", 1)

    def forward(self, input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`, halving the hidden states after every
        `rescale_every` blocks; returns the normed hidden states `(T, H)`."""
        hidden = self.stack.token_embedding(input_ids)  # (T, H)
        for index, layer in enumerate(self.stack.layers):
            hidden = layer(hidden, meta)
            if index in self._halve_after:
                hidden = hidden * 0.5
        return self.stack.last_norm(hidden)
