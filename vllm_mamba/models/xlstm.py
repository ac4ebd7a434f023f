"""xLSTM (`xLSTMForCausalLM`: `NX-AI/xLSTM-7b`): mLSTM blocks, each with a gated
feed-forward.

Every block (`backbone.blocks.N`, this engine's `backbone.layers.N`) is pre-norm twice with
RMSNorms (`norm_eps`; with `use_bias` they add a bias) and plain residuals:

    h = h + mlstm_layer(norm_mlstm(h))   # layers.mlstm.MLSTMLayer: exponential gates,
                                         # matrix memory C (NH, Dk, Dv), normaliser, stabiliser
    h = h + ffn(norm_ffn(h))             # proj_down(silu(proj_up_gate(x)) * proj_up(x))

- The mLSTM's widths are `int(H * qk_dim_factor)` (queries, keys) and `int(H * v_dim_factor)`
  (values, output gate) over `num_heads` heads; its gates are soft-capped at `gate_soft_cap`,
  its denominator's epsilon is `eps`.
- The feed-forward's width is `H * ffn_proj_factor` rounded up to a multiple of
  `ffn_round_up_to_multiple_of` (transformers' `(x + m - 1) // m * m`); SiLU; biases with
  `use_bias`.
- The final norm (`backbone.out_norm`, always applied, whatever `add_out_norm` says) has no
  bias; the head `lm_head` is never tied to the embedding `backbone.embeddings` (transformers'
  xLSTM does not tie, whatever `tie_word_embeddings` says); the logits are soft-capped:
  `cap * tanh(logits / cap)` (`output_logit_soft_cap`).

Checkpoints: `weight_mode="single"` (the 7B's) names each projection (`q`, `k`, `v`,
`ogate_preact`, `igate_preact`, `fgate_preact`; `proj_up_gate`, `proj_up`, `proj_down`, which
load as `layers.mlp.GatedMLP`'s `gate_proj`, `up_proj`, `down_proj`); `weight_mode="fused"`
stacks them (`qkv_opreact` `[q | k | v | o]`, `ifgate_preact` `[i | f]`, `proj_up_gate_z`
`[gate | up]`), split on load. The states run in float32 whatever
`inference_state_dtype` says (statistics of every norm too, `norm_reduction_force_float32`);
`chunk_size` and `max_inference_chunksize` change only how transformers groups the same sums.
xLSTM-7B: 32 blocks of hidden size 4096, 8 heads (Dk 256, Dv 512), feed-forward 10944,
vocabulary 50304.

Tensor parallelism (`tp`): the mLSTM by heads, the feed-forward column- then row-parallel;
vocabulary-parallel embedding and head.

Glossary: H hidden size, NH heads, Dk / Dv query-key / value head dims.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.decoder_layer import DecoderLayer, MixerPart
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.mlstm import MLSTMLayer
from vllm_mamba.layers.packed_weights import rows_of
from vllm_mamba.models.causal_lm import CausalLM, StackNames
from vllm_mamba.ops.table import MambaOps

NAMES = StackNames(prefix="backbone", embeddings="embeddings", final_norm="out_norm")
_FFN = {"proj_up_gate": "gate_proj", "proj_up": "up_proj", "proj_down": "down_proj"}
_FFN_NAME = re.compile(r"\.ffn\.(proj_up_gate|proj_up|proj_down)\.")
# fused checkpoint tensor -> the parts it stacks, in row order
_FUSED = {
    "mlstm_layer.qkv_opreact": ("q", "k", "v", "ogate_preact"),
    "mlstm_layer.ifgate_preact": ("igate_preact", "fgate_preact"),
    "ffn.proj_up_gate_z": ("proj_up_gate", "proj_up"),
}


class BiasedRMSNorm(RMSNorm):
    """xLSTM's block norms with `use_bias`: `RMSNorm(x) + bias`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of `x (..., hidden)` and adds the bias."""
        return super().forward(x) + self.bias


def ffn_size(config: Any) -> int:
    """The feed-forward width: `H * ffn_proj_factor` rounded as transformers rounds it."""
    multiple = config.ffn_round_up_to_multiple_of
    return int((config.hidden_size * config.ffn_proj_factor + multiple - 1) // multiple * multiple)


def _widths(config: Any) -> tuple[int, int]:
    """The mLSTM's query/key and value widths (transformers' `xLSTMLayer`: truncated)."""
    return int(config.hidden_size * config.qk_dim_factor), int(
        config.hidden_size * config.v_dim_factor
    )


def _layer(config: Any, ops: MambaOps, tp: TensorParallel) -> nn.Module:
    """Norm, mLSTM, residual; norm, gated feed-forward, residual."""
    hidden, eps, bias = config.hidden_size, config.norm_eps, bool(config.use_bias)
    norm_cls = BiasedRMSNorm if bias else RMSNorm
    qk_dim, v_dim = _widths(config)
    mixer = MLSTMLayer(
        hidden, config.num_heads, qk_dim, v_dim, use_bias=bias,
        gate_soft_cap=float(config.gate_soft_cap), norm_eps=eps, eps=config.eps, ops=ops, tp=tp,
    )  # fmt: skip
    return DecoderLayer(
        norm=("norm_mlstm", norm_cls(hidden, eps=eps)),
        mixers=[MixerPart("mlstm_layer", mixer)],
        ffn_norm=("norm_ffn", norm_cls(hidden, eps=eps)),
        ffns=[("ffn", GatedMLP(hidden, ffn_size(config), bias, ops, tp, act="silu"))],
    )


class XLSTMForCausalLM(CausalLM):
    """xLSTM: mLSTM blocks with gated feed-forwards (see the module docstring)."""

    ties_word_embeddings: ClassVar[bool] = False

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__(
            config, ops, tp, names=NAMES,
            layers=[_layer(config, ops, tp) for _ in range(config.num_hidden_layers)],
            norm_eps=config.norm_eps,
        )  # fmt: skip
        self.soft_cap = float(config.output_logit_soft_cap)
        qk_dim, v_dim = _widths(config)
        heads, ffn = config.num_heads, ffn_size(config)
        self._fused_rows = {
            "mlstm_layer.qkv_opreact": (qk_dim, qk_dim, v_dim, v_dim),
            "mlstm_layer.ifgate_preact": (heads, heads),
            "ffn.proj_up_gate_z": (ffn, ffn),
        }

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """`backbone.blocks.N` onto `backbone.layers.N`; the feed-forward's projections onto
        `GatedMLP`'s names."""
        name = name.replace("backbone.blocks.", "backbone.layers.", 1)
        return _FFN_NAME.sub(lambda m: f".ffn.{_FFN[m[1]]}.", name)

    def expand_weight(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """A fused checkpoint's stacked projections (weights and biases) as the single ones."""
        base, _, kind = name.rpartition(".")
        fused = next((f for f in _FUSED if base.endswith(f)), None)
        if fused is None:
            return [(name, tensor)]
        whole = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
        rows = self._fused_rows[fused]
        if whole.shape[0] != sum(rows):
            return [(name, whole)]  # left for the loader to name as unexpected
        stem = base[: -len(fused)] + fused.split(".")[0]
        parts, start = [], 0
        for part, count in zip(_FUSED[fused], rows):
            parts.append((f"{stem}.{part}.{kind}", rows_of(whole, slice(start, start + count))))
            start += count
        return parts

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`cap * tanh(logits / cap)` (float32 `(R, V)`)."""
        return torch.tanh(logits / self.soft_cap) * self.soft_cap
