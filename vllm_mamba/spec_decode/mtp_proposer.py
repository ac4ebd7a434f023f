"""The `mtp` method: the target's own multi-token prediction head proposes the drafts.

The worker's runner runs the head after every forward over all of the step's rows (`ModelRunner.
_mtp_pass`): its KV then covers every position the target computed, and each sampled
sequence's first draft comes from the head's output at its last kept position; the step's
result brings it (`StepResult.mtp_drafts`) and the head's output row stays in the worker.
Further drafts (`num_speculative_tokens` > 1) are a step of their own: this proposer sends the
worker a `Step` with no sequences and the drafts it wants (`Step.mtp_drafts`), and the runner
runs the head again, one decode row per sequence one position further on each time, fed its own
previous output and the previous draft (as vLLM's MTP proposer). Those rows write the head's KV
at positions the target has not computed yet: their blocks are taken here first (the target's
next step needs them anyway), with the copies of shared blocks in the same step, and the next
step's first pass overwrites what they wrote. A sequence whose blocks cannot be had gets its
first draft only.

Drafts are the head's argmax (a one-hot draft distribution, so verification keeps the
target's distribution exactly).
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.worker.step import MTPDraft, Step, StepResult


class MTPProposer:
    """Drafts from the MTP head (see the module docstring).

    Args:
        executor: runs the steps that make further drafts (`Executor.execute`).
        block_manager: the scheduler's KV block manager.
    """

    def __init__(self, executor: Any, block_manager: Any) -> None:
        self.executor = executor
        self.block_manager = block_manager
        self._first: dict[int, int] = {}  # seq id -> the head's first draft, from the last step

    def on_step(self, result: StepResult) -> None:
        """Takes the first drafts of the step that just ran."""
        self._first = dict(result.mtp_drafts)

    def propose(self, seqs: list[tuple[SequenceGroup, Sequence, int]]) -> list[list[int]]:
        """Drafts for each `(group, seq, k)`: the first from the last step, the rest from a
        drafting step."""
        out: list[list[int]] = []
        chains: list[tuple[int, Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        for index, (_, seq, k) in enumerate(seqs):
            first = self._first.get(seq.seq_id)
            if first is None:
                out.append([])
                continue
            out.append([first])
            if k > 1 and self._reserve(seq, k - 1, copies):
                chains.append((index, seq, k))
        self._first = {}
        if not chains:
            return out
        wanted = [
            MTPDraft(
                seq.seq_id,
                seq.slot,  # type: ignore[arg-type]
                k - 1,
                seq.num_tokens - 1,
                self.block_manager.block_table(seq.seq_id),
            )
            for _, seq, k in chains
        ]
        result = self.executor.execute(Step(seqs=[], block_copies=copies, mtp_drafts=wanted))
        for index, seq, _ in chains:
            out[index].extend(result.more_drafts[seq.seq_id])
        return out

    def _reserve(self, seq: Sequence, extra: int, copies: list[tuple[int, int]]) -> bool:
        """Blocks for the head's KV at the `extra` positions after the sequence's last token
        (a shared block's copy is added to `copies`); False when the pool is short."""
        work = [(seq.seq_id, seq.num_tokens - 1, extra)]
        if not self.block_manager.can_allocate(work):
            return False
        self.block_manager.allocate(*work[0])
        copies.extend(self.block_manager.take_copies())
        return True

    def on_finished(self, seq: Sequence) -> None:
        """Holds nothing per sequence."""
