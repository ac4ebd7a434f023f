"""The `mtp` method: the target's own multi-token prediction head proposes the drafts.

The runner runs the head after every forward over all of the step's rows (`ModelRunner.
_mtp_pass`): its KV then covers every position the target computed, and each sampled
sequence's first draft comes from the head's output at its last kept position. Further drafts
(`num_speculative_tokens` > 1) run the head again here, one decode row per sequence one
position further on each time, fed its own previous output and the previous draft (as vLLM's
MTP proposer). Those rows write the head's KV at positions the target has not computed yet:
their blocks are taken now (the target's next step needs them anyway), with the copy of a
shared block made at once, and the next step's first pass overwrites what they wrote. A
sequence whose blocks cannot be had gets its first draft only.

Drafts are the head's argmax (a one-hot draft distribution, so verification keeps the
target's distribution exactly).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.engine.sequence import Sequence, SequenceGroup


class MTPProposer:
    """Drafts from the MTP head (see the module docstring).

    Args:
        runner: rank 0's `ModelRunner`, built with the MTP head.
        block_manager: the scheduler's KV block manager.
        kv_cache: the engine's KV cache (the head's layer is one of its layers).
    """

    def __init__(self, runner: Any, block_manager: Any, kv_cache: Any) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def propose(self, seqs: list[tuple[SequenceGroup, Sequence, int]]) -> list[list[int]]:
        """Drafts for each `(group, seq, k)`: the first from the last step, the rest here."""
        out: list[list[int]] = []
        chains: list[tuple[int, Sequence, int, torch.Tensor]] = []
        for index, (_, seq, k) in enumerate(seqs):
            first = self.runner.mtp_next.get(seq.seq_id)
            if first is None:
                out.append([])
                continue
            out.append([first[0]])
            if k > 1 and self._reserve(seq, k - 1):
                chains.append((index, seq, k, first[1]))
        self.runner.mtp_next = {}
        for step in range(1, max((k for _, _, k, _ in chains), default=1)):
            chains = [c for c in chains if c[2] > step]
            if not chains:
                break
            hidden = torch.stack([h for _, _, _, h in chains])  # (B, H)
            ids = torch.tensor([out[i][-1] for i, _, _, _ in chains], device=hidden.device)
            positions = [seq.num_tokens - 1 + step - 1 for _, seq, _, _ in chains]
            layout = StepLayout(
                decode_slots=[seq.slot for _, seq, _, _ in chains],
                prefill_lens=[],
                prefill_slots=[],
                prefill_context_lens=[],
                decode_context_lens=positions,
                block_size=self.kv_cache.block_size,
                decode_block_tables=[
                    self.block_manager.block_table(seq.seq_id) for _, seq, _, _ in chains
                ],
            )
            meta = self.runner.backend.build_metadata(layout, hidden.device)
            mtp = self.runner.mtp
            hidden = mtp(hidden, ids, meta, spec_step=step)  # (B, H)
            drafts = mtp.compute_logits(hidden).argmax(-1).tolist()
            chains = [(i, s, k, hidden[j]) for j, (i, s, k, _) in enumerate(chains)]
            for (i, _, _, _), draft in zip(chains, drafts):
                out[i].append(draft)
        return out

    def _reserve(self, seq: Sequence, extra: int) -> bool:
        """Blocks for the head's KV at the `extra` positions after the sequence's last token
        (a shared block is copied now); False when the pool is short."""
        work = [(seq.seq_id, seq.num_tokens - 1, extra)]
        if not self.block_manager.can_allocate(work):
            return False
        self.block_manager.allocate(*work[0])
        copies = self.block_manager.take_copies()
        if copies:
            src, dst = zip(*copies)
            self.kv_cache.copy_blocks(list(src), list(dst))
        return True

    def on_finished(self, seq: Sequence) -> None:
        """Holds nothing per sequence."""
