"""Liquid LFM2-VL (`Lfm2VlForConditionalGeneration`: `LiquidAI/LFM2-VL-450M`, `-1.6B`, ...; LFM2's
language model with an image input).

The checkpoint keeps the language model under `model.language_model.*` (renamed to `model.*`
and then read as `Lfm2ForCausalLM` reads its own names: `feed_forward.w1` / `w3` / `w2`,
`q_layernorm`, `out_proj`, ...), its config under `text_config` (`lfm2`, or `lfm2_moe`: the
feed-forwards are then LFM2-MoE's, as transformers builds any text config with
`AutoModel.from_config`), and the head at `lm_head`, tied to the embedding by the top-level
`tie_word_embeddings` (the default; the older `tie_embedding`, which transformers' config reads
as it; a tied checkpoint has no `lm_head.weight`).

The image side (`models.vision.lfm2_vl`: the SigLIP2 NaFlex tower and the projector) lives
under two prefixes, `model.vision_tower.*` and `model.multi_modal_projector.*`; both load into
the encoder module `visual` (`visual.vision_tower.*`, `visual.multi_modal_projector.*`, through
`Lfm2VlVisionEncoder.checkpoint_name`: the released files' older `vision_tower.vision_model.*`
spelling read as transformers 5's `vision_tower.*`) when images are served
(`models.image_text.SupportsImages`, `image_prefixes`), and are skipped when the model is
served text-only (`language_model_only`). SigLIP2's pooling head (`vision_tower.head.*`, in
either spelling), which LFM2-VL never runs, is always skipped.

As transformers' `Lfm2VlModel.forward`: each image's projected rows (its tiles row by row, then
its thumbnail) replace the input embeddings of its `<image>` tokens, and the language model runs
on plain 1-D positions (no M-RoPE).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from torch import nn

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.models.image_text import SupportsImages
from vllm_mamba.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from vllm_mamba.models.vision.lfm2_vl import Lfm2VlImageProcessor, Lfm2VlVisionEncoder
from vllm_mamba.ops.table import MambaOps

_TEXT_ONLY = "served text-only: language_model_only"
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
# `checkpoint_name` drops the pooling head: skipped, in both spellings, images or not (listed
# after the tower, so that text-only the tower's prefix counts them).
HEAD_PREFIXES = ("model.vision_tower.head.", "model.vision_tower.vision_model.head.")
SKIPPED = {
    "model.vision_tower.": f"the vision tower ({_TEXT_ONLY})",
    "model.multi_modal_projector.": f"the multimodal projector ({_TEXT_ONLY})",
    **dict.fromkeys(HEAD_PREFIXES, "SigLIP2's pooling head (LFM2-VL never runs it)"),
}
TEXT_TYPES = ("lfm2", "lfm2_moe")


class Lfm2VlForConditionalGeneration(SupportsImages, Lfm2ForCausalLM):
    """The image-text checkpoint: LFM2 (or LFM2-MoE) from its `text_config`, the head tied by
    the top-level `tie_word_embeddings`; the LFM2-VL vision tower and projector as `visual`
    unless served text-only (see the module docstring).

    Raises:
        ValueError: a `text_config` that is neither LFM2 nor LFM2-MoE.
    """

    image_prefixes: ClassVar[tuple[str, ...]] = VISION_PREFIXES
    image_module: ClassVar[str] = "visual"
    uses_mrope: ClassVar[bool] = False
    skipped_weights: ClassVar[dict[str, str]] = SKIPPED

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        text = copy.copy(config.text_config)
        kind = getattr(text, "model_type", "lfm2")
        if kind not in TEXT_TYPES:
            raise ValueError(
                f"LFM2-VL: text_config model_type {kind!r} is not supported "
                f"({', '.join(TEXT_TYPES)})"
            )
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        super().__init__(text, ops, tp)
        self.vl_config = config

    @staticmethod
    def _ffn(config: Any, index: int, ops: MambaOps, tp: TensorParallel) -> nn.Module:
        """Layer `index`'s feed-forward: LFM2-MoE's for an `lfm2_moe` text config, else LFM2's."""
        text_cls = Lfm2MoeForCausalLM if config.model_type == "lfm2_moe" else Lfm2ForCausalLM
        return text_cls._ffn(config, index, ops, tp)

    def build_image_encoder(self, ops: MambaOps) -> Lfm2VlVisionEncoder:
        """The vision tower and projector, from the top-level config."""
        return Lfm2VlVisionEncoder(self.vl_config, ops)

    @classmethod
    def image_processor(
        cls, model_dir: str, hf_config: Any, tokenizer: Any, overrides: dict[str, Any]
    ) -> Lfm2VlImageProcessor:
        """The checkpoint's image processor (`processor_config.json`, else
        `preprocessor_config.json`), with the `mm_processor_kwargs` `overrides`
        (`do_image_splitting`, `max_image_tokens`, `use_image_special_tokens`, ...)."""
        return Lfm2VlImageProcessor.from_pretrained(model_dir, tokenizer, hf_config, **overrides)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """`model.vision_tower.*` / `model.multi_modal_projector.*` onto `visual.*` (either
        spelling of the tower onto the encoder's), `model.language_model.*` onto `model.*` as
        LFM2 maps its names. The pooling head never gets here (`skipped_weights`)."""
        if name.startswith(VISION_PREFIXES):
            mapped = Lfm2VlVisionEncoder.checkpoint_name(name[len("model.") :])
            return name if mapped is None else "visual." + mapped
        return Lfm2ForCausalLM.remap_weight_name(name.replace("model.language_model.", "model.", 1))


__all__ = ["Lfm2VlForConditionalGeneration"]
