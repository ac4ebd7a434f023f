"""Inkling 2 Loop (`Inkling2LoopForCausalLM`: the language model of
`thinkingmachines/Inkling-2-Mini`).

Inkling 2 (`models.inkling2`) whose layers `[loop_layer_index_start, loop_layer_index_end)`
(block boundaries) run `loop_num_passes` times per step over the same tokens:

    h, blocks = layers[:start](embeddings)
    entry = h, blocks
    h, blocks = layers[start:end](h, blocks)                          # pass 0
    for p in 1 .. passes - 1:                                         # from the loop's entry,
        h, blocks = layers[start:end](*entry, messages of pass p - 1) # with messages
    h, blocks = layers[end:](h, blocks)

Each pass of a looped layer has its own KV cache and conv histories (the engine holds them as
one more attention layer and more state tensors per pass), and in the passes after the first
its four inputs (query, key, value, MLP) are gated with messages read from the previous pass's
block states and last output (`layers.loop_messages`): `message_input` (the release's
`middle_cycle_cross_pass_queries` and `..._kv_queries`) and the layers'
`{q,k,v,mlp}_message_gate` (the release's `controllers.{attn,k,v,mlp}.{down,forget,gain}_weight`).

The release's experts are NVFP4 / MXFP8 blocks; as transformers does, they are read as float
experts (`models.prequantized.stacked_experts`), as are float `w13_weight` / `w2_weight` (what
`save_pretrained` writes back).

Glossary: T tokens, H hidden size, B blocks.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.loop_messages import MessageInput
from vllm_mamba.models.inkling2 import (
    Inkling2ForCausalLM,
    Inkling2ForConditionalGeneration,
    run_layers,
)
from vllm_mamba.ops.table import MambaOps

_RENAMED = (  # the release's loop names -> this model's, before Inkling 2's
    (r"^model\.llm\.middle_cycle_cross_pass_queries$", "model.message_input.queries"),
    (r"^model\.llm\.middle_cycle_cross_pass_kv_queries$", "model.message_input.kv_queries"),
    (r"\.controllers\.attn\.", ".q_message_gate."),
    (r"\.controllers\.(k|v|mlp)\.", r".\1_message_gate."),
    (r"_message_gate\.down_weight$", "_message_gate.down_proj.weight"),
    (r"_message_gate\.gain_weight$", "_message_gate.message_gate_proj.weight"),
    (r"_message_gate\.forget_weight$", "_message_gate.forget_gate_proj.weight"),
)


def loop_plan(config: Any) -> tuple[int, int, int]:
    """`(start, end, passes)` of the looped layers, checked as transformers does.

    Raises:
        ValueError: a loop that does not start and end at block boundaries after layer 0, or
            fewer than one pass.
    """
    start, end = config.loop_layer_index_start, config.loop_layer_index_end
    passes, block = config.loop_num_passes, config.n_layers_per_attn_res_block
    if passes < 1 or start <= 0 or start % block or end % block or not start < end:
        raise ValueError(
            f"the looped layers [{start}, {end}) must start after layer 0 and both ends be "
            f"multiples of n_layers_per_attn_res_block ({block}), with loop_num_passes "
            f"({passes}) at least 1"
        )
    if end > config.num_hidden_layers:
        raise ValueError(
            f"loop_layer_index_end ({end}) is past the {config.num_hidden_layers} layers"
        )
    return start, end, passes


class Inkling2LoopForCausalLM(Inkling2ForCausalLM):
    """Inkling 2 with looped layers (see the module docstring)."""

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, ops, tp)
        self.loop = loop_plan(config)
        start, end, _ = self.loop
        self.stack.message_input = MessageInput(config.hidden_size, end - start)

    @staticmethod
    def _passes(config: Any, index: int) -> int:
        """`loop_num_passes` for the looped layers, else 1."""
        start, end, passes = loop_plan(config)
        return passes if start <= index < end else 1

    def forward(self, input_ids: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Runs the step's tokens `input_ids (T,)` through the layers and the loop's passes;
        returns the normed hidden states `(T, H)`."""
        (start, end, passes), layers = self.loop, self.stack.layers
        hidden, blocks = run_layers(layers[:start], *self.embed(input_ids), meta)
        entry, skip = (hidden, blocks), blocks.shape[1] + 1  # + the loop's own first block
        hidden, blocks = run_layers(layers[start:end], hidden, blocks, meta)
        for pass_index in range(1, passes):
            messages = partial(self.stack.message_input, blocks[:, skip:], hidden)
            hidden, blocks = run_layers(layers[start:end], *entry, meta, pass_index, messages)
        return self.finish(*run_layers(layers[end:], hidden, blocks, meta))

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """The release's loop names, then Inkling 2's (see the module docstring)."""
        for pattern, new in _RENAMED:
            name = re.sub(pattern, new, name)
        return Inkling2ForCausalLM.remap_weight_name(name)


class Inkling2LoopForConditionalGeneration(Inkling2LoopForCausalLM):
    """The released image-text checkpoint (`thinkingmachines/Inkling-2-Mini`) served
    text-only: its `text_config`; the vision tower (`model.visual.*`) is skipped."""

    skipped_weights = Inkling2ForConditionalGeneration.skipped_weights

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config.text_config, ops, tp)
