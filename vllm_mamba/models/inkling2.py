"""Inkling 2 (`Inkling2ForCausalLM`: the language model of `thinkingmachines/Inkling-2-Small`).

Inkling's plan (sliding `hybrid_sliding` and full `hybrid` attention layers, by default every
sixth full, each with short convs on its keys, values and both stage outputs, and the MoE on
every layer), with block attention residuals: the layers are grouped in blocks of
`n_layers_per_attn_res_block`; each token keeps the hidden state that entered every block
(`block_states`, `layers.block_attention_residual`), and a layer reads a learned softmax mix of
them and of the current block's partial sum instead of the plain residual stream:

    x = attention_input(blocks, h)                        # 3 mixes (q, k, v) in full layers
    a = post_attention_convolution(self_attn(norm(x)))    # norm: input_layernorm, or q/k/v_
    r = a if the layer starts a block (blocks += h) else h + a       # float32
    y = post_mlp_convolution(mlp(post_attention_layernorm(mlp_input(blocks, r))))
    h = r + y
    ...
    hidden = norm(final_input(blocks, h))

Layer 0 has no `attention_input` (it reads the embeddings). The short convs are `(x +
conv(x)) / sqrt(K + 1)`; the attention is `layers.inkling2_attention` (L2-clipped queries and
keys, relative bias with its own clip, log scaling in full layers, sinks, a sigmoid output gate,
dynamic key/value convs in full layers). The MoE (`mlp.*`): sigmoid scores of a float32 router
`gate`, experts chosen by score plus `e_score_correction_bias`, weighted by their renormalised
scores times `route_scale`, each expert `down(cap_g(g) * sigmoid(g) * cap_u(u))` with
`cap(x) = c * tanh(x / c)` (`mlp_gate_softcap`, `mlp_up_softcap`), summed in float32; no shared
expert. Embeddings `embed_tokens` followed by `embed_norm`; the logits are soft-capped at
`final_logit_softcapping`, and those of the rows past `unpadded_vocab_size` (the checkpoint's
head is padded to `vocab_size` with zeros) are kept at -inf.

Checkpoint names are the release's (what transformers' `save_pretrained` writes back):
`model.llm.*` with `attn.wq_du`, `wk_dv`, `wv_dv`, `wr_du`, `wo_ud`, `gate_attn`,
`attn_sink_proj`, `q_l2_clip`, `rel_l2_clip`, `rel_logits_proj`, `{k,v}_sconv` (`weight`, or
`static_w` and `weight_proj`), `attn_sconv`, `mlp_sconv`, `attn_norm`, `mlp_norm`,
`{q,k,v}_input_norm`, `mlp.gate.bias`, the experts' `w13_weight (E, 2F, H)` (gate and up rows
interleaved) and `w2_weight (E, H, F)` (float, or NVFP4 / MXFP8 with their scales as the
releases ship them: `models.prequantized.stacked_experts`), `attn_res.{attn_queries.i (layer
i + 1), mlp_queries.i, output_query}`, `embed`, `embed_norm`, `norm`, `unembed`.
`remap_weight_name` maps them onto transformers' module names, which this model uses;
`expand_weight` splits the experts.

Tensor parallelism (`tp`): attention by heads, the experts column- then row-parallel; the
router, the block residuals and the convs over the hidden state replicated;
vocabulary-parallel embedding and head.

Glossary: T tokens in the step, H hidden size, B completed blocks, E experts, F expert width.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.block_attention_residual import BlockAttentionResidual
from vllm_mamba.layers.inkling2_attention import Inkling2Attention
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.loop_messages import MessageGate
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.layers.residual_short_conv import ResidualShortConv
from vllm_mamba.layers.softcapped_expert import SoftcappedGatedMLP, softcap
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.models.layer_types import layer_types
from vllm_mamba.models.prequantized.stacked_experts import dequantized_experts
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="model", embeddings="embed_tokens", final_norm="norm")
KINDS = ("hybrid_sliding", "hybrid")
ROUTER_RENORM_EPS = 1e-20  # transformers adds it to the sum of the k scores
MESSAGE_GATES = ("q", "k", "v", "mlp")  # a looped layer's message gates, by input
_ATTN_QUERY = re.compile(r"^model\.llm\.attn_res\.attn_queries\.(\d+)$")
_RENAMED = (  # the release's names -> transformers', in order (see the module docstring)
    (r"^model\.llm\.unembed\.", "lm_head."),
    (r"^model\.llm\.embed\.", "model.embed_tokens."),
    (r"^model\.llm\.embed_norm\.", "model.embed_tokens.embed_norm."),
    (r"^model\.llm\.attn_res\.output_query$", "model.final_input.query"),
    (r"^model\.llm\.attn_res\.mlp_queries\.(\d+)$", r"model.layers.\1.mlp_input.query"),
    (r"^model\.llm\.", "model."),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj.linear."),
    (r"\.attn\.q_l2_clip\.", ".self_attn.q_proj.norm."),
    (r"\.attn\.w([kv])_dv\.", r".self_attn.\1_proj.linear."),
    (r"\.attn\.([kv])_sconv\.weight$", r".self_attn.\1_proj.sconv.conv1d.weight"),
    (r"\.attn\.([kv])_sconv\.static_w$", r".self_attn.\1_proj.sconv.static_weight"),
    (r"\.attn\.([kv])_sconv\.weight_proj$", r".self_attn.\1_proj.sconv.weight_proj.weight"),
    (r"\.attn\.wr_du\.", ".self_attn.relative_position_bias.linear."),
    (r"\.attn\.rel_l2_clip\.", ".self_attn.relative_position_bias.norm."),
    (r"\.attn\.rel_logits_proj\.", ".self_attn.relative_position_bias."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj.linear."),
    (r"\.attn\.gate_attn\.", ".self_attn.o_proj.gate_proj."),
    (r"\.attn\.attn_sink_proj\.", ".self_attn.sink_proj."),
    (r"\.attn_sconv\.weight$", ".post_attention_convolution.conv1d.weight"),
    (r"\.mlp_sconv\.weight$", ".post_mlp_convolution.conv1d.weight"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.([qkv])_input_norm\.", r".\1_input_layernorm."),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
)


def _moe(config: Any, ops: MambaOps, tp: TensorParallel) -> SparseMoE:
    """Sigmoid-routed soft-capped experts, summed in float32 (see the module docstring)."""
    if config.scoring_func != "sigmoid":
        raise ValueError(f"scoring_func {config.scoring_func!r} is not supported (sigmoid)")
    hidden, num = config.hidden_size, config.n_routed_experts
    route = RouterConfig(
        "sigmoid_topk", num, config.num_experts_per_tok, renormalize=True,
        scaling=float(config.route_scale), score_bias=True, renorm_eps=ROUTER_RENORM_EPS,
    )  # fmt: skip
    caps = (float(config.mlp_gate_softcap), float(config.mlp_up_softcap))
    experts = ExpertList(
        SoftcappedGatedMLP(
            hidden, config.moe_intermediate_size, False, ops, tp, reduce=False, caps=caps
        )
        for _ in range(num)
    )
    return SparseMoE(
        ExpertRouter(hidden, route, ops), experts, tp, accumulate_fp32=True,
        names=("gate", "experts"),
    )  # fmt: skip


class Inkling2DecoderLayer(nn.Module):
    """One sliding or full layer with its block attention residuals (see the module
    docstring)."""

    def __init__(
        self,
        config: Any,
        index: int,
        sliding: bool,
        ops: MambaOps,
        tp: TensorParallel,
        passes: int = 1,
    ) -> None:
        """Args: `passes` > 1 for a looped layer (Inkling 2 Loop): a KV cache and conv
        histories per pass, and the gates of the messages from the previous pass."""
        super().__init__()
        hidden, eps, kernel = config.hidden_size, config.rms_norm_eps, config.conv_kernel_size
        self.starts_block = index % config.n_layers_per_attn_res_block == 0
        self.sliding = sliding
        self.attention_input = (
            BlockAttentionResidual(hidden, 1 if sliding else 3) if index > 0 else None
        )
        self.mlp_input = BlockAttentionResidual(hidden)
        self.self_attn = Inkling2Attention(config, sliding, ops, tp, passes)
        self.mlp = _moe(config, ops, tp)
        for name in ("input",) if sliding else ("q_input", "k_input", "v_input"):
            self.add_module(f"{name}_layernorm", RMSNorm(hidden, eps))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        conv = {"out_divisor": math.sqrt(kernel + 1), "passes": passes}
        self.post_attention_convolution = ResidualShortConv(hidden, kernel, ops, **conv)
        self.post_mlp_convolution = ResidualShortConv(hidden, kernel, ops, **conv)
        if passes > 1:
            for name in MESSAGE_GATES:
                gate = MessageGate(hidden, config.loop_gate_rank, eps, ops)
                self.add_module(f"{name}_message_gate", gate)

    def forward(
        self,
        hidden: torch.Tensor,
        blocks: torch.Tensor,
        meta: PagedMetadata,
        pass_index: int = 0,
        messages: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`hidden (T, H)` and the completed blocks `(T, B, H)` -> `(T, H)` in hidden's dtype;
        a looped layer's pass `pass_index` with the previous pass's `messages (4, T, H)`."""
        dtype = hidden.dtype
        xq, xk, xv = self._attention_inputs(hidden, blocks, messages)
        mixed = self.self_attn(xq, xk, xv, meta, pass_index)
        mixed = self.post_attention_convolution(mixed, meta, pass_index).float()
        if self.starts_block:
            blocks = torch.cat([blocks, hidden[:, None]], dim=1)
            residual = mixed
        else:
            residual = hidden.float() + mixed
        x = self.mlp_input(blocks, residual)[0]
        if messages is not None:
            x = self.mlp_message_gate(x, messages[3])
        x = self.post_attention_layernorm(x).to(dtype)
        return (residual + self.post_mlp_convolution(self.mlp(x), meta, pass_index)).to(dtype)

    def _attention_inputs(
        self, hidden: torch.Tensor, blocks: torch.Tensor, messages: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """The normed query, key and value inputs `(T, H)` each, in hidden's dtype: the
        block mixes (3 in a full layer), gated with the messages when given."""
        mixes = (
            [hidden] if self.attention_input is None else list(self.attention_input(blocks, hidden))
        )
        if self.sliding and messages is None:
            x = self.input_layernorm(mixes[0]).to(hidden.dtype)
            return x, x, x
        mixes = mixes * 3 if len(mixes) == 1 else mixes
        if messages is not None:
            gates = (self.q_message_gate, self.k_message_gate, self.v_message_gate)
            mixes = [gate(x, m) for gate, x, m in zip(gates, mixes, messages)]
        if self.sliding:
            norms = (self.input_layernorm,) * 3
        else:
            norms = (self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm)
        return tuple(norm(x).to(hidden.dtype) for norm, x in zip(norms, mixes))


def run_layers(
    layers: Iterable[nn.Module],
    hidden: torch.Tensor,
    blocks: torch.Tensor,
    meta: PagedMetadata,
    pass_index: int = 0,
    messages: Callable[[int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs `layers` (`Inkling2DecoderLayer`s) from `hidden (T, H)` and `blocks (T, B, H)`,
    adding each block's input to the block states; a looped pass `pass_index` gives layer j
    `messages(j)`. Returns the last output and the block states."""
    for j, layer in enumerate(layers):
        out = layer(hidden, blocks, meta, pass_index, None if messages is None else messages(j))
        if layer.starts_block:
            blocks = torch.cat([blocks, hidden[:, None]], dim=1)
        hidden = out
    return hidden, blocks


class Inkling2ForCausalLM(CausalLM):
    """Inkling 2's language model (see the module docstring)."""

    ties_word_embeddings: ClassVar[bool] = False

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        layers = [
            Inkling2DecoderLayer(
                config, index, kind == "hybrid_sliding", ops, tp, self._passes(config, index)
            )
            for index, kind in enumerate(layer_types(config, KINDS))
        ]
        super().__init__(config, ops, tp, names=NAMES, layers=layers, norm_eps=config.rms_norm_eps)
        self.stack.token_embedding.add_module(
            "embed_norm", RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        )
        self.stack.final_input = BlockAttentionResidual(config.hidden_size)
        self.logit_cap = float(config.final_logit_softcapping)
        self.real_vocab = min(config.unpadded_vocab_size or config.vocab_size, config.vocab_size)

    @staticmethod
    def _passes(config: Any, index: int) -> int:
        """How many times a step runs layer `index` (once: no loop here)."""
        return 1

    def forward(self, input_ids: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)`; returns the normed hidden states `(T, H)`
        read from the last block states."""
        hidden, blocks = self.embed(input_ids)
        return self.finish(*run_layers(self.stack.layers, hidden, blocks, meta))

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed embeddings `(T, H)` and the empty block states `(T, 0, H)`."""
        embedding = self.stack.token_embedding
        hidden = embedding.embed_norm(embedding(input_ids))  # (T, H)
        return hidden, hidden.new_zeros(hidden.shape[0], 0, hidden.shape[1])

    def finish(self, hidden: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The last layer's output and the block states -> the normed hidden states `(T, H)`."""
        final = self.stack.final_input(blocks, hidden)[0]
        return self.stack.last_norm(final).to(hidden.dtype)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capped float32 logits `(R, V)`, the padded head's rows at -inf."""
        logits = softcap(logits, self.logit_cap)
        logits[:, self.real_vocab :] = -math.inf
        return logits

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The release's names onto transformers' (see the module docstring)."""
        query = _ATTN_QUERY.match(name)
        if query is not None:  # attention queries from layer 1 on
            return f"model.layers.{int(query[1]) + 1}.attention_input.query"
        for pattern, new in _RENAMED:
            name = re.sub(pattern, new, name)
        return name

    @staticmethod
    def checkpoint_weights(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The release's NVFP4 / MXFP8 experts as float ones (`prequantized.stacked_experts`)."""
        return dequantized_experts(weights)

    @staticmethod
    def expand_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The stacked experts one by one: `w13_weight (E, 2F, H)`, gate and up rows
        interleaved, and `w2_weight (E, H, F)`."""
        base, _, kind = name.rpartition(".")
        if not base.endswith(".mlp.experts") or kind not in ("w13_weight", "w2_weight"):
            return [(name, tensor)]
        stacked = tensor[...]  # (E, out, in)
        if kind == "w2_weight":
            return [(f"{base}.{e}.down_proj.weight", w) for e, w in enumerate(stacked)]
        return [
            (f"{base}.{e}.{part}_proj.weight", stacked[e, offset::2])
            for e in range(stacked.shape[0])
            for part, offset in (("gate", 0), ("up", 1))
        ]


class Inkling2ForConditionalGeneration(Inkling2ForCausalLM):
    """The released image-text checkpoint (`thinkingmachines/Inkling-2-Small`) served
    text-only: its `text_config`; the vision tower (`model.visual.*`) is skipped."""

    skipped_weights: ClassVar[dict[str, str]] = {
        "model.visual.": "the vision tower (served text-only)"
    }

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config.text_config, ops, tp)
