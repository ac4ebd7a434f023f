"""The multi-token prediction (MTP) head of Qwen3.5 / Qwen3.6 and Qwen3-Next, the model side of
speculative method `mtp`: `MultiTokenPredictor` and the capability that attaches it to a target
(`SupportsMTP.enable_mtp`, called by `model_loader.build_model(..., mtp=True)`). It lives with
the models, which build its layers and whose checkpoints hold its weights; the speculative
decoding side (`vllm_mamba.spec_decode`) imports it, never the other way round.

The released checkpoints ship the head beside the language model, under `mtp.*`:

    mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden   zero-centred RMSNorms (1 + w), (H,)
    mtp.fc                                              (H, 2H), no bias
    mtp.layers.0.*                                      one full-attention decoder layer of the
                                                        model (gated attention, q/k norms,
                                                        partial RoPE; its dense MLP or MoE)
    mtp.norm                                            zero-centred RMSNorm (1 + w), (H,)

and share the target's token embedding and LM head (no `mtp.embed_tokens` / `mtp.lm_head`). As
vLLM's `Qwen3NextMultiTokenPredictor` / `Qwen3_5MultiTokenPredictor`, row r of a step is

    e = pre_fc_norm_embedding(embed(next_token[r]))        the token that follows row r's token
    h = pre_fc_norm_hidden(hidden[r])                      the target's final hidden (normed)
    x = fc(cat([e, h], -1))                                embedding first
    x = layers[step % n](x, meta)                          attention at row r's own position
    out = norm(x)                                          returned, and fed back as `hidden`
    logits = lm_head(out)                                  the target's shared head, float32

`hidden` is what `CausalLM.forward` returns: the target's last hidden state after its final
norm (vLLM's drafter gets the target model's output, which is post-norm). Row r keeps the
position and KV slot of the target row it extends (the row of the target token at position t
reads embedding t+1 and writes the MTP layer's KV at t), so the step metadata of the target's
rows serves as is. For a further draft, the previous MTP output (after `mtp.norm`, as vLLM's
`mtp` method feeds back) is the next `hidden`, the drafted token the next `next_token_ids`, and
the metadata is one decode row per sequence one position further on.

The layer's attention is an ordinary `SelfAttention`, so once `mtp` is attached the engine's
KV cache counts it as one more attention layer (the last in module order) and binds it; the
head holds no recurrent state.

What `mtp.*` may not be skipped, and the number of layers: `mtp_num_hidden_layers` (Qwen3.5 /
3.6, in `text_config`), or `num_nextn_predict_layers`; a model class gives the default when the
config names neither (Qwen3-Next's releases name neither and ship one layer, as vLLM assumes;
Qwen3.5 has none).

Tensor parallelism (`tp`): the layer shards as the model's own layers (attention by heads, the
MLP and every expert column- then row-parallel); `fc` and the norms are replicated; the
embedding and head are the target's (vocabulary-parallel).

Glossary: T rows of the step, H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.layernorm import ZeroCenteredRMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.ops.table import MambaOps

MTP_PREFIX = "mtp."
LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def mtp_num_layers(config: Any, default: int | None = None) -> int:
    """The MTP layers of `config` (`mtp_num_hidden_layers`, else `num_nextn_predict_layers`,
    else `default`).

    Raises:
        ValueError: none, or fewer than one (the checkpoint has no MTP head).
    """
    key, value = next(
        ((k, getattr(config, k)) for k in LAYER_KEYS if getattr(config, k, None) is not None),
        ("mtp_num_hidden_layers", default),
    )
    if value is None or int(value) < 1:
        raise ValueError(
            f"speculative method 'mtp': the model has no multi-token prediction head ({key} is "
            f"{value!r} in its config; a checkpoint with the head has mtp_num_hidden_layers >= 1)"
        )
    return int(value)


class MultiTokenPredictor(nn.Module):
    """The MTP head over a target `CausalLM` (see the module docstring). Its parameters carry
    the checkpoint's names relative to `mtp.`; the target is referenced, not a submodule."""

    def __init__(
        self,
        config: Any,
        layers: Sequence[nn.Module],
        ops: MambaOps,
        target: nn.Module,
        *,
        norm_cls: type[nn.Module] = ZeroCenteredRMSNorm,
        eps: float | None = None,
        chain: bool = False,
    ) -> None:
        """Args: `config` the text config; `layers` the MTP decoder layers (`layers.i`);
        `target` the model whose embedding and LM head the head shares; `norm_cls` the class
        of the four norms (Qwen's zero-centred, Nemotron's plain) and `eps` their epsilon
        (default `rms_norm_eps`); `chain`: every draft runs all `layers` in order (Nemotron's
        MTP step is a pattern of blocks), else draft `i` runs layer `i % len(layers)`."""
        super().__init__()
        hidden = config.hidden_size
        eps = config.rms_norm_eps if eps is None else eps
        self.chain = chain
        self.fc = Linear(2 * hidden, hidden, False, ops)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        # Not registered: the embedding and head stay the target's (quantisation may replace
        # them after this is built, so they are looked up at each call).
        object.__setattr__(self, "_target", target)

    def forward(
        self, hidden: torch.Tensor, next_token_ids: torch.Tensor, meta: Any, spec_step: int = 0
    ) -> torch.Tensor:
        """One MTP pass over the step's rows.

        Args:
            hidden: `(T, H)` the target's final (normed) hidden state of each row, or the
                previous pass's output for a further draft.
            next_token_ids: `(T,)` the token that follows each row's token.
            meta: the step metadata of those rows (the target's, for the first pass).
            spec_step: the draft's index; layer `spec_step % len(layers)` runs (all of them,
                in order, for a `chain` head).

        Returns:
            `(T, H)` after `mtp.norm`: the input of `compute_logits` and the next `hidden`.
        """
        embeds = self._target.stack.token_embedding(next_token_ids)  # (T, H)
        x = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))],
            dim=-1,
        )  # (T, 2H)
        x = self.fc(x)
        if self.chain:
            for layer in self.layers:
                x = layer(x, meta)
        else:
            x = self.layers[spec_step % len(self.layers)](x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` from `forward` -> float32 logits `(R, V)` of the shared LM head."""
        return self._target.compute_logits(hidden)


class SupportsMTP:
    """Mixin of a `CausalLM` whose checkpoints ship an MTP head (Qwen3.5 / 3.6, Qwen3-Next).

    `supports_mtp` is the capability the loader reads; `enable_mtp` attaches the head as
    `self.mtp` and stops skipping `mtp.*` for this instance, before the weights load;
    `opt_in_weights` tells the loader what to say when the checkpoint lacks the head's tensors.
    A class gives `mtp_layer` (its full-attention decoder layer) and `mtp_default_layers` (the
    number of layers when the config names none; None: the config must name it), or overrides
    `mtp_head_layers` (all the head's layers) and `mtp_head_options` (`MultiTokenPredictor`'s
    keyword arguments) where its head differs from Qwen's.
    """

    supports_mtp: ClassVar[bool] = True
    mtp_default_layers: ClassVar[int | None] = None
    opt_in_weights: ClassVar[dict[str, str]] = {
        MTP_PREFIX: "speculative method 'mtp': the checkpoint has no (or an incomplete) "
        "multi-token prediction head"
    }

    def mtp_layer(self, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """MTP decoder layer `index` (`mtp.layers.{index}`)."""
        raise NotImplementedError

    def mtp_head_layers(self, count: int, ops: MambaOps, tp: TensorParallel) -> list[nn.Module]:
        """The head's layers for `count` MTP layers in the config (`mtp_layer` each)."""
        return [self.mtp_layer(i, ops, tp) for i in range(count)]

    def mtp_head_options(self) -> dict[str, Any]:
        """`MultiTokenPredictor`'s keyword arguments (Qwen's head: none)."""
        return {}

    def enable_mtp(self, ops: MambaOps, tp: TensorParallel = SINGLE) -> MultiTokenPredictor:
        """Builds and attaches `self.mtp` (on the current default device), once.

        Raises:
            ValueError: the config has no MTP layers (`mtp_num_hidden_layers` 0 or absent).
        """
        existing = getattr(self, "mtp", None)
        if existing is not None:
            return existing
        config = self.config  # type: ignore[attr-defined]
        count = mtp_num_layers(config, self.mtp_default_layers)
        layers = self.mtp_head_layers(count, ops, tp)
        self.mtp = MultiTokenPredictor(
            config,
            layers,
            ops,
            self,
            **self.mtp_head_options(),  # type: ignore[arg-type]
        )
        skipped = self.skipped_weights  # type: ignore[attr-defined]
        self.skipped_weights = {p: w for p, w in skipped.items() if p != MTP_PREFIX}
        return self.mtp


__all__ = ["MTP_PREFIX", "MultiTokenPredictor", "SupportsMTP", "mtp_num_layers"]
