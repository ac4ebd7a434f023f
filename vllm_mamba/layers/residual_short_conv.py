"""`ResidualShortConv`: a depthwise causal conv added to its own input, over one flat varlen
batch (decodes first, then prefill chunks): the Inkling families' four convs per layer (over
the keys and values before the attention, over the attention's and the feed-forward's outputs).

    y = (x + conv(x)) / out_divisor        # per channel, float32, cast back to x's dtype

`conv` is depthwise (one filter of K taps per channel, `conv1d.weight (D, 1, K)`), causal,
without bias or activation, and starts from each sequence's saved history: the per-sequence
state is `conv (D, K - 1)`, the last K - 1 inputs, kept in float32 whatever the model dtype (as
transformers keeps these convs and their states). `out_divisor` is 1 in Inkling and
`sqrt(K + 1)` in Inkling 2. The conv runs on the op family `causal_conv1d` (its `update`
for the decode rows and `varlen` for the prefill chunks, no activation) through
`recurrent_step`, so speculative waves, padding and chunked prefill are the engine's.

A looped layer (Inkling 2 Loop) runs several times per step over the same tokens, each pass
with its own history (`passes`: state tensors `conv`, `conv_pass1`, ...).

Tensor parallelism: the channels follow what they convolve (`ranges`: this rank's key/value
heads' channels); a conv over the hidden state is replicated on every rank.

Glossary: T tokens in the step, D channels (this rank's), K conv width, S state slots.
"""

from __future__ import annotations

import torch

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.mixer_base import Conv1dWeights, causal_conv
from vllm_mamba.layers.parallel_linear import Ranges, shard_param
from vllm_mamba.ops.table import MambaOps


def pass_state_names(passes: int) -> tuple[str, ...]:
    """The state names of a conv run `passes` times per step: `conv`, `conv_pass1`, ..."""
    return ("conv", *(f"conv_pass{p}" for p in range(1, passes)))


class ResidualShortConv(StatefulLayer):
    """`(x + conv(x)) / out_divisor` (see the module docstring)."""

    def __init__(
        self,
        channels: int,
        kernel: int,
        ops: MambaOps,
        *,
        out_divisor: float = 1.0,
        ranges: Ranges | None = None,
        passes: int = 1,
    ) -> None:
        """Args: `channels` D over all ranks, `kernel` K, `ranges` this rank's channels
        (global `(start, length)` pairs; None: all of them), `passes` how many times a step
        runs the layer (a looped layer: one history per pass, `pass_state_names`)."""
        super().__init__()
        if kernel < 2:
            raise ValueError(f"conv_kernel_size ({kernel}) must be at least 2")
        local = channels if ranges is None else sum(n for _, n in ranges)
        self.ops = ops
        self.channels, self.kernel = local, kernel
        self.out_divisor = float(out_divisor)
        self.state_names = pass_state_names(passes)
        self.conv1d = Conv1dWeights(local, kernel, bias=False)
        if ranges is not None:
            shard_param(self.conv1d, "weight", 0, ranges, channels)
        self.register_buffer("conv_weight", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        """Precomputes the float32 `(D, K)` filters."""
        self.conv_weight = self.conv1d.weight.detach()[:, 0, :].float().contiguous()

    def state_spec(self) -> StateSpec:
        """The conv history `(D, K - 1)`, float32, of each pass."""
        shape = (self.channels, self.kernel - 1)
        return StateSpec(
            tuple(StateTensor(n, shape, "conv", torch.float32) for n in self.state_names)
        )

    def forward(self, x: torch.Tensor, meta: MambaMetadata, pass_index: int = 0) -> torch.Tensor:
        """`x (T, D)` -> `(T, D)` in x's dtype; each sequence's history of pass `pass_index`
        advanced in place."""
        xf = x.float()
        states = self.state[self.state_names[pass_index]]
        y = causal_conv(
            self.ops, xf, self.conv_weight, None, states, meta, activation=False
        )  # (T, D) float32
        out = xf + y
        return (out if self.out_divisor == 1.0 else out / self.out_divisor).to(x.dtype)
