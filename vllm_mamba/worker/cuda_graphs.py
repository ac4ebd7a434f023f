"""CUDA graphs for decode-only steps: one captured forward per batch size.

Captured when the attention backend declares its decode steps capturable
(`AttentionBackend.decode_cuda_graphs`: their metadata differs from step to step only in
`decode_state_indices`), on CUDA, with one rank and without `enforce_eager` (`Worker`).

A decode step runs one token per sequence; its shapes depend only on the batch size, so the
forward is captured once per size (1, 2, 4, 8, 16, 32, then every 32 up to `max_num_seqs`)
and replayed. A batch is padded up to the next captured size with `PAD_SLOT_ID` rows, which
the kernels neither read nor write; the state tensors (bound to the layers from `cache`) stay
where they are (static addresses).
Each size's metadata comes from the backend's builder, as in eager steps; a replay writes the
step's slots into that metadata's `decode_state_indices` in place.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from vllm_mamba.attention.backend import AttentionBackend, StepLayout
from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.state_cache import StateCache


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two to 32, then multiples of 32, then the maximum."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s <= max_num_seqs]
    sizes += list(range(64, max_num_seqs + 1, 32))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeCudaGraphs:
    """Captured decode forwards of one model over static input buffers."""

    def __init__(
        self,
        model: Callable[[torch.Tensor, MambaMetadata], torch.Tensor],
        cache: StateCache,
        backend: type[AttentionBackend],
        max_num_seqs: int,
    ) -> None:
        device = cache.device
        self.sizes = capture_sizes(max_num_seqs)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)  # (max_bs,)
        # Per size: the graph, its metadata (static slot indices) and its output (bs, H).
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, MambaMetadata, torch.Tensor]] = {}
        pool = None
        for bs in reversed(self.sizes):
            layout = StepLayout([PAD_SLOT_ID] * bs, [], [], [])
            meta = backend.build_metadata(layout, device)
            assert isinstance(meta, MambaMetadata)
            with torch.inference_mode():
                model(self.input_ids[:bs], meta)  # warm-up; PAD slots leave states alone
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model(self.input_ids[:bs], meta)  # (bs, H)
            pool = graph.pool()
            self.graphs[bs] = (graph, meta, out)

    def run(self, token_ids: list[int], slots: list[int]) -> torch.Tensor:
        """Replays the graph for `len(token_ids)` decodes (at most `max_num_seqs`).

        Returns:
            Hidden states `(len(token_ids), H)`, valid until the next replay.
        """
        n = len(token_ids)
        graph, meta, out = self.graphs[self.sizes[bisect.bisect_left(self.sizes, n)]]
        self.input_ids[:n].copy_(torch.tensor(token_ids, dtype=torch.long), non_blocking=True)
        indices = meta.decode_state_indices  # (bs,)
        indices[:n].copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        indices[n:].fill_(PAD_SLOT_ID)
        graph.replay()
        return out[:n]
