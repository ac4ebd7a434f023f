"""First-come-first-served scheduling with continuous batching, chunked prefill and preemption.

Each step the scheduler fills a token budget (`max_num_batched_tokens`): first the running
sequences (mostly one-token decodes), then waiting requests in arrival order while state slots
are free. A sequence with more tokens to compute than the budget allows gets a chunk now and
the rest later (chunked prefill). A request with `n > 1` reserves slots for its other
sequences on admission, prefills once, and forks into the reserved slots when its prompt's last
chunk is scheduled.

A request's sequences share the slots with other requests (issue 46: two requests of `n=128`
held all 256 slots and the others queued for their whole generation). A request is admitted
as soon as one slot is free: its first sequence takes it, its other sequences the free slots
that the requests waiting behind it do not need (one each); a sequence without a slot waits
inside its running request (`SequenceStatus.WAITING`) and starts later on its own, from its
prompt (a sequence forked later would start from the state of a prompt its parent has moved
past), when slots are free and no request waits for one; a running request none of whose
sequences holds a slot gets one before the waiting requests, as it came before them. When a
request waits and no slot is free, a running request that holds more than its fair share (the
slots divided among the running requests and it) gives one back: a reserved slot, else its
last sequence, preempted by recompute (`preempt_seq`); a request always keeps one sequence
running.

`preempt` is preemption by recompute: the request's slots and KV blocks are freed and it goes
back to the front of the queue; when they return its sequences start over, prompt and generated
tokens together, and continue exactly where they were.

A paused request (`SequenceGroup.paused`: the server's client is not reading its output) is
skipped: it is neither scheduled nor admitted, but keeps whatever slots and KV blocks it holds,
so its memory does not grow and nothing is recomputed when it resumes. Under KV pressure a
paused request is preempted before any other (its blocks serve no step); it then waits, still
paused, holding nothing.

Hybrid models also need KV blocks (`block_manager.BlockManager`): a waiting request is admitted
only when the blocks of its scheduled chunk are free too, and when a running request cannot get
the blocks of its next tokens, the most recently admitted request is preempted (vLLM's policy;
a paused one first), possibly itself; no request is admitted in a step that preempted.
Attention-free models get the placeholder block manager, which never limits anything.

With prefix caching (`prefix_cache.PrefixCache`), every request's prompt is registered in the
radix tree when it arrives. On admission a sequence starts from the deepest saved state of a
prefix of its tokens (a hit: the snapshot is copied into its slot before the forward and, for
hybrids, it shares the snapshot's KV blocks); prefill chunks end at the tree's node boundaries
and interval multiples, where a snapshot is taken after the forward. A waiting request whose
prompt shares a longer prefix with a request still prefilling waits until that request has
saved the branch point, then starts from it. Under KV block pressure, snapshots are evicted
before any request is preempted.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from vllm_mamba.engine.block_manager import BlockManager, PlaceholderBlockManager
from vllm_mamba.engine.prefix_cache import PendingSnapshot, PrefixCache
from vllm_mamba.engine.prefix_scheduling import NoPrefixScheduling, PrefixHit, PrefixScheduling
from vllm_mamba.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm_mamba.mamba_cache import SlotAllocator


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `num_tokens` from `num_computed_tokens` on.

    `sample` is True when the chunk reaches the end of the known tokens, so the last position
    is sampled; `children` are sequences forked from this one after the forward;
    `block_table` lists the sequence's KV blocks (empty for attention-free models);
    `spec_token_ids` are draft tokens verified after the sequence's last token (speculative
    decoding: `num_tokens` counts them too).
    """

    seq: Sequence
    group: SequenceGroup
    num_tokens: int
    sample: bool
    children: list[Sequence] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """One token on top of an existing state."""
        return self.num_tokens == 1 and self.seq.num_computed_tokens > 0

    @property
    def is_spec(self) -> bool:
        """The last token and draft tokens to verify, as a chain of decode rows."""
        return bool(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    """The step's work, decodes first, then prefill chunks; the KV block copies (`(src, dst)`,
    copy-on-write of forks) and the prefix-cache hits' state copies to make before the
    forward; the snapshots to take after it."""

    scheduled: list[ScheduledSeq]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    hits: list[PrefixHit] = field(default_factory=list)
    snapshots: list[PendingSnapshot] = field(default_factory=list)

    @property
    def state_copies(self) -> list[tuple[int, int]]:
        """`(snapshot slot, sequence slot)` of every hit."""
        return [(h.snapshot.slot, h.seq.slot) for h in self.hits]  # type: ignore[misc]


class Scheduler:
    """Owns the waiting and running queues, the state-slot allocator and the block manager."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager | None = None,
        prefix_cache: PrefixCache | None = None,
        max_spec_chains: int = 0,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_spec_chains = max_spec_chains  # speculating sequences per step, at most
        self._spec_left = 0
        self.slots = SlotAllocator(max_num_seqs)
        self.block_manager: BlockManager | PlaceholderBlockManager = (
            block_manager or PlaceholderBlockManager()
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self.prefix: PrefixScheduling | NoPrefixScheduling = (
            PrefixScheduling(prefix_cache, self.block_manager)
            if prefix_cache is not None
            else NoPrefixScheduling()
        )

    def new_seq_id(self) -> int:
        """A fresh sequence id."""
        return next(self._seq_ids)

    def add(self, group: SequenceGroup) -> None:
        """Queues a new request (and registers its prompt's path with the prefix cache)."""
        self.prefix.add_path(group)
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def has_unpaused(self) -> bool:
        """True while a request that is not paused waits or runs (a step has work)."""
        return any(not g.paused for g in itertools.chain(self.running, self.waiting))

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Removes a request wherever it is and frees its slots; None when unknown."""
        for queue in (self.running, self.waiting):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self._free_group(group)
                    self.prefix.drop_path(group)
                    return group
        return None

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Pauses or resumes a request (see the module docstring); unknown ids are ignored."""
        for group in itertools.chain(self.running, self.waiting):
            if group.request_id == request_id:
                group.paused = paused
                return

    def finish_seq(self, seq: Sequence) -> None:
        """Frees a finished sequence's slot and KV blocks."""
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
        self.block_manager.free(seq.seq_id)

    def remove_finished(self) -> list[SequenceGroup]:
        """Drops finished requests from the running queue and returns them."""
        done = [g for g in self.running if g.finished]
        self.running = [g for g in self.running if not g.finished]
        for group in done:
            self.prefix.drop_path(group)
        return done

    def preempt(self, group: SequenceGroup) -> None:
        """Preemption by recompute: frees the request's slots and blocks and requeues it at the
        front."""
        self.running.remove(group)
        self._free_group(group)
        for seq in group.unfinished_seqs():
            seq.num_computed_tokens = 0
            seq.spec_token_ids = []
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    def preempt_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Preemption by recompute of one sequence of a running request: its slot and blocks
        are freed, and it waits inside the request until a slot is free again."""
        self.finish_seq(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def _make_room(self) -> None:
        """Frees one slot for each request that waits without one (up to the slots that
        requests over their fair share hold beyond it): see the module docstring."""
        wanting = sum(1 for g in self.waiting if not g.paused)
        wanting += sum(1 for g in self.running if _starved(g))
        while wanting > self.slots.num_free:
            fair = max(1, self.slots.num_slots // (len(self.running) + 1))
            held = {id(g): _held(g) for g in self.running}
            over = [g for g in self.running if held[id(g)] > fair]
            if not over:
                return
            group = max(over, key=lambda g: held[id(g)])
            if group.reserved_slots:
                self.slots.free(group.reserved_slots.pop())
                continue
            seqs = [s for s in group.unfinished_seqs() if s.slot is not None]
            if len(seqs) < 2:
                return
            self.preempt_seq(group, seqs[-1])

    def _free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.finish_seq(seq)
        for slot in group.reserved_slots:
            self.slots.free(slot)
        group.reserved_slots = []

    def schedule(self) -> SchedulerOutput:
        """Picks this step's sequences and token counts (see the module docstring)."""
        budget = self.max_num_batched_tokens
        self._spec_left = self.max_spec_chains
        out = SchedulerOutput(scheduled=[])
        preempted = False
        self._make_room()
        index = 0
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            if group.paused:
                index += 1
                continue
            plan = self._plan(group, budget)
            if not self._fit_blocks(plan) and self._has_drafts(plan):
                plan = self._plan(group, budget, speculate=False)  # drafts go first
            if not self._fit_blocks(plan):
                victim = self._victim()  # maybe `group`
                if self.running.index(victim) < index:
                    index -= 1  # a paused one skipped before `group`
                self.preempt(victim)
                preempted = True
                continue
            budget -= self._commit(group, plan, out)
            index += 1
        waiting = 0
        # Waiting for a branch point makes sense only behind a request that progresses.
        unpaused = [g for g in self.running if not g.paused]
        if not preempted:
            budget = self._start_waiting_seqs(budget, out, starved_only=True)
        while waiting < len(self.waiting) and budget > 0 and not preempted:
            group = self.waiting[waiting]
            if group.paused:
                waiting += 1
                continue
            if self.slots.num_free == 0:
                break
            if self.prefix.should_wait(group, unpaused):
                waiting += 1
                continue
            seqs = group.unfinished_seqs()[: self.slots.num_free]
            for seq in seqs:
                seq.slot = self.slots.allocate()
            hits = self.prefix.find_hits(group, seqs)
            plan = self._plan(group, budget)
            if not self._fit_blocks(plan):
                self._undo_admission(seqs, hits)
                break
            del self.waiting[waiting]
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            behind = sum(1 for g in itertools.islice(self.waiting, waiting, None) if not g.paused)
            forks = min(group.pending_forks, max(self.slots.num_free - behind, 0))
            group.reserved_slots = [self.slots.allocate() for _ in range(forks)]
            self.running.append(group)
            unpaused.append(group)
            self.prefix.count(group, seqs, hits)
            out.hits.extend(hits)
            budget -= self._commit(group, plan, out)
        if not preempted and not any(not g.paused for g in self.waiting):
            self._start_waiting_seqs(budget, out)
        out.scheduled.sort(key=lambda s: 0 if s.is_decode else 1 if s.is_spec else 2)
        out.block_copies = self.block_manager.take_copies()
        return out

    def _start_waiting_seqs(
        self, budget: int, out: SchedulerOutput, starved_only: bool = False
    ) -> int:
        """Gives free slots to the sequences waiting inside running requests (in the order
        of the requests; `starved_only`: one to each request none of whose sequences holds
        a slot); returns the budget left."""
        for group in self.running:
            if group.paused or (starved_only and not _starved(group)):
                continue
            for seq in group.unfinished_seqs()[: 1 if starved_only else None]:
                if seq.slot is not None:
                    continue
                if self.slots.num_free == 0 or budget <= 0:
                    return budget
                seq.slot = self.slots.allocate()
                hits = self.prefix.find_hits(group, [seq])
                plan = self._plan(group, budget, seqs=[seq])
                if not self._fit_blocks(plan):
                    self._undo_admission([seq], hits)
                    return budget
                seq.status = SequenceStatus.RUNNING
                out.hits.extend(hits)
                budget -= self._commit(group, plan, out)
        return budget

    def _victim(self) -> SequenceGroup:
        """The request to preempt for KV blocks: the most recently admitted paused one, else
        the most recently admitted one."""
        paused = [g for g in self.running if g.paused]
        return paused[-1] if paused else self.running[-1]

    def _plan(
        self,
        group: SequenceGroup,
        budget: int,
        speculate: bool = True,
        seqs: list[Sequence] | None = None,
    ) -> list[tuple[Sequence, int]]:
        """The group's sequences that hold a slot (or `seqs`) and their token counts within
        `budget`; with prefix caching, a prefill chunk ends at the next point where a snapshot
        is due. A decoding sequence with draft tokens (`spec_token_ids`) also counts those
        that fit, while the step has spare slots for their states (`max_spec_chains`)."""
        plan = []
        chains = self._spec_left if speculate else 0
        if seqs is None:
            seqs = [s for s in group.unfinished_seqs() if s.slot is not None]
        for seq in seqs:
            num = min(seq.num_uncomputed_tokens, budget)
            if num == 0:
                break
            if num == 1 and seq.spec_token_ids and chains and seq.num_computed_tokens:
                num = min(1 + len(seq.spec_token_ids), budget)
                chains -= num > 1
            elif num > 1:
                start = seq.num_computed_tokens
                num = self.prefix.chunk_end(group, seq, start + num) - start
            plan.append((seq, num))
            budget -= num
        return plan

    @staticmethod
    def _has_drafts(plan: list[tuple[Sequence, int]]) -> bool:
        return any(num > seq.num_uncomputed_tokens for seq, num in plan)

    def _undo_admission(self, seqs: list[Sequence], hits: list[PrefixHit]) -> None:
        """Frees what an admission that did not fit took: hits, blocks and slots."""
        self.prefix.undo_hits(hits)
        for seq in seqs:
            self.block_manager.free(seq.seq_id)
            assert seq.slot is not None
            self.slots.free(seq.slot)
            seq.slot = None

    def _fit_blocks(self, plan: list[tuple[Sequence, int]]) -> bool:
        """True when the plan's KV blocks are free, after evicting prefix-cache snapshots
        that hold blocks if needed."""
        work = self._work(plan)
        while not self.block_manager.can_allocate(work):
            if not self.prefix.evict_for_blocks():
                return False
        return True

    @staticmethod
    def _work(plan: list[tuple[Sequence, int]]) -> list[tuple[int, int, int]]:
        return [(seq.seq_id, seq.num_computed_tokens, num) for seq, num in plan]

    def _commit(
        self, group: SequenceGroup, plan: list[tuple[Sequence, int]], out: SchedulerOutput
    ) -> int:
        """Allocates the plan's blocks, forks where a prompt ends, and schedules the plan;
        returns the tokens it scheduled."""
        used = 0
        for seq, num in plan:
            self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens, num)
            drafts = seq.spec_token_ids[: max(num - seq.num_uncomputed_tokens, 0)]
            self._spec_left -= bool(drafts)
            pending = self.prefix.maybe_snapshot(group, seq, num - len(drafts))
            if pending is not None:
                out.snapshots.append(pending)
            sample = num - len(drafts) == seq.num_uncomputed_tokens
            children = self._fork(group, seq) if sample and group.pending_forks else []
            table = self.block_manager.block_table(seq.seq_id)
            out.scheduled.append(ScheduledSeq(seq, group, num, sample, children, table, drafts))
            used += num
        return used

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """Creates the request's remaining sequences: in its reserved slots, forks of the
        parent that share its KV blocks; beyond them, sequences that wait for a slot and
        start from the prompt."""
        children = []
        for index in range(len(group.seqs), group.params.n):
            if not group.reserved_slots:
                seq = Sequence(self.new_seq_id(), index, parent.prompt_token_ids)
                seq.prompt_keys = parent.prompt_keys
                group.seqs.append(seq)
                continue
            child = Sequence(
                seq_id=self.new_seq_id(),
                index=index,
                prompt_token_ids=parent.prompt_token_ids,
                slot=group.reserved_slots.pop(),
                status=SequenceStatus.RUNNING,
                prompt_keys=parent.prompt_keys,
            )
            self.block_manager.fork(parent.seq_id, child.seq_id)
            group.seqs.append(child)
            children.append(child)
        return children


def _held(group: SequenceGroup) -> int:
    """The state slots a request holds: its sequences' and those reserved for its forks."""
    return sum(s.slot is not None for s in group.seqs) + len(group.reserved_slots)


def _starved(group: SequenceGroup) -> bool:
    """A running request with sequences to run, none of which holds a slot."""
    seqs = group.unfinished_seqs()
    return not group.paused and bool(seqs) and _held(group) == 0
