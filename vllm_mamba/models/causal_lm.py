"""`CausalLM`: the one causal-LM skeleton every model (built in or plugin) is an instance of.

    embeds = embeddings(input_ids) * embedding_multiplier   # (T, H)
    hidden = embeds
    for layer in layers:                                      # embeds: ReadsEmbeddings only
        hidden = layer(hidden, meta, embeds) if reads_embeds(layer) else layer(hidden, meta)
    hidden = final_norm(hidden)                               # what the runner gets
    logits = scale_logits(lm_head(hidden[sampled]))           # compute_logits, float32

A model file builds its layers (usually `DecoderLayer`s from parts) and hands them here with
the checkpoint's names of the container (`StackNames`: `backbone.embeddings` ... `norm_f` for
Mamba, `model.embed_tokens` ... `final_layernorm` for most hybrids), under which this class
adds the (vocabulary-parallel) embedding and the final RMSNorm; the model keeps only what is
its own: the config mapping, the layer plan, the weight-name mapping (`remap_weight_name`, and
`expand_weight` where one checkpoint tensor holds several parameters) and odd scalings. Layers
reach their caches through what the engine bound to them (`layers.cache_layers`), so the
forward passes no cache.

Capabilities are class attributes the engine and loader read (never probes):
`supports_tensor_parallel` (the class accepts a `tp` shard argument and its layers shard),
`supports_quantization` (its `Linear`s may be replaced by int8 ones), `ties_word_embeddings`
(whether `tie_word_embeddings` in the config shares the embedding with the head) and
`skipped_weights` (checkpoint name prefixes the loader skips, each with what it is: the vision
tower of an image-text checkpoint served text-only, a multi-token prediction head) and
`opt_in_weights` (prefixes of parts built only on request, each with what the loader says when
the checkpoint lacks their tensors: the MTP head of `models.mtp.SupportsMTP`). Whether a
model has attention (hence a KV cache and the paged backend) is read off its built layers.
Checkpoint formats other than Hugging Face's are declared in `models.formats`, not here.

A model with several residual streams (mHC, `streams = N > 1`) runs its layers on
`hidden (T, N, H)`: the embeddings copied into every stream before the first layer, the
streams merged by `merge_streams` (their mean, GLM-5-Next's head) before the final norm. With
`keep_streams` set (by an MTP head that reads them, Qwen4-Exp's) the last forward's streams
before the merge stay in `last_streams (T, N, H)`.

A layer is called `layer(hidden, meta)`; one that also reads the step's embeddings (Zamba2's
hybrid layers) declares it by being a `ReadsEmbeddings` and is called `layer(hidden, meta,
embeds)`; one whose `reads_tokens` is true (Qwen4-Exp's n-gram layers) is called
`layer(hidden, meta, tokens=input_ids)`; decided once when the model is built.

Glossary: T tokens in the step, H hidden size, R sampled rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.cache_layers import kv_cache_layers, stateful_layers
from vllm_mamba.layers.decode_plan import drop_decode_plans
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.parallel_linear import lm_head, vocab_embedding
from vllm_mamba.ops.table import MambaOps


class ReadsEmbeddings(nn.Module):
    """A decoder layer that reads the step's embeddings `(T, H)` besides the hidden state:
    `forward(hidden, meta, embeds)`."""


@dataclass(frozen=True)
class StackNames:
    """The checkpoint's names of the decoder container and its ends."""

    prefix: str = "model"
    embeddings: str = "embed_tokens"
    final_norm: str = "norm"


class DecoderStack(nn.Module):
    """Embeddings, the layers and the final norm, under the checkpoint's names."""

    def __init__(
        self,
        names: StackNames,
        embeddings: nn.Module,
        layers: Sequence[nn.Module],
        final_norm: nn.Module,
    ) -> None:
        super().__init__()
        self._names = names
        self.add_module(names.embeddings, embeddings)
        self.layers = nn.ModuleList(layers)
        self.add_module(names.final_norm, final_norm)

    @property
    def token_embedding(self) -> nn.Module:
        """The token embedding."""
        return getattr(self, self._names.embeddings)

    @property
    def last_norm(self) -> nn.Module:
        """The norm after the last layer."""
        return getattr(self, self._names.final_norm)


class CausalLM(nn.Module):
    """A decoder stack and its LM head (see the module docstring)."""

    supports_tensor_parallel: ClassVar[bool] = True
    supports_quantization: ClassVar[bool] = True
    ties_word_embeddings: ClassVar[bool] = True
    skipped_weights: ClassVar[dict[str, str]] = {}
    opt_in_weights: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        config: Any,
        ops: MambaOps,
        tp: TensorParallel,
        *,
        names: StackNames,
        layers: Sequence[nn.Module],
        norm_eps: float,
        embedding_multiplier: float = 1.0,
        final_norm_cls: type[nn.Module] = RMSNorm,
        streams: int = 1,
    ) -> None:
        """Args: `layers` the decoder layers; `norm_eps` the final norm's epsilon;
        `final_norm_cls` its class (`(hidden_size, eps=...)`); `streams` the residual streams
        between the layers (see the module docstring); the embedding is vocabulary-parallel
        under tensor parallelism."""
        super().__init__()
        self.config = config
        self._stack_name = names.prefix
        embeddings = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        final_norm = final_norm_cls(config.hidden_size, eps=norm_eps)
        self.add_module(names.prefix, DecoderStack(names, embeddings, layers, final_norm))
        # the layers given the embeddings, by index (`ReadsEmbeddings`)
        self._reads_embeds = frozenset(
            i for i, layer in enumerate(layers) if isinstance(layer, ReadsEmbeddings)
        )
        # the layers given the token ids (an injection that reads them: `DecoderLayer`)
        self._reads_tokens = frozenset(
            i for i, layer in enumerate(layers) if getattr(layer, "reads_tokens", False)
        )
        self.embedding_multiplier = float(embedding_multiplier)
        self.streams = int(streams)
        self.keep_streams = False
        self.last_streams: torch.Tensor | None = None
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, ops, tp)
        self.tie_weights()

    @property
    def stack(self) -> DecoderStack:
        """The decoder container (`model` or `backbone` in the checkpoints)."""
        return getattr(self, self._stack_name)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers."""
        return self.stack.layers

    def weight_bytes(self) -> int:
        """Bytes of the parameters' and buffers' storages, each storage counted once (a tied
        head and its embedding once; int8 / 4-bit weights at their own size)."""
        sizes = {}
        for t in [*self.parameters(), *self.buffers()]:
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the class and the config tie them."""
        if self.ties_word_embeddings and getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.stack.token_embedding.weight

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """Checkpoint tensor name -> parameter name (identity unless a model maps names)."""
        return name

    @staticmethod
    def checkpoint_weights(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's `(name, tensor)` stream as the model reads it: itself, unless a
        release stores tensors that are read together (Inkling 2's microscaled experts)."""
        return weights

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """One checkpoint tensor (a tensor or a safetensors slice) -> the `(name, tensor)`
        pairs it holds, each loaded as one (itself unless a model packs several)."""
        return [(name, tensor)]

    def process_weights_after_loading(self) -> None:
        """Lets each recurrent and attention layer precompute its derived tensors; drops the
        layers' decode plans (made again when the state cache binds: `layers.decode_plan`)."""
        drop_decode_plans(self)
        for layer in stateful_layers(self):
            layer.process_weights_after_loading()
        for attn in kv_cache_layers(self):
            attn.process_weights_after_loading()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: Any,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns normed hidden states `(T, H)`.
        `mm_embeds`: `(rows (M,), embeds (M, H))`, input embeddings that replace the token
        embeddings of those rows (an image's encoder output at its placeholder tokens)."""
        embeds = self.stack.token_embedding(input_ids)  # (T, H)
        if self.embedding_multiplier != 1.0:
            embeds = embeds * self.embedding_multiplier
        if mm_embeds is not None:
            rows, values = mm_embeds
            embeds = embeds.index_copy(0, rows, values.to(embeds.dtype))  # (T, H)
        hidden = embeds
        if self.streams > 1:
            hidden = embeds.unsqueeze(1).expand(-1, self.streams, -1).contiguous()  # (T, N, H)
        for i, layer in enumerate(self.stack.layers):
            if i in self._reads_embeds:
                hidden = layer(hidden, meta, embeds)
            elif i in self._reads_tokens:
                hidden = layer(hidden, meta, tokens=input_ids)
            else:
                hidden = layer(hidden, meta)
        if self.streams > 1:
            if self.keep_streams:
                self.last_streams = hidden  # (T, N, H)
            hidden = self.merge_streams(hidden)  # (T, H)
        return self.stack.last_norm(hidden)

    def merge_streams(self, streams: torch.Tensor) -> torch.Tensor:
        """The residual streams `(T, N, H)` -> `(T, H)` before the final norm: their mean."""
        return streams.mean(dim=1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden (R, H)` of the sampled positions -> float32 logits `(R, V)`."""
        return self.scale_logits(self.lm_head(hidden.to(self.lm_head.compute_dtype)).float())

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's scaling of its float32 logits `(R, V)` (none by default)."""
        return logits


__all__ = ["CausalLM", "DecoderStack", "ReadsEmbeddings", "StackNames"]
