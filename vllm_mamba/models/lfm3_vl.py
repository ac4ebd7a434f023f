"""Liquid LFM3-VL (`Lfm3VlForConditionalGeneration`: LFM3's language model with an image input).

The checkpoint keeps the language model under `model.language_model.*` (renamed to `model.*`
and then read as `Lfm3ForCausalLM` reads its own names: `feed_forward.w1` / `w3` / `w2`, the
attention gate saved as `self_attn.gate_proj`), its config under `text_config`, and the head at
`lm_head`, tied to the embedding by the top-level `tie_word_embeddings` (the default, as
transformers' `_tied_weights_keys`; a tied checkpoint has no `lm_head.weight`).

The image side (`models.vision.lfm3_vl`) lives under two prefixes, `model.vision_tower.*` and
`model.multi_modal_projector.*`; both load into the encoder module `visual`
(`visual.vision_tower.*`, `visual.multi_modal_projector.*`, through
`Lfm3VlVisionEncoder.checkpoint_name`, since the files spell `patchifier`, `q_layernorm`,
`k_layernorm` for `patch_embed`, `q_norm`, `k_norm`) when images are served
(`models.image_text.SupportsImages`, `image_prefixes`), and are skipped when the model is
served text-only (`language_model_only`).

As transformers' `Lfm3VlModel.forward`: each image's projected rows replace the input
embeddings of its image tokens (`<|image_pad|>`, which the processor repeats once per merged
patch), and the language model runs on plain 1-D positions (no M-RoPE).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.models.image_text import SupportsImages
from vllm_mamba.models.lfm3 import Lfm3ForCausalLM
from vllm_mamba.models.vision.lfm3_vl import (
    Lfm3VlImageProcessor,
    Lfm3VlVisionEncoder,
)
from vllm_mamba.ops.table import MambaOps

_TEXT_ONLY = "served text-only: language_model_only"
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
SKIPPED = {
    "model.vision_tower.": f"the vision tower ({_TEXT_ONLY})",
    "model.multi_modal_projector.": f"the multimodal projector ({_TEXT_ONLY})",
}


class Lfm3VlForConditionalGeneration(SupportsImages, Lfm3ForCausalLM):
    """The image-text checkpoint: LFM3 from its `text_config`, the head tied by the top-level
    `tie_word_embeddings`; the LFM3-VL vision tower and projector as `visual` unless served
    text-only (see the module docstring)."""

    image_prefixes: ClassVar[tuple[str, ...]] = VISION_PREFIXES
    image_module: ClassVar[str] = "visual"
    uses_mrope: ClassVar[bool] = False
    skipped_weights: ClassVar[dict[str, str]] = SKIPPED

    def __init__(self, config: Any, ops: MambaOps, tp: TensorParallel = SINGLE) -> None:
        text = copy.copy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        super().__init__(text, ops, tp)
        self.vl_config = config

    def build_image_encoder(self, ops: MambaOps) -> Lfm3VlVisionEncoder:
        """The vision tower and projector, from the top-level config."""
        return Lfm3VlVisionEncoder(self.vl_config, ops)

    @classmethod
    def image_processor(
        cls, model_dir: str, hf_config: Any, tokenizer: Any, overrides: dict[str, Any]
    ) -> Lfm3VlImageProcessor:
        """The checkpoint's image processor (`processor_config.json`), with the
        `mm_processor_kwargs` `overrides` (`min_pixels`, `max_pixels`, `size`)."""
        return Lfm3VlImageProcessor.from_pretrained(model_dir, tokenizer, hf_config, **overrides)

    @staticmethod
    def remap_weight_name(name: str) -> str:
        """`model.vision_tower.*` / `model.multi_modal_projector.*` onto `visual.*` (the files'
        spellings onto the encoder's), `model.language_model.*` onto `model.*` as LFM3 maps
        its names."""
        if name.startswith(VISION_PREFIXES):
            return "visual." + Lfm3VlVisionEncoder.checkpoint_name(name[len("model.") :])
        return Lfm3ForCausalLM.remap_weight_name(name.replace("model.language_model.", "model.", 1))


__all__ = ["Lfm3VlForConditionalGeneration"]
