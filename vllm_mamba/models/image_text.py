"""`SupportsImages`: the capability of a `CausalLM` whose checkpoints are image-text models.

The model serves images unless the engine is told `language_model_only`: `enable_images`
(called by `model_loader.build_model(..., images=True)` before the weights load) builds the
vision encoder as the submodule `image_module` and stops skipping its checkpoint prefix; the
engine builds the model's image processor (`image_processor`) on its own side. Without it the
vision tower's tensors are skipped, as before, and an image is refused at the door.

A class gives `image_prefix` (the encoder's checkpoint prefix, e.g. `model.visual.`, mapped
onto `image_module` by its `remap_weight_name`), or `image_prefixes` when the encoder's
tensors lie under several (LFM3-VL's `model.vision_tower.` and `model.multi_modal_projector.`;
it replaces `image_prefix` when given), `build_image_encoder` and `image_processor`;
`uses_mrope` says whether image tokens take 3-D rotary positions. The class's
`skipped_weights` lists the same prefixes, so a text-only model skips them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_mamba.multimodal.inputs import ImageProcessor, VisionEncoder
from vllm_mamba.ops.table import MambaOps


class SupportsImages:
    """Mixin of an image-text `CausalLM` (see the module docstring)."""

    supports_images: ClassVar[bool] = True
    image_prefix: ClassVar[str] = "model.visual."
    image_prefixes: ClassVar[tuple[str, ...]] = ()  # several prefixes; empty: `image_prefix`
    image_module: ClassVar[str] = "visual"
    uses_mrope: ClassVar[bool] = False

    def build_image_encoder(self, ops: MambaOps) -> VisionEncoder:
        """The model's vision encoder (on the current default device)."""
        raise NotImplementedError

    @classmethod
    def image_processor(
        cls, model_dir: str, hf_config: Any, tokenizer: Any, overrides: dict[str, Any]
    ) -> ImageProcessor:
        """The checkpoint's image processor, with `mm_processor_kwargs` `overrides`.

        Raises:
            ValueError: an override the processor does not take.
        """
        raise NotImplementedError

    @classmethod
    def image_weight_prefixes(cls) -> tuple[str, ...]:
        """The checkpoint prefixes of the encoder's tensors: `image_prefixes`, else
        `(image_prefix,)`."""
        return tuple(cls.image_prefixes) or (cls.image_prefix,)

    def enable_images(self, ops: MambaOps) -> VisionEncoder:
        """Builds and attaches the encoder as `image_module`, once; its checkpoint tensors
        (`image_weight_prefixes`) load from then on."""
        existing = getattr(self, self.image_module, None)
        if existing is not None:
            return existing
        encoder = self.build_image_encoder(ops)
        setattr(self, self.image_module, encoder)
        skipped = self.skipped_weights  # type: ignore[attr-defined]
        prefixes = self.image_weight_prefixes()
        self.skipped_weights = {p: w for p, w in skipped.items() if p not in prefixes}
        return encoder

    @property
    def serves_images(self) -> bool:
        """Whether the encoder is built (`enable_images`)."""
        return getattr(self, self.image_module, None) is not None

    @torch.no_grad()
    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's features -> its `(n_i, H)` input embeddings (the encoder's output in
        the language model's dtype)."""
        encoder = getattr(self, self.image_module)
        param = next(encoder.parameters())
        feats = [
            {k: (v.to(param.device, param.dtype) if v.is_floating_point() else v)
             for k, v in image.items()}
            for image in images
        ]  # fmt: skip
        return encoder.encode(feats)


__all__ = ["SupportsImages"]
