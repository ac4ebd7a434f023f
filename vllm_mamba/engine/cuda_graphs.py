"""CUDA graphs for decode-only steps: one captured forward per batch size.

A decode step runs one token per sequence; its shapes depend only on the batch size, so the
forward is captured once per size (1, 2, 4, 8, 16, 32, then every 32 up to `max_num_seqs`)
and replayed. A batch is padded up to the next captured size with `PAD_SLOT_ID` rows, which
the kernels neither read nor write; the state tensors stay where they are (static addresses).
"""

from __future__ import annotations

import bisect

import torch

from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionMetadata
from vllm_mamba.mamba_cache import PAD_SLOT_ID, MambaCache


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two to 32, then multiples of 32, then the maximum."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s <= max_num_seqs]
    sizes += list(range(64, max_num_seqs + 1, 32))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeCudaGraphs:
    """Captured decode forwards of one model over static input buffers."""

    def __init__(self, model: torch.nn.Module, cache: MambaCache, max_num_seqs: int) -> None:
        device = cache.conv_state.device
        self.sizes = capture_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)  # (max_bs,)
        self.slots = torch.full((max_bs,), PAD_SLOT_ID, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        pool = None
        for bs in reversed(self.sizes):
            meta = PlaceholderAttentionMetadata(
                num_decodes=bs,
                num_prefills=0,
                num_decode_tokens=bs,
                num_prefill_tokens=0,
                decode_state_indices=self.slots[:bs],
                prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
                prefill_state_indices=empty_i32,
                prefill_has_initial_state=torch.zeros(0, dtype=torch.bool, device=device),
                seq_lens=torch.ones(bs, dtype=torch.int32, device=device),
            )
            with torch.inference_mode():
                model(self.input_ids[:bs], cache, meta)  # warm-up; PAD slots leave states alone
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model(self.input_ids[:bs], cache, meta)  # (bs, H)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)

    def run(self, token_ids: list[int], slots: list[int]) -> torch.Tensor | None:
        """Replays the graph for `len(token_ids)` decodes; None when the batch is too large.

        Returns:
            Hidden states `(len(token_ids), H)`, valid until the next replay.
        """
        n = len(token_ids)
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        bs = self.sizes[i]
        self.input_ids[:n].copy_(torch.tensor(token_ids, dtype=torch.long), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        self.slots[n:bs].fill_(PAD_SLOT_ID)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
