"""`DecoderLayer`: the one decoder layer every model is built from.

A layer is up to two residual stages, each parts whose outputs are summed, with a norm
before them (pre-norm), after them (post-norm, OLMo Hybrid's attention layers) or both:

    h = pre_norm(h)                                          (RWKV's first block only)
    x = norm(h)                                              (the mixer stage)
    h = h + rm * post_norm(sum_i out_i * mixer_i(in_i * x, meta))
    y = ffn_norm(h)                                          (the feed-forward stage)
    h = h + rm * ffn_post_norm(sum_j ffn_j(y))

An absent norm is the identity; a stage with parts has at least one of its norms. A stage
may instead add its output to its normed input, both scaled (`NormedResidual`, MiniMax-Text-01's
`alpha` / `beta` factors): `h = alpha * x + beta * sum_i out_i * mixer_i(in_i * x, meta)` with
`x = norm(h)`, and likewise `h = alpha * y + beta * ffn(y)`.

A mixer is any module called `mixer(x (T, H), meta) -> (T, H)` (Mamba, Mamba2, attention, a
plugin's recurrent layer; each reaches its own cache through what the engine bound to it); a
feed-forward part is called `ffn(x (T, H)) -> (T, H)` (a dense MLP, an MoE, a shared expert),
or `ffn(x, meta)` when it keeps per-sequence state of its own (a `StatefulLayer`: RWKV's
channel mix, whose token shift reads the previous token).
Either stage may be absent (Mamba has no feed-forward; Nemotron-H's MLP layers no mixer).
`rm` is the residual multiplier (Granite), `in_i` / `out_i` the mixers' input and output
multipliers (Falcon-H1 runs attention and Mamba2 side by side). With `residual_in_fp32`
(Mamba) the residual stream is float32 and the norm sees the model dtype.

Each part is registered under the checkpoint's own name (`mixer`, `mamba`, `self_attn`,
`feed_forward`, `input_layernorm`, ...), so loading stays an identity mapping.

A layer's decode-only steps may run fused (`layers.decode_plan`); its plan, made once after
load and binding (`make_decode_plan`), takes the first of: the whole layer, when the layer is
one mixer and one stateful feed-forward part without multipliers, post-norms or a float32
residual and the mixer offers it (`fused_layer_step`: RWKV-7); the mixer stage `h + rm *
mixer(norm(h))`, when the layer is one mixer after its norm without pre- or post-norm or mixer
multipliers and the mixer offers it with that norm and residual multiplier rm
(`fused_mixer_step`: Mamba, Mamba2, attention, ...; with rm other than 1, Granite 4.0-H's, the
Mamba2 and attention blocks); one mixer's call alone (`fused_mixer_step` without a norm). A
step asks the plan only whether it is decode-only.

The feed-forward stage has a plan of its own (`make_ffn_plan`, scope `FFN`), independent of the
mixer's: `h + rm * ffn(ffn_norm(h))` in one kernel call when the stage is one dense gated MLP
(`layers.mlp.plan_mlp`), one MoE with or without its shared expert, or an MoE followed by an
ungated shared MLP (`layers.moe.plan_moe`), after a plain or zero-centred `RMSNorm`, without a
post-norm, per-sequence state or a float32 residual (the residual multiplier and the MLP's
multipliers are in the kernel). Its step takes decode-only steps of up to 8 rows. A stage
with a `NormedResidual` is planned as its mixer alone (the mixer stage) or not at all (the
feed-forward stage).

A layer with several residual streams (GLM-5-Next's mHC) carries `h (T, N, H)` and takes
one `StreamConnection` per stage (`hyper`, under the checkpoint's names: GLM-5-Next's mHC
`attn_hc` / `ffn_hc`, Qwen4-Exp's gated `attn_hyper_connection` / `mlp_hyper_connection`):
each stage collapses the streams to its input, `x, ctx = c.collapse(h)`, and mixes its output
back, `h = c.expand(f(norm(x)), ctx, h)` (`layers.hyper_connection`); its norms are optional
(Qwen4-Exp's connections norm the streams themselves). Such a layer runs its mixer's fused step
alone (scope `MIXER`), never the block or layer plans; its feed-forward plan, when the stage is
one MoE or gated MLP, is the stage alone between the connection's ends (`moe_decode` /
`mlp_decode` without the residual, and without a norm where the stage has none). It may take an
`injection` before its first stage that reads the step's token ids (Qwen4-Exp's per-layer
n-gram embeddings, a stateful layer): `h = h + injection(h, tokens, meta)`; such a layer
`reads_tokens` and the model calls it `layer(hidden, meta, tokens=input_ids)`.

Glossary: T tokens in the step, H hidden size, N residual streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.decode_plan import DecodePlan, DecodeScope, PlannedLayer
from vllm_mamba.layers.hyper_connection import StreamConnection
from vllm_mamba.layers.mlp import plan_mlp
from vllm_mamba.layers.moe import SparseMoE, plan_moe

Named = tuple[str, nn.Module]


@dataclass(frozen=True)
class NormedResidual:
    """A stage whose residual is its normed input: `h = alpha * norm(h) + beta * out`."""

    alpha: float = 1.0
    beta: float = 1.0


@dataclass(frozen=True)
class MixerPart:
    """A mixer under its checkpoint name, with its input and output multipliers."""

    name: str
    module: nn.Module
    in_scale: float = 1.0
    out_scale: float = 1.0


class DecoderLayer(PlannedLayer):
    """One decoder layer built from parts (see the module docstring)."""

    def __init__(
        self,
        *,
        norm: Named | None = None,
        mixers: Sequence[MixerPart] = (),
        ffn_norm: Named | None = None,
        ffns: Sequence[Named] = (),
        residual_multiplier: float = 1.0,
        residual_in_fp32: bool = False,
        post_norm: Named | None = None,
        ffn_post_norm: Named | None = None,
        pre_norm: Named | None = None,
        normed_residuals: tuple[NormedResidual | None, NormedResidual | None] = (None, None),
        hyper: tuple[Named, Named] | None = None,
        injection: Named | None = None,
    ) -> None:
        super().__init__()
        for parts, norms in ((mixers, (norm, post_norm)), (ffns, (ffn_norm, ffn_post_norm))):
            normed = any(n is not None for n in norms) or (hyper is not None and bool(parts))
            if bool(parts) != normed:
                raise ValueError(
                    "each stage of a decoder layer needs its parts and a norm before or after them"
                )
        self._norm_name, self._post_norm_name, self._ffn_norm_name, self._ffn_post_norm_name = (
            n[0] if n is not None else None for n in (norm, post_norm, ffn_norm, ffn_post_norm)
        )
        assert not residual_in_fp32 or norm is not None, "a float32 residual needs the pre-norm"
        self._pre_norm_name = pre_norm[0] if pre_norm is not None else None
        for named in (pre_norm, norm, post_norm, ffn_norm, ffn_post_norm):
            if named is not None:
                self.add_module(*named)
        self._mixers = [(p.name, p.in_scale, p.out_scale) for p in mixers]
        for part in mixers:
            self.add_module(part.name, part.module)
        self._ffn_names = [name for name, _ in ffns]
        self._ffn_with_state = {name for name, m in ffns if isinstance(m, StatefulLayer)}
        for name, module in ffns:
            self.add_module(name, module)
        self.residual_multiplier = float(residual_multiplier)
        self.residual_in_fp32 = residual_in_fp32
        assert not residual_in_fp32 or normed_residuals[0] is None, "one residual rule"
        self._mixer_residual, self._ffn_residual = normed_residuals
        self._hyper_names: tuple[str, str] | None = None
        if hyper is not None:
            assert not residual_in_fp32 and normed_residuals == (None, None), "one residual rule"
            assert pre_norm is None and residual_multiplier == 1.0, "mHC streams: plain stages"
            for named in hyper:
                assert isinstance(named[1], StreamConnection), named
                self.add_module(*named)
            self._hyper_names = (hyper[0][0], hyper[1][0])
        assert injection is None or hyper is not None, "an injection goes with the streams"
        self._injection_name = injection[0] if injection is not None else None
        if injection is not None:
            self.add_module(*injection)

    @property
    def reads_tokens(self) -> bool:
        """Whether the layer's injection reads the step's token ids."""
        return self._injection_name is not None

    def _hyper(self, stage: int) -> StreamConnection | None:
        """The mHC weights of stage `stage` (0 the mixer's, 1 the feed-forward's), if any."""
        return None if self._hyper_names is None else getattr(self, self._hyper_names[stage])

    def _whole_layer_fusable(self) -> bool:
        """Whether the layer's shape lets its one mixer run the whole layer's decode steps."""
        if self._hyper_names is not None:
            return False
        if len(self._mixers) != 1 or len(self._ffn_names) != 1 or self.residual_multiplier != 1:
            return False
        if self._post_norm_name or self._ffn_post_norm_name or self.residual_in_fp32:
            return False
        if self._mixer_residual is not None or self._ffn_residual is not None:
            return False
        _, in_scale, out_scale = self._mixers[0]
        return in_scale == out_scale == 1.0 and self._ffn_names[0] in self._ffn_with_state

    def _block_fusable(self) -> bool:
        """Whether the layer's shape lets its one mixer run the mixer stage with its norm."""
        if self._hyper_names is not None:
            return False
        if len(self._mixers) != 1 or self._pre_norm_name:
            return False
        if self._norm_name is None or self._post_norm_name is not None:
            return False
        if self._mixer_residual is not None:
            return False
        _, in_scale, out_scale = self._mixers[0]
        return in_scale == out_scale == 1.0

    def make_decode_plan(self) -> DecodePlan | None:
        """The first fused step the layer's shape allows and its mixer offers (see the module
        docstring), from the weights and bound states now; None: unfused."""
        offering = [(n, getattr(self, n)) for n, _, _ in self._mixers]
        offering = [(n, m) for n, m in offering if hasattr(m, "fused_mixer_step")]
        if len(offering) == len(self._mixers) == 1:
            name, mixer = offering[0]
            if self._whole_layer_fusable() and isinstance(mixer, StatefulLayer):
                step = mixer.fused_layer_step(self)
                if step is not None:
                    return DecodePlan(DecodeScope.LAYER, step, name)
            if self._block_fusable():
                norm = getattr(self, self._norm_name)
                rm = self.residual_multiplier  # offered by the mixers whose kernel scales
                step = mixer.fused_mixer_step(norm, self.residual_in_fp32, rm)
                if step is not None:
                    return DecodePlan(DecodeScope.BLOCK, step, name)
        for name, mixer in offering:
            step = mixer.fused_mixer_step(None, False)
            if step is not None:
                return DecodePlan(DecodeScope.MIXER, step, name)
        return None

    def make_ffn_plan(self) -> DecodePlan | None:
        """The feed-forward stage's fused step where its shape allows and its parts offer it
        (see the module docstring), from the weights now; None: unfused."""
        if not self._ffn_names or self._ffn_with_state:
            return None
        if self._ffn_post_norm_name is not None or self.residual_in_fp32 or self._ffn_residual:
            return None
        parts = [getattr(self, n) for n in self._ffn_names]
        rm = self.residual_multiplier
        if self._hyper_names is not None:  # the stage alone, between its connection's ends
            if len(parts) != 1:
                return None
            norm = None if self._ffn_norm_name is None else getattr(self, self._ffn_norm_name)
            if isinstance(parts[0], SparseMoE):
                step = plan_moe(parts[0], norm, rm, residual=False)
            else:
                step = plan_mlp(parts[0], norm, rm, residual=False)
            return DecodePlan(DecodeScope.FFN, step, self._ffn_names[0]) if step else None
        if self._ffn_norm_name is None:
            return None
        norm = getattr(self, self._ffn_norm_name)
        step = None
        if len(parts) == 1 and not isinstance(parts[0], SparseMoE):
            step = plan_mlp(parts[0], norm, rm)
        elif len(parts) <= 2 and isinstance(parts[0], SparseMoE):
            step = plan_moe(parts[0], norm, rm, parts[1] if len(parts) == 2 else None)
        return DecodePlan(DecodeScope.FFN, step, self._ffn_names[0]) if step else None

    def part_names(self) -> dict[str, str | None]:
        """The registered names of the layer's norms (None where absent)."""
        return {
            "pre_norm": self._pre_norm_name, "norm": self._norm_name,
            "post_norm": self._post_norm_name, "ffn_norm": self._ffn_norm_name,
            "ffn_post_norm": self._ffn_post_norm_name,
        }  # fmt: skip

    def stateful_ffn(self) -> nn.Module:
        """The layer's first feed-forward part that keeps per-sequence state."""
        return next(getattr(self, n) for n in self._ffn_names if n in self._ffn_with_state)

    def forward(
        self, hidden: torch.Tensor, meta: object, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)` (with streams `(T, N, H)` -> `(T, N, H)`); `tokens (T,)`
        the step's token ids, for a layer that `reads_tokens`."""
        if self._injection_name is not None:
            assert tokens is not None, "this layer reads the step's token ids"
            hidden = hidden + getattr(self, self._injection_name)(hidden, tokens, meta)
        plan = self.decode_plan
        if plan is not None and not plan.step.takes(hidden, meta):
            plan = None  # not a step the fused kernel takes: the parts, unfused
        if plan is not None and plan.scope is DecodeScope.LAYER:
            return plan.step(hidden, meta)
        hidden = self._normed(self._pre_norm_name, hidden)
        if self._mixers:
            hidden = self._mix(hidden, meta, plan)
        ffn_plan = self.ffn_plan
        hc = self._hyper(1)
        if hc is None and ffn_plan is not None and ffn_plan.step.takes(hidden, meta):
            return ffn_plan.step(hidden, meta)
        if self._ffn_names:
            streams = hidden
            if hc is not None:
                hidden, ctx = hc.collapse(streams)  # (T, H) the stage's input
                if ffn_plan is not None and ffn_plan.step.takes(hidden, meta):
                    return hc.expand(ffn_plan.step(hidden, meta), ctx, streams)  # (T, N, H)
            x = self._normed(self._ffn_norm_name, hidden)
            ff = None
            for name in self._ffn_names:
                part = getattr(self, name)
                y = part(x, meta) if name in self._ffn_with_state else part(x)
                ff = y if ff is None else ff + y
            ff = self._scaled(self._normed(self._ffn_post_norm_name, ff))
            if hc is not None:
                return hc.expand(ff, ctx, streams)  # (T, N, H)
            hidden = _added(self._ffn_residual, hidden, x, ff)
        return hidden

    def _mix(self, hidden: torch.Tensor, meta: object, fused: DecodePlan | None) -> torch.Tensor:
        """The mixer stage: `h + rm * post_norm(sum_i out_i * mixer_i(in_i * norm(h)))`; with
        `fused` (this step's plan, when it takes the step) the stage or one mixer fused."""
        if fused is not None and fused.scope is DecodeScope.BLOCK:
            return fused.step(hidden, meta)
        fused_part = fused.part if fused is not None else None
        hc, streams = self._hyper(0), hidden
        if hc is not None:
            hidden, ctx = hc.collapse(streams)  # (T, H) the stage's input
        if self.residual_in_fp32:
            norm = getattr(self, self._norm_name)
            residual, x = hidden.float(), norm(hidden.to(norm.weight.dtype))
        else:
            residual, x = hidden, self._normed(self._norm_name, hidden)
        mixed = None
        for name, in_scale, out_scale in self._mixers:
            mixer = fused.step if name == fused_part else getattr(self, name)
            y = mixer(x if in_scale == 1.0 else x * in_scale, meta)
            y = y if out_scale == 1.0 else y * out_scale
            mixed = y if mixed is None else mixed + y
        mixed = self._scaled(self._normed(self._post_norm_name, mixed))
        if hc is not None:
            return hc.expand(mixed, ctx, streams)  # (T, N, H)
        return _added(self._mixer_residual, residual, x, mixed)

    def _normed(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        """`x` through the norm registered as `name` (unchanged when there is none)."""
        return x if name is None else getattr(self, name)(x)

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier


def _added(
    rule: NormedResidual | None, hidden: torch.Tensor, normed: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """A stage's new hidden state: `hidden + out`, or by its `NormedResidual` `alpha * normed +
    beta * out`."""
    if rule is None:
        return hidden + out
    return normed * rule.alpha + out * rule.beta
