"""Per-sequence recurrent state of state-space models: the state tensors and the slot allocator.

A state-space layer keeps, for every sequence, a fixed-size state: the last `K - 1` inputs of
its causal conv and its SSM state. This module owns them for every model (Mamba, Mamba2, the
Mamba layers of hybrids): a model only describes the per-slot shapes (`MambaStateShape`).

- `SlotAllocator` is plain Python bookkeeping (no tensors), used by the scheduler: a slot is
  taken when a sequence is admitted or forked, and freed when it finishes, is aborted or is
  preempted.
- `MambaCache` holds `conv_state (layers, slots, *conv_shape)` and
  `ssm_state (layers, slots, *ssm_shape)`, and copies slots when a sequence forks.

`PAD_SLOT_ID` (-1) marks padding rows; the kernels neither read nor write them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from vllm_mamba.huge_pages import huge_page_zeros

__all__ = ["PAD_SLOT_ID", "MambaStateShape", "SlotAllocator", "MambaCache", "LayerState"]

PAD_SLOT_ID = -1  # the slot index of a padding row; every kernel imports it from here


@dataclass(frozen=True)
class MambaStateShape:
    """Per-slot state shapes of one model; e.g. Mamba: conv `(D, K-1)`, ssm `(D, N)`."""

    num_layers: int
    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    def bytes_per_slot(self) -> int:
        """State bytes one sequence holds across all layers."""

        def numel(shape: tuple[int, ...]) -> int:
            n = 1
            for s in shape:
                n *= s
            return n

        conv = numel(self.conv_shape) * self.conv_dtype.itemsize
        ssm = numel(self.ssm_shape) * self.ssm_dtype.itemsize
        return self.num_layers * (conv + ssm)


class SlotAllocator:
    """Hands out state slot indices `0 .. num_slots - 1`; lowest free slot first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a min-heap: the lowest free slot first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Slots that can be allocated now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots held by sequences."""
        return len(self._used)

    def allocate(self) -> int:
        """Takes a free slot.

        Raises:
            RuntimeError: no slot is free (the scheduler checks `num_free` first).
        """
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Returns `slot` to the pool."""
        assert slot in self._used, f"slot {slot} is not allocated"
        self._used.remove(slot)
        heapq.heappush(self._free, slot)


@dataclass
class LayerState:
    """The state tensors of one layer: `conv (S, *conv_shape)`, `ssm (S, *ssm_shape)`."""

    conv: torch.Tensor
    ssm: torch.Tensor


class MambaCache:
    """The state tensors of all layers and slots of one model."""

    def __init__(self, shape: MambaStateShape, num_slots: int, device: torch.device) -> None:
        self.shape = shape
        self.num_slots = num_slots
        self.conv_state = huge_page_zeros(
            (shape.num_layers, num_slots, *shape.conv_shape), shape.conv_dtype, device
        )
        self.ssm_state = huge_page_zeros(
            (shape.num_layers, num_slots, *shape.ssm_shape), shape.ssm_dtype, device
        )

    def layer(self, index: int) -> LayerState:
        """Views of layer `index`'s state over all slots."""
        return LayerState(conv=self.conv_state[index], ssm=self.ssm_state[index])

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copies the state of slots `src[i]` into `dst[i]` in every layer (a fork)."""
        if not src:
            return
        device = self.conv_state.device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        self.conv_state[:, dst_t] = self.conv_state[:, src_t]
        self.ssm_state[:, dst_t] = self.ssm_state[:, src_t]

    def nbytes(self) -> int:
        """Bytes of all state tensors."""
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state))
