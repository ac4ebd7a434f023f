"""The scheduler's side of prefix caching: hits on admission, chunk ends, snapshots to take,
and waiting for a branch point.

`Scheduler` calls these unconditionally: `PrefixScheduling` when the engine has a
`prefix_cache.PrefixCache`, `NoPrefixScheduling` (every decision a no-op) when prefix caching
is off. Each decision is plain bookkeeping over the radix tree, the block manager and the
sequences:

- `add_path` / `drop_path`: a request's prompt is registered in the tree while it runs (its
  branch points are where snapshots are due), and so is the prefix ending at each of its
  `cache_points` (see `input_processor`): those are node boundaries too, so the prompt's
  prefill is cut there and a snapshot is saved there even when no other request shares it yet.
- `evict_for_blocks`: frees a snapshot's KV blocks when the pool is short.

- `find_hits`: a sequence being admitted starts from the deepest snapshot of its tokens (at
  most all but its last token, which must run to be sampled); the snapshot is pinned until the
  step's copy has read it, and a hybrid's sequence shares the snapshot's KV blocks.
- `chunk_end`: a prefill chunk ends at the next point where a snapshot is due.
- `maybe_snapshot`: reserves a snapshot slot when a chunk ends at such a point.
- `should_wait`: a waiting request whose prompt shares a longer prefix with a request still
  prefilling than any snapshot holds waits for that request's snapshot of the branch point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_mamba.engine.prefix_cache import PrefixCache, Snapshot, common_len
from vllm_mamba.engine.sequence import Sequence, SequenceGroup

__all__ = ["PrefixHit", "PrefixScheduling", "NoPrefixScheduling", "MIN_WAIT_TOKENS"]

# A waiting request waits for a running one's snapshot only when it saves this many tokens.
MIN_WAIT_TOKENS = 16


@dataclass
class PrefixHit:
    """A sequence that starts from a snapshot: its first `snapshot.num_tokens` tokens are
    cached."""

    group: SequenceGroup
    seq: Sequence
    snapshot: Snapshot


class PrefixScheduling:
    """Prefix-cache decisions of the scheduler (see the module docstring).

    Args:
        cache: the engine's prefix cache.
        block_manager: the scheduler's block manager (the placeholder for attention-free
            models).
    """

    def __init__(self, cache: PrefixCache, block_manager: Any) -> None:
        self.cache = cache
        self.block_manager = block_manager

    def add_path(self, group: SequenceGroup) -> None:
        """Registers a new request's prompt in the tree, and the prefixes ending at its cache
        points (live node boundaries until `drop_path`)."""
        prompt = group.prompt_keys
        group.path_node = self.cache.add_path(prompt)
        group.cache_point_nodes = [self.cache.add_path(prompt[:p]) for p in group.cache_points]

    def drop_path(self, group: SequenceGroup) -> None:
        """Unregisters a request's prompt and cache points (it finished or was aborted)."""
        if group.path_node is not None:
            self.cache.drop_path(group.path_node)
            group.path_node = None
        while group.cache_point_nodes:
            self.cache.drop_path(group.cache_point_nodes.pop())

    def evict_for_blocks(self) -> bool:
        """Evicts one snapshot that holds KV blocks; False when there is none."""
        return self.cache.evict_one(need_blocks=True)

    def chunk_end(self, group: SequenceGroup, seq: Sequence, end: int) -> int:
        """Where a prefill chunk of `seq` planned to end at `end` should end instead."""
        start = seq.num_computed_tokens
        tokens = seq.key_slice(0, end)
        return self.cache.next_cut(tokens, start, end, logprobs_owed(group, seq))

    def find_hits(self, group: SequenceGroup, seqs: list[Sequence]) -> list[PrefixHit]:
        """Starts each new sequence of `group` from its deepest cached prefix; pins it."""
        hits = []
        for seq in seqs:
            if seq.num_computed_tokens:
                continue
            tokens = seq.key_slice(0, seq.num_tokens)
            snap = self.cache.match(tokens, len(tokens) - 1, logprobs_owed(group, seq))
            if snap is None:
                continue
            self.cache.pin(snap)
            self.block_manager.adopt(seq.seq_id, snap.blocks)
            seq.num_computed_tokens = snap.num_tokens
            hits.append(PrefixHit(group, seq, snap))
        return hits

    def undo_hits(self, hits: list[PrefixHit]) -> None:
        """Takes back `find_hits` (the request was not admitted after all); the caller frees
        the sequences' blocks."""
        for hit in hits:
            self.cache.unpin(hit.snapshot)
            hit.seq.num_computed_tokens = 0

    def count(self, group: SequenceGroup, seqs: list[Sequence], hits: list[PrefixHit]) -> None:
        """Counts an admitted request's queried and cached tokens (in tokens, as vLLM)."""
        cached = sum(h.snapshot.num_tokens for h in hits)
        self.cache.queries += sum(s.num_tokens for s in seqs)
        self.cache.hits += cached
        if group.num_cached_tokens is None:
            group.num_cached_tokens = cached

    def maybe_snapshot(self, group: SequenceGroup, seq: Sequence, num: int) -> Any:
        """A `PendingSnapshot` when the chunk of `num` tokens of `seq` ends where one is due
        (a node boundary of the tree or an interval multiple), else None."""
        if num == 1 and seq.num_computed_tokens > 0:  # a decode
            return None
        end = seq.num_computed_tokens + num
        tokens = seq.key_slice(0, end)
        if not self.cache.wants_snapshot(tokens, end, logprobs_owed(group, seq)):
            return None
        assert seq.slot is not None
        return self.cache.reserve(seq.seq_id, seq.slot, tokens, group, seq.index)

    def should_wait(self, group: SequenceGroup, running: list[SequenceGroup]) -> bool:
        """True when a running request is still prefilling toward a longer shared prefix
        with `group` than any snapshot holds: it will save that branch point within a few
        steps, and `group` starts from it then."""
        if len(group.seqs) != 1 or group.seqs[0].num_computed_tokens:
            return False
        tokens = group.prompt_keys
        k = logprobs_owed(group, group.seqs[0])
        snap = self.cache.match(tokens, len(tokens) - 1, k)
        have = snap.num_tokens if snap is not None else 0
        for other in running:
            seq = other.seqs[0]
            prompt = other.prompt_keys
            if seq.num_computed_tokens >= len(prompt) or seq.status.finished:
                continue
            if k is not None and (other.params.prompt_logprobs or -1) < k:
                continue  # its snapshot would not keep the prompt logprobs `group` needs
            shared = common_len(tokens, prompt)
            if shared < len(tokens) and shared - have >= MIN_WAIT_TOKENS:
                if seq.num_computed_tokens < shared:
                    return True
        return False


class NoPrefixScheduling:
    """The scheduler's prefix-cache decisions when prefix caching is off: none."""

    def add_path(self, group: SequenceGroup) -> None:
        """Nothing to register."""

    def drop_path(self, group: SequenceGroup) -> None:
        """Nothing to unregister."""

    def evict_for_blocks(self) -> bool:
        """No snapshot holds blocks."""
        return False

    def chunk_end(self, group: SequenceGroup, seq: Sequence, end: int) -> int:
        """Chunks end where the budget ends."""
        return end

    def find_hits(self, group: SequenceGroup, seqs: list[Sequence]) -> list[PrefixHit]:
        """No hits."""
        return []

    def undo_hits(self, hits: list[PrefixHit]) -> None:
        """No hits to undo."""

    def count(self, group: SequenceGroup, seqs: list[Sequence], hits: list[PrefixHit]) -> None:
        """Nothing is counted."""

    def maybe_snapshot(self, group: SequenceGroup, seq: Sequence, num: int) -> Any:
        """No snapshot is due."""
        return None

    def should_wait(self, group: SequenceGroup, running: list[SequenceGroup]) -> bool:
        """Never waits."""
        return False


def logprobs_owed(group: SequenceGroup, seq: Sequence) -> int | None:
    """The prompt-logprob count a hit of `seq` must have kept (None when none is owed)."""
    k = group.params.prompt_logprobs
    owed = group.prompt_logprobs is not None and len(group.prompt_logprobs) < len(
        group.prompt_token_ids
    )
    return k if k is not None and owed and seq.index == 0 else None
