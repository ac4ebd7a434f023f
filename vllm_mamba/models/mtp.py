"""The multi-token prediction (MTP) heads (Qwen3.5 / Qwen3.6 and Qwen3-Next; in their own
layouts Nemotron 3, Ling 3, GLM-5-Next and Qwen4-Exp, whose model files say how), the model side
of speculative method `mtp`: `MultiTokenPredictor` (with `StreamsMultiTokenPredictor` for a
target with hyper-connection streams) and the capability that attaches it to a target
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

import re
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.hyper_connection import GatedResidual
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


_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# A nextn layer's input parts onto `MultiTokenPredictor`'s; each model adds its final norm.
NEXTN_PARTS = {
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "eh_proj.": "fc.",
}


def nextn_weight_name(name: str, first: int, final_norm: str) -> str | None:
    """A checkpoint name under the MTP head's, for heads stored as decoder layers past the last
    one (DeepSeek's "nextn" layers: Ling 3's, GLM-5-Next's).

    `model.layers.{first + i}.{rest}`: a part of the head's own (`NEXTN_PARTS`, and the final
    norm `final_norm` onto `norm.`) under `mtp.`, any other `shared_head.*` (the target's head
    again) None (dropped), the rest under `mtp.layers.{i}.`; other names as they are.
    """
    parts = {**NEXTN_PARTS, final_norm: "norm."}
    match = _DECODER_LAYER.match(name)
    if match is None or int(match[1]) < first:
        return name
    index, rest = int(match[1]) - first, match[2]
    part = next((p for p in parts if rest.startswith(p)), None)
    if part is not None:
        return MTP_PREFIX + parts[part] + rest[len(part) :]
    if rest.startswith("shared_head."):
        return None
    return f"{MTP_PREFIX}layers.{index}.{rest}"


class MultiTokenPredictor(nn.Module):
    """The MTP head over a target `CausalLM` (see the module docstring). Its parameters carry
    the checkpoint's names relative to `mtp.`; the target is referenced, not a submodule."""

    reads_streams: ClassVar[bool] = False  # reads the target's streams (`from_target`)

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
        mask_first: bool = False,
    ) -> None:
        """Args: `config` the text config; `layers` the MTP decoder layers (`layers.i`);
        `target` the model whose embedding and LM head the head shares; `norm_cls` the class
        of the four norms (Qwen's zero-centred, Nemotron's plain) and `eps` their epsilon
        (default `rms_norm_eps`); `chain`: every draft runs all `layers` in order (Nemotron's
        MTP step is a pattern of blocks), else draft `i` runs layer `i % len(layers)`;
        `mask_first`: the embedding of rows at position 0 is zeroed (GLM's, as vLLM's
        `fused_eh_norm`)."""
        super().__init__()
        self.chain, self.mask_first = chain, mask_first
        self.layers = nn.ModuleList(layers)
        self.build_neck(config, norm_cls, config.rms_norm_eps if eps is None else eps, ops)
        # Not registered: the embedding and head stay the target's (quantisation may replace
        # them after this is built, so they are looked up at each call).
        object.__setattr__(self, "_target", target)

    def build_neck(self, config: Any, norm_cls: type[nn.Module], eps: float, ops: MambaOps) -> None:
        """The parts around the layers: `fc (H, 2H)`, the two input norms and `norm`."""
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, False, ops)
        self.norm = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the first pass reads of the target's forward, whose output is `hidden (T, H)`:
        `hidden` itself."""
        return hidden

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`embeds (T, H)` and `hidden (T, H)` -> the first layer's input `(T, H)`: `fc` of the
        normed pair, embedding first."""
        x = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))],
            dim=-1,
        )  # (T, 2H)
        return self.fc(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output -> the pass's output: `norm(x)`."""
        return self.norm(x)

    def forward(
        self, hidden: torch.Tensor, next_token_ids: torch.Tensor, meta: Any, spec_step: int = 0
    ) -> torch.Tensor:
        """One MTP pass over the step's rows.

        Args:
            hidden: the target's rows (`from_target` of its output), or the previous pass's
                output for a further draft.
            next_token_ids: `(T,)` the token that follows each row's token.
            meta: the step metadata of those rows (the target's, for the first pass).
            spec_step: the draft's index; layer `spec_step % len(layers)` runs (all of them,
                in order, for a `chain` head).

        Returns:
            `finish` of the last layer's output: the input of `compute_logits` and the next
            `hidden`.
        """
        embeds = self._target.stack.token_embedding(next_token_ids)  # (T, H)
        if self.mask_first:
            embeds = embeds.masked_fill((meta.positions == 0).unsqueeze(-1), 0.0)
        x = self.fuse(embeds, hidden)
        if self.chain:
            for layer in self.layers:
                x = layer(x, meta)
        else:
            x = self.layers[spec_step % len(self.layers)](x, meta)
        return self.finish(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` rows from `forward` -> float32 logits `(R, V)` of the shared LM head."""
        return self._target.compute_logits(hidden)


class SupportsMTP:
    """Mixin of a `CausalLM` whose checkpoints ship an MTP head (Qwen3.5 / 3.6, Qwen3-Next).

    `supports_mtp` is the capability the loader reads; `enable_mtp` attaches the head as
    `self.mtp` and stops skipping `mtp.*` for this instance, before the weights load;
    `opt_in_weights` tells the loader what to say when the checkpoint lacks the head's tensors.
    A class gives `mtp_layer` (its full-attention decoder layer) and `mtp_default_layers` (the
    number of layers when the config names none; None: the config must name it), or overrides
    `mtp_head_layers` (all the head's layers), `mtp_head_options` (`MultiTokenPredictor`'s
    keyword arguments) and `mtp_head_cls` (the head's class) where its head differs from
    Qwen's.
    """

    supports_mtp: ClassVar[bool] = True
    mtp_default_layers: ClassVar[int | None] = None
    mtp_head_cls: ClassVar[type[MultiTokenPredictor]] = MultiTokenPredictor
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
        self.mtp = head = self.mtp_head_cls(
            config,
            layers,
            ops,
            self,
            **self.mtp_head_options(),  # type: ignore[arg-type]
        )
        if head.reads_streams:
            self.keep_streams = True  # the head reads `last_streams`
        skipped = self.skipped_weights  # type: ignore[attr-defined]
        self.skipped_weights = {p: w for p, w in skipped.items() if p != MTP_PREFIX}
        return self.mtp


class StreamsMultiTokenPredictor(MultiTokenPredictor):
    """The head of a target with hyper-connection streams (Qwen4-Exp's, as SGLang's
    `Qwen4ExpForCausalLMMTP`): it reads the target's streams before their merge and carries
    streams from draft to draft.

        e = fc_embedding(pre_fc_norm_embedding(embed(next_token)))       (T, H)
        s = fc_hidden(pre_fc_norm_hidden(streams).view(T, N, H))          one norm over N*H
        x = layers[step % n](e[:, None] + s, meta)                       (T, N, H)
        out = x.flatten(1)                                                the next `hidden`
        logits = lm_head(hyper_connection_mixer.merge(x))                 the target's head

    `streams` are the target's last layer's output `(T, N, H)`, which the target keeps while
    this head is attached (`CausalLM.keep_streams`). The norms are zero-centred."""

    reads_streams: ClassVar[bool] = True

    def build_neck(self, config: Any, norm_cls: type[nn.Module], eps: float, ops: MambaOps) -> None:
        """`fc_embedding`, `fc_hidden` `(H, H)`, the input norms (`pre_fc_norm_hidden` over all
        `N * H` of a row) and the `hyper_connection_mixer` in place of `norm`."""
        hidden, streams = config.hidden_size, config.hc_count
        self.hidden_size, self.streams = hidden, streams
        self.fc_embedding = Linear(hidden, hidden, False, ops)
        self.fc_hidden = Linear(hidden, hidden, False, ops)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(streams * hidden, eps=eps)
        self.hyper_connection_mixer = GatedResidual(
            hidden, streams, config.hc_lowrank, eps, ops, inject=False
        )

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's streams before their merge `(T, N * H)` (its output `hidden` is the
        merge)."""
        return self._target.last_streams.flatten(1)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`embeds (T, H)` and streams `hidden (T, N * H)` -> the layer's streams `(T, N, H)`."""
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeds))  # (T, H)
        normed = self.pre_fc_norm_hidden(hidden.to(embeds.dtype))  # (T, N * H)
        s = self.fc_hidden(normed.view(-1, self.hidden_size))  # (T N, H)
        return e.unsqueeze(1) + s.view(-1, self.streams, self.hidden_size)  # (T, N, H)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's streams `(T, N, H)` flattened `(T, N * H)` (the mixer runs in
        `compute_logits`)."""
        return x.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Streams `(R, N * H)` -> merged by the head's mixer -> float32 logits `(R, V)`."""
        merged = self.hyper_connection_mixer.merge(hidden.view(-1, self.streams, self.hidden_size))
        return self._target.compute_logits(merged)


__all__ = [
    "MTP_PREFIX",
    "MultiTokenPredictor",
    "StreamsMultiTokenPredictor",
    "SupportsMTP",
    "NEXTN_PARTS",
    "mtp_num_layers",
    "nextn_weight_name",
]
