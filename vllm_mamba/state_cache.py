"""Per-sequence recurrent state of every recurrent layer: the state tensors and the slot allocator.

A recurrent layer keeps, for every sequence, a fixed-size state, declared by the layer as a
`StateSpec` (named tensors: Mamba's conv history and SSM state, a delta rule's matrix, a
plugin's own). This module owns those tensors for every model; it knows no names but the
specs'.

- `SlotAllocator` is plain Python bookkeeping (no tensors), used by the scheduler: a slot is
  taken when a sequence is admitted or forked, and freed when it finishes, is aborted or is
  preempted.
- `SlotLayout` is where each kind of slot lives: `[sequences | prefix snapshots | spare]`,
  counted once by the engine and read by everyone who indexes a slot (the scheduler's
  allocator, the prefix cache, the runner's speculative waves).
- `StateCache` allocates, for each group of layers with the same spec, one tensor per named
  state `(layers_in_group, slots, *shape)`; layer `i` sees `(slots, *shape)` views
  (`layer(i)`, bound to the layer by `bind`). Forks, prefix snapshots and preemption copy
  slots through `copy_slots`, over every tensor of every group.

The same cache serves every recurrent family (Mamba, Mamba2, Gated DeltaNet, KDA, RWKV, short
conv, a plugin's own); `vllm_mamba.mamba_cache` keeps the old name `MambaCache` as an alias.

`PAD_SLOT_ID` (-1, in `vllm_mamba.cache_specs`) marks padding rows; the kernels neither read
nor write them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import nn

from vllm_mamba.cache_specs import StateSpec
from vllm_mamba.layers.cache_layers import LayerState, stateful_layers
from vllm_mamba.layers.decode_plan import plan_decode
from vllm_mamba.worker.huge_pages import huge_page_zeros

__all__ = ["SlotAllocator", "SlotLayout", "StateCache", "state_specs_of"]


@dataclass(frozen=True)
class SlotLayout:
    """The state cache's slots, in three regions: `[sequences | snapshots | spare]`.

    - sequences `0 .. num_sequences - 1`: one per running sequence (`SlotAllocator`);
    - snapshots `snapshot_base ..`: prefix-cache snapshots (0 without prefix caching);
    - spare `spare_base ..`: speculative decoding's, `max_drafts` per chain for up to
      `num_chains` chains; chain c saves its state after position w in `spare_slot(c, w)`.

    Args:
        num_sequences: slots for sequences (`num_state_slots`).
        num_snapshots: prefix-cache snapshot slots.
        num_chains: sequences that may speculate in one step.
        max_drafts: spare slots per chain (`num_speculative_tokens`; 0 without speculation).
    """

    num_sequences: int
    num_snapshots: int = 0
    num_chains: int = 0
    max_drafts: int = 0

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise ValueError(f"num_sequences must be >= 1, got {self.num_sequences}")
        for name in ("num_snapshots", "num_chains", "max_drafts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def snapshot_base(self) -> int:
        """The first snapshot slot."""
        return self.num_sequences

    @property
    def spare_base(self) -> int:
        """The first spare slot."""
        return self.num_sequences + self.num_snapshots

    @property
    def num_spare(self) -> int:
        """Spare slots (chains times drafts)."""
        return self.num_chains * self.max_drafts

    @property
    def num_slots(self) -> int:
        """All slots the state cache allocates."""
        return self.spare_base + self.num_spare

    def snapshot_slot(self, index: int) -> int:
        """The state-cache slot of snapshot `index` (0-based within the snapshots)."""
        if not 0 <= index < self.num_snapshots:
            raise IndexError(f"snapshot {index} of {self.num_snapshots}")
        return self.snapshot_base + index

    def spare_slot(self, chain: int, position: int) -> int:
        """The spare slot holding chain `chain`'s state after its position `position`."""
        if not (0 <= chain < self.num_chains and 0 <= position < self.max_drafts):
            raise IndexError(
                f"spare slot of chain {chain} position {position}: {self.num_chains} chains of "
                f"{self.max_drafts}"
            )
        return self.spare_base + chain * self.max_drafts + position


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


def state_specs_of(
    model: nn.Module, model_dtype: torch.dtype, state_dtype: torch.dtype | None
) -> list[StateSpec]:
    """The resolved state spec of each recurrent layer of `model` (this rank's shard), in
    module order; `state_dtype` is the `ssm_state_dtype` option (None: the default rule)."""
    return [m.state_spec().resolve(model_dtype, state_dtype) for m in stateful_layers(model)]


class StateCache:
    """The state tensors of all recurrent layers and slots of one model (one rank's shard)."""

    def __init__(self, specs: list[StateSpec], num_slots: int, device: torch.device) -> None:
        self.specs = list(specs)
        self.num_slots = num_slots
        self.device = device
        groups: dict[StateSpec, list[int]] = {}
        for i, spec in enumerate(self.specs):
            groups.setdefault(spec, []).append(i)
        # Per group: name -> (layers in the group, S, *shape).
        self.tensors: list[dict[str, torch.Tensor]] = []
        self._group_layers: list[list[int]] = []  # per group: its layers' indices
        self._views: list[LayerState] = [{} for _ in self.specs]
        self._bound: list[nn.Module] = []  # the layers bound, in order (`bind`)
        for spec, layers in groups.items():
            group = {
                t.name: huge_page_zeros((len(layers), num_slots, *t.shape), t.dtype, device)
                for t in spec.tensors
            }
            self.tensors.append(group)
            self._group_layers.append(layers)
            for j, layer in enumerate(layers):
                self._views[layer] = {name: t[j] for name, t in group.items()}

    @property
    def num_layers(self) -> int:
        """Recurrent layers."""
        return len(self.specs)

    def layer(self, index: int) -> LayerState:
        """Views of recurrent layer `index`'s state over all slots: name -> `(S, *shape)`."""
        return self._views[index]

    def bind(self, model: nn.Module) -> None:
        """Gives each recurrent layer of `model` its views, in module order, then makes the
        layers' decode plans from the weights and these states (`layers.decode_plan`): a
        binding replaces the plans made before it."""
        layers = stateful_layers(model)
        assert len(layers) == len(self.specs), (len(layers), len(self.specs))
        for i, module in enumerate(layers):
            module.bind_state(self.layer(i))
        self._bound = list(layers)
        plan_decode(model)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copies the state of slots `src[i]` into `dst[i]` in every layer (a fork, a prefix
        snapshot taken or restored)."""
        if not src:
            return
        if not set(src) & set(dst) and len(set(dst)) == len(dst):
            # One pass per slot, no gathered copy: a speculative chain's rollback copies a
            # spare slot's state back at every rejecting step (Qwen3.5-0.8B: 18 MiB, 2.7 ms
            # through the gather and scatter below, half that as one copy).
            for s, d in zip(src, dst):
                for group in self.tensors:
                    for t in group.values():
                        t[:, d].copy_(t[:, s])
            return
        # Sources that are also destinations: every source read before any is written.
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for group in self.tensors:
            for t in group.values():
                t[:, dst_t] = t[:, src_t]

    def rollback(self, chains: list[tuple[int, list[int], int]]) -> None:
        """Brings sequences to a position of their last speculative chain.

        Args:
            chains: per sequence `(start, positions, slot)`: `positions` the slots that the
                chain's kept positions 0 to m - 1 wrote (`m >= 1`; the chain's last position
                writes the sequence's `slot`), `start` the slot holding the chain's start
                state (the sequence's slot until the step that ran the chain has committed it,
                the chain's first spare slot after). A state that the layer's last chain step
                logged (`layers.chain_log`) is replayed from `start` through the records of
                the kept positions; every other state is copied from the last kept
                position's slot (nothing to copy when that is `slot`).
        """
        if not chains:
            return
        logged = {
            i: log
            for i, layer in enumerate(self._bound)
            if (log := getattr(layer, "chain_log", None)) is not None and log.active
        }
        copies = [(p[-1], slot) for _, p, slot in chains if p[-1] != slot]
        if not logged:
            self.copy_slots([s for s, _ in copies], [d for _, d in copies])
            return
        width = max(len(p) for _, p, _ in chains)
        records = torch.tensor(
            [p + [-1] * (width - len(p)) for _, p, _ in chains], dtype=torch.long
        )  # (n, R)
        start = torch.tensor([s for s, _, _ in chains], dtype=torch.long)  # (n,)
        dst_t = torch.tensor([slot for _, _, slot in chains], dtype=torch.long)  # (n,)
        for group, layers in zip(self.tensors, self._group_layers, strict=True):
            for name, t in group.items():  # t: (layers of the group, S, ...)
                logs = {
                    j: log
                    for j, i in enumerate(layers)
                    if (log := logged.get(i)) and log.state == name
                }
                copied = [j for j in range(len(layers)) if j not in logs]
                for s, d in copies:
                    if len(copied) == len(layers):
                        t[:, d].copy_(t[:, s])  # the whole group in one copy
                    else:
                        for j in copied:
                            t[j, d].copy_(t[j, s])
                for j, log in logs.items():
                    assert log.tensor is not None
                    log.replay(t[j], log.tensor, start, records, dst_t)

    def bytes_per_slot(self) -> int:
        """State bytes one sequence holds across all layers."""
        return sum(spec.bytes_per_slot() for spec in self.specs)

    def state_dtypes(self) -> list[torch.dtype]:
        """The distinct dtypes of the recurrent (non-conv) states, for the startup banner."""
        found = {t.dtype for s in self.specs for t in s.tensors if t.kind == "recurrent"}
        return sorted(found, key=str)

    def nbytes(self) -> int:
        """Bytes of all state tensors."""
        return sum(t.numel() * t.element_size() for g in self.tensors for t in g.values())
