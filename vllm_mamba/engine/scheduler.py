"""First-come-first-served scheduling with continuous batching, chunked prefill and preemption.

Each step the scheduler fills a token budget (`max_num_batched_tokens`): first the running
sequences (mostly one-token decodes), then waiting requests in arrival order while state slots
are free. A sequence with more tokens to compute than the budget allows gets a chunk now and
the rest later (chunked prefill). A request with `n > 1` prefills once; when its prompt's last
chunk is scheduled it takes `n - 1` more slots, preempting the youngest running requests when
none are free (preemption by recompute: their slots are freed and they start over, prompt and
generated tokens together, when slots return).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from vllm_mamba.engine.block_manager import PlaceholderBlockManager
from vllm_mamba.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm_mamba.mamba_cache import SlotAllocator


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `num_tokens` from `num_computed_tokens` on.

    `sample` is True when the chunk reaches the end of the known tokens, so the last position
    is sampled; `children` are sequences forked from this one after the forward.
    """

    seq: Sequence
    group: SequenceGroup
    num_tokens: int
    sample: bool
    children: list[Sequence] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """One token on top of an existing state."""
        return self.num_tokens == 1 and self.seq.num_computed_tokens > 0


@dataclass
class SchedulerOutput:
    """The step's work, decodes first, then prefill chunks."""

    scheduled: list[ScheduledSeq]
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's flat batch."""
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues and the state-slot allocator."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots = SlotAllocator(max_num_seqs)
        self.block_manager = PlaceholderBlockManager()
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self._seq_ids = itertools.count()
        self.num_preemptions = 0

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        return next(self._seq_ids)

    def add(self, group: SequenceGroup) -> None:
        """Queues a new request."""
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Removes a request wherever it is and frees its slots; None when unknown."""
        for queue in (self.running, self.waiting):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self._free_group(group)
                    return group
        return None

    def finish_seq(self, seq: Sequence) -> None:
        """Frees a finished sequence's slot."""
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None

    def remove_finished(self) -> list[SequenceGroup]:
        """Drops finished requests from the running queue and returns them."""
        done = [g for g in self.running if g.finished]
        self.running = [g for g in self.running if not g.finished]
        return done

    def preempt(self, group: SequenceGroup) -> None:
        """Preemption by recompute: frees the request's slots and requeues it at the front."""
        self.running.remove(group)
        self._free_group(group)
        for seq in group.unfinished_seqs():
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    def _free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.finish_seq(seq)
        self.block_manager.free()

    def schedule(self) -> SchedulerOutput:
        """Picks this step's sequences and token counts (see the module docstring)."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        stalled = False
        for group in list(self.running):
            if budget == 0:
                break
            if group not in self.running:  # preempted by an older request this step
                continue
            budget, ok = self._schedule_group(group, budget, out)
            stalled = stalled or not ok
        while self.waiting and budget > 0 and not stalled:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()
            if self.slots.num_free < len(seqs) or not self.block_manager.can_allocate(0):
                break
            self.waiting.popleft()
            for seq in seqs:
                seq.slot = self.slots.allocate()
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget, ok = self._schedule_group(group, budget, out)
            stalled = not ok
        out.scheduled.sort(key=lambda s: not s.is_decode)
        return out

    def _schedule_group(
        self, group: SequenceGroup, budget: int, out: SchedulerOutput
    ) -> tuple[int, bool]:
        """Schedules the group's sequences within `budget`; returns (budget left, not stalled)."""
        for seq in group.unfinished_seqs():
            remaining = seq.num_uncomputed_tokens
            num = min(remaining, budget)
            if num == 0:
                return budget, True
            children: list[Sequence] = []
            if num == remaining and group.pending_forks and seq.index == 0:
                if not self._make_room(group.pending_forks, keep=group):
                    if remaining > 1:
                        out.scheduled.append(ScheduledSeq(seq, group, remaining - 1, False))
                        budget -= remaining - 1
                    return budget, False
                children = self._fork(group, seq)
            out.scheduled.append(ScheduledSeq(seq, group, num, num == remaining, children))
            budget -= num
        return budget, True

    def _make_room(self, needed: int, keep: SequenceGroup) -> bool:
        """Frees slots by preempting the youngest running requests scheduled after `keep`."""
        while self.slots.num_free < needed:
            younger = self.running[self.running.index(keep) + 1 :]
            if not younger:
                return False
            self.preempt(younger[-1])
        return True

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """Creates the request's remaining sequences, each with its own slot."""
        children = []
        for index in range(len(group.seqs), group.params.n):
            child = Sequence(
                seq_id=self.new_seq_id(),
                index=index,
                prompt_token_ids=parent.prompt_token_ids,
                slot=self.slots.allocate(),
                status=SequenceStatus.RUNNING,
            )
            group.seqs.append(child)
            children.append(child)
        return children
