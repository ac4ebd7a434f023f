"""The image side of a step in the worker: each image's encoder output, computed in the first
step that needs it and kept by content hash, and the rows of the step's flat batch it fills.

A request's image reaches the worker with every prefill chunk that covers some of its
positions (`step.StepImage`); the encoder runs once per image (all the step's new images in
one call), and its output `(n, H)` stays in a least-recently-used cache bounded in bytes, so a
chunked prefill, a recompute after preemption, and another request with the same image reuse
it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from vllm_mamba.worker.step import StepImage, StepSeq

# Bytes of encoder outputs kept across steps (at least the current step's are kept).
DEFAULT_CACHE_BYTES = 256 * 2**20

EncodeFn = Callable[[list[dict[str, torch.Tensor]]], list[torch.Tensor]]


class ImageEmbeddings:
    """Encoder outputs by content hash, and each step's image rows.

    Args:
        encode: the model's encoder: the images' features -> one `(n_i, H)` tensor each.
        cache_bytes: the cache's budget.
    """

    def __init__(self, encode: EncodeFn, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.encode = encode
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.encoded = 0  # images run through the encoder (a counter for tests and stats)

    def step_rows(
        self, items: list[StepSeq], rows: dict[int, list[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(flat rows (M,), embeddings (M, H))` of the step's image tokens, or None when the
        step has none. `rows`: each sequence's rows in the flat batch, in token order."""
        wanted: list[tuple[int, StepImage, int]] = []  # (flat row, image, output row)
        for item in items:
            seq_rows = rows[item.seq_id]
            start = item.num_computed_tokens
            for image in item.images:
                for j, position in enumerate(image.positions):
                    offset = position - start
                    if 0 <= offset < len(seq_rows):
                        wanted.append((seq_rows[offset], image, j))
        if not wanted:
            return None
        outputs = self._outputs({image.content_hash: image for _, image, _ in wanted})
        flat = torch.tensor([r for r, _, _ in wanted], dtype=torch.long, device=device)
        values = torch.stack([outputs[image.content_hash][j] for _, image, j in wanted])
        return flat, values.to(device)  # (M,), (M, H)

    def _outputs(self, images: dict[str, StepImage]) -> dict[str, torch.Tensor]:
        """Each image's encoder output, running the encoder on those not cached."""
        missing = [image for key, image in images.items() if key not in self._cache]
        fresh: dict[str, torch.Tensor] = {}
        if missing:
            encoded = self.encode([image.features for image in missing])
            for image, out in zip(missing, encoded):
                expected = len(image.positions)
                if out.shape[0] != expected:
                    raise ValueError(
                        f"the vision encoder gave {out.shape[0]} rows for an image with "
                        f"{expected} placeholder tokens"
                    )
                fresh[image.content_hash] = out
            self.encoded += len(missing)
        found = {}
        for key in images:
            if key in fresh:
                found[key] = fresh[key]
            else:
                self._cache.move_to_end(key)
                found[key] = self._cache[key]
        for key, out in fresh.items():
            self._store(key, out, keep=set(images))
        return found

    def _store(self, key: str, out: torch.Tensor, keep: set[str]) -> None:
        """Caches `out`, evicting the least recently used outputs not in `keep` over budget."""
        size = out.numel() * out.element_size()
        self._cache[key] = out
        self._bytes += size
        for old in list(self._cache):
            if self._bytes <= self.cache_bytes:
                break
            if old in keep:
                continue
            gone = self._cache.pop(old)
            self._bytes -= gone.numel() * gone.element_size()
