"""CPU memory backed by transparent huge pages, for the tensors that decode streams every step.

Single-stream decode on a CPU reads every weight once per token, so its speed is memory
bandwidth. With the default 4 KiB pages the hardware prefetchers stop at every page boundary
and each page costs a TLB entry; on 2 MiB pages the same GEMV streams 13-18% faster
(`benchmarks/README.md`, "Current results"). PyTorch's CPU allocator asks for huge pages only when
`THP_MEM_ALLOC_ENABLE=1` is set before its first allocation, which a library cannot arrange,
so this module maps its own memory:

- `huge_page_zeros(shape, dtype)`: a zeroed tensor in its own `madvise(MADV_HUGEPAGE)` mapping
  (the state and KV caches);
- `move_to_huge_pages(model)`: every parameter and buffer storage of a model copied into one
  such mapping, each tensor re-pointed in place (`tensor.data = ...`), so modules, tied
  weights and views that share a storage keep sharing it. A token table that only an
  embedding holds stays where it is: decode reads a few of its rows a step, so huge pages gain
  it nothing, and its copy is the largest (0.97 GB at Qwen3.6-35B-A3B's untied 248,320 x 2,048
  bfloat16 table), held twice while it moves. Models under `MIN_MODEL_BYTES`
  stay where they are: faulting the fresh huge pages in (the kernel zeroes and may compact
  for each) costs about 50 ms for a 14 MiB model, more than a toy model's decode ever
  gains, and every engine start pays it.

The mapping is freed when the last tensor viewing it is. Linux only; elsewhere, with THP off
(`/sys/kernel/mm/transparent_hugepage/enabled` = never) or with `VLLM_MAMBA_HUGE_PAGES=0`,
both fall back to ordinary allocations.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch
from torch import nn

from vllm_mamba import envs

HUGE_PAGE = 2 << 20  # bytes; x86-64 and arm64 (4 KiB base pages) transparent huge pages
MIN_MODEL_BYTES = 32 << 20  # smaller models keep their ordinary pages (module docstring)
_ALIGN = 64  # every tensor in an arena starts on a cache line
# Bytes freed between two trims of the heap (`release_freed_heap`) where many small tensors
# are freed in a row: moving a model here, quantising and stacking a model's experts.
TRIM_BYTES = 64 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def enabled() -> bool:
    """True when huge-page mappings are wanted and the kernel can give them."""
    if not envs.VLLM_MAMBA_HUGE_PAGES:
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _arena(nbytes: int) -> torch.Tensor | None:
    """A `(nbytes,)` uint8 tensor at a huge-page boundary of a fresh `MADV_HUGEPAGE` mapping
    (zero-filled, pages faulted in on first touch), or None when it cannot be made."""
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def huge_page_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`, on huge pages when on the CPU.

    The pages are not faulted in here: a fresh anonymous mapping reads as zero, and each huge
    page is mapped when first written. The caches that use it (state slots, the KV pool) are
    sized to budgets that most runs never fill; faulting them all in at start-up cost seconds
    (with transparent huge pages on `madvise`, the kernel compacts memory for each one: 4.7 to
    11.9 s for the state and snapshot slots of a tiny hybrid with prefix caching, under load)
    and their whole size in resident memory.
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    arena = _arena(nbytes) if device.type == "cpu" and nbytes >= HUGE_PAGE and enabled() else None
    if arena is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return arena.view(dtype).view(shape)


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `model`, each tensor object once, but an embedding's token
    table that no other module holds (a tied one is the LM head's weight, streamed every step)."""
    from vllm_mamba.layers.parallel_linear import VocabParallelEmbedding

    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, (nn.Embedding, VocabParallelEmbedding)):
            continue
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def move_to_huge_pages(model: nn.Module, min_bytes: int | None = None) -> int:
    """Copies the storages of `model`'s parameters and buffers into one huge-page arena, when
    they hold at least `min_bytes` (default `MIN_MODEL_BYTES`).

    Each tensor keeps its identity, dtype, shape, strides and offset; tensors that shared a
    storage (tied embeddings, views) share the new one. Call it before anything caches a
    derived view of a weight (the fused decode layers build theirs on first use).

    Returns:
        The bytes moved; 0 when nothing was (not on the CPU, disabled, under `min_bytes`, or
        no mapping).
    """
    tensors = _tensors(model)
    if not tensors or any(t.device.type != "cpu" for t in tensors) or not enabled():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> the tensors viewing it
    for t in tensors:
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {key: ts[0].untyped_storage().nbytes() for key, ts in groups.items()}
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes.values())
    if total < (MIN_MODEL_BYTES if min_bytes is None else min_bytes):
        return 0
    arena = _arena(total)
    if arena is None:
        return 0
    new_storage = arena.untyped_storage()
    start = 0  # of the next storage, in bytes from the arena's start
    untrimmed = 0  # bytes moved since the heap was last trimmed
    with torch.no_grad():
        # One storage at a time, so that each old one is freed before the next is copied:
        # the model is never held twice. The small ones were in glibc's heap, which keeps
        # them until trimmed: untrimmed, a Qwen3.6-35B-A3B-shaped model's held 0.5 GB more
        # by the end of the move. The largest first, while the least is left over.
        for key, group in sorted(groups.items(), key=lambda kv: -sizes[kv[0]]):
            if untrimmed >= TRIM_BYTES:
                release_freed_heap()
                untrimmed = 0
            untrimmed += sizes[key]
            src = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
            arena[start : start + sizes[key]].copy_(src)
            del src
            offset = arena.storage_offset() + start  # in bytes from the mapping's start
            for t in group:
                size = t.element_size()
                first = (offset + t.storage_offset() * size) // size
                t.data = torch.empty(0, dtype=t.dtype).set_(new_storage, first, t.shape, t.stride())
            start += -(-sizes[key] // _ALIGN) * _ALIGN
    release_freed_heap()
    return total


def release_freed_heap() -> None:
    """Returns freed heap memory to the system (glibc keeps freed blocks under its mmap
    threshold, 32 MiB at most, in the heap: ~120 MiB of `mamba-130m`'s layers' copies)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
