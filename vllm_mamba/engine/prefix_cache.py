"""Prefix caching for state-space and hybrid models: a radix tree of state snapshots.

A Mamba layer cannot reuse part of a state: the state after token `i` exists only if it was
saved at token `i`. This module decides where states are saved and finds them again, at token
granularity (SGLang's idea, with vLLM's interface):

- `RadixTree` holds the token paths of the live requests (waiting or running) and of every
  saved snapshot; a node ends where paths diverge, where a path ends, or where a snapshot sits.
  A sequence being prefilled cuts its chunks at those node boundaries (and every
  `snapshot_interval` tokens), so a snapshot is taken exactly where another request's prompt
  branches off: a shared system prompt of any length is saved once the second request sharing
  it is seen, and every later one starts from it.
- `Snapshot` is the saved state of one prefix: the conv and SSM states of every layer in a
  snapshot slot of the state cache (`SlotLayout`'s snapshot region), for hybrids the KV blocks of
  the prefix (one reference each, shared with whoever else holds them), the final hidden row of
  the prefix's last position (so a hit can still score the next prompt token) and, when the
  request that took it asked for prompt logprobs, those of the prefix. A snapshot is written
  once, when it is taken; a hit copies it into the sequence's own slot.
- `PrefixCache` owns the tree, the snapshot slots, least-recently-used eviction within the slot
  budget (and under KV block pressure), pins (a snapshot a scheduled copy still reads cannot be
  evicted), and the query / hit counters (in tokens, as vLLM counts them).

Plain Python bookkeeping; the copies themselves run in the model runner.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_mamba.config import DEFAULT_SNAPSHOT_INTERVAL
from vllm_mamba.outputs import PositionLogprobs
from vllm_mamba.state_cache import SlotAllocator, SlotLayout

__all__ = ["PrefixCache", "RadixTree", "RadixNode", "Snapshot", "PendingSnapshot"]


class BlockRefs(Protocol):
    """What the prefix cache needs from a block manager: take and drop block references."""

    def share(self, seq_id: int, num_tokens: int) -> list[int]: ...

    def release(self, blocks: list[int]) -> None: ...


@dataclass(eq=False)
class Snapshot:
    """The saved state of the prefix `[0, num_tokens)` of the node it hangs on."""

    node: RadixNode
    slot: int
    num_tokens: int
    blocks: list[int] = field(default_factory=list)  # KV blocks of the prefix (hybrids)
    hidden: Any = None  # (H,) final hidden row of position num_tokens - 1
    prompt_logprobs: list[PositionLogprobs] | None = None  # entries of tokens 1 .. num_tokens-1
    logprobs_k: int = -1
    last_used: int = 0
    pins: int = 0


@dataclass
class PendingSnapshot:
    """A snapshot to take after this step's forward: `seq_slot`'s state into `slot`."""

    seq_id: int
    seq_slot: int
    slot: int | None  # None: the snapshot exists, only its prompt logprobs are added
    tokens: list[int]
    group: Any  # the SequenceGroup (for its prompt logprobs)
    index: int  # the sequence's index in its group (prompt logprobs belong to index 0)
    hidden: Any = None  # filled by the runner: (H,) the last row of the chunk


class RadixNode:
    """One edge of the tree: `tokens` from the parent; `depth` tokens from the root to its end."""

    __slots__ = ("tokens", "parent", "children", "snapshot", "users", "depth", "pending")

    def __init__(self, tokens: list[int], parent: RadixNode | None, depth: int) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.snapshot: Snapshot | None = None
        self.users = 0  # live requests whose path ends here
        self.depth = depth
        self.pending = False  # a snapshot of this node is being taken this step


class RadixTree:
    """Token paths, split into nodes at every divergence, path end and snapshot."""

    def __init__(self) -> None:
        self.root = RadixNode([], None, 0)

    def insert(self, tokens: list[int]) -> RadixNode:
        """The node ending exactly at `len(tokens)` along `tokens`, created (by splitting an
        edge or adding a leaf) when missing."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = RadixNode(list(tokens[pos:]), node, len(tokens))
                node.children[tokens[pos]] = leaf
                return leaf
            common = common_len(child.tokens, tokens, pos)
            if common < len(child.tokens):
                child = self._split(child, common)
            node, pos = child, pos + common
        return node

    @staticmethod
    def _split(node: RadixNode, at: int) -> RadixNode:
        """Splits `node`'s edge after `at` tokens; returns the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.tokens[:at], parent, node.depth - len(node.tokens) + at)
        parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[at:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def path(self, tokens: list[int], limit: int | None = None) -> list[RadixNode]:
        """The nodes whose whole edge lies on `tokens[:limit]`, root excluded, shallow first."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        nodes: list[RadixNode] = []
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None or child.depth > limit:
                break
            if common_len(child.tokens, tokens, pos) < len(child.tokens):
                break
            nodes.append(child)
            node, pos = child, child.depth
        return nodes

    def prune(self, node: RadixNode) -> None:
        """Removes `node` and its ancestors while they hold nothing (no snapshot, no live path
        end, no children), and merges a remaining single-child node without any into its child."""
        while node.parent is not None and not node.children:
            if node.snapshot is not None or node.users or node.pending:
                return
            parent = node.parent
            del parent.children[node.tokens[0]]
            node = parent
        if (
            node.parent is not None
            and len(node.children) == 1
            and node.snapshot is None
            and not node.users
            and not node.pending
        ):
            (child,) = node.children.values()
            child.tokens = node.tokens + child.tokens
            child.parent = node.parent
            node.parent.children[child.tokens[0]] = child


def _due(node: RadixNode, logprobs_k: int | None) -> bool:
    """True when a snapshot should be taken at `node`: it has none (and none is being taken),
    or a request owing prompt logprobs passes a snapshot that kept fewer."""
    if node.pending:
        return False
    snap = node.snapshot
    if snap is None:
        return True
    return logprobs_k is not None and (snap.prompt_logprobs is None or snap.logprobs_k < logprobs_k)


def common_len(edge: list[int], tokens: list[int], pos: int = 0) -> int:
    """How many tokens of `edge` equal `tokens[pos:]`, from the start."""
    n = min(len(edge), len(tokens) - pos)
    i = 0
    while i < n and edge[i] == tokens[pos + i]:
        i += 1
    return i


class PrefixCache:
    """The radix tree, the snapshot slots and their eviction.

    Args:
        layout: the state cache's slots; the snapshots take its snapshot region (sized to the
            memory budget divided by one slot's bytes).
        blocks: the KV block manager of a hybrid model, None for attention-free models.
        snapshot_interval: long prompts are also saved every this many tokens.
    """

    def __init__(
        self,
        layout: SlotLayout,
        blocks: BlockRefs | None,
        snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
    ) -> None:
        self.tree = RadixTree()
        self.layout = layout
        self.slots = SlotAllocator(layout.num_snapshots)
        self.first_slot = layout.snapshot_base
        self.blocks = blocks
        self.snapshot_interval = snapshot_interval
        self._clock = itertools.count(1)
        self._snapshots: set[Snapshot] = set()
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of which found in the cache (vLLM's prefix_cache_hits)
        self.evictions = 0

    # ----- live paths -------------------------------------------------------------------
    def add_path(self, tokens: list[int]) -> RadixNode:
        """Registers a live request's prompt: its path splits the tree where it diverges."""
        node = self.tree.insert(tokens)
        node.users += 1
        return node

    def drop_path(self, node: RadixNode) -> None:
        """Unregisters a live path (its request finished or was aborted)."""
        node.users -= 1
        self.tree.prune(node)

    # ----- lookups ------------------------------------------------------------------------
    def match(
        self, tokens: list[int], limit: int, logprobs_k: int | None = None
    ) -> Snapshot | None:
        """The deepest snapshot of a prefix of `tokens` with at most `limit` tokens; with
        `logprobs_k`, only snapshots that kept prompt logprobs of at least that many top
        tokens."""
        best = None
        for node in self.tree.path(tokens, limit):
            snap = node.snapshot
            if snap is None:
                continue
            if logprobs_k is not None and (
                snap.prompt_logprobs is None or snap.logprobs_k < logprobs_k or snap.hidden is None
            ):
                continue
            best = snap
        return best

    def next_cut(
        self, tokens: list[int], start: int, end: int, logprobs_k: int | None = None
    ) -> int:
        """Where a chunk of `tokens` from `start` should end at the latest (`<= end`): the first
        node boundary after `start` that is due a snapshot (see `_due`), or the next multiple of
        the interval."""
        cut = end
        interval = self.snapshot_interval
        if interval > 0:
            cut = min(cut, (start // interval + 1) * interval)
        for node in self.tree.path(tokens, cut):
            if node.depth > start and _due(node, logprobs_k):
                return node.depth
        return cut

    def wants_snapshot(self, tokens: list[int], depth: int, logprobs_k: int | None = None) -> bool:
        """True when a chunk of `tokens` ending at `depth` should be saved: a node boundary or
        an interval multiple that is due a snapshot."""
        if depth <= 0:
            return False
        nodes = self.tree.path(tokens, depth)
        at = nodes[-1] if nodes and nodes[-1].depth == depth else None
        if at is not None:
            return _due(at, logprobs_k)
        return self.snapshot_interval > 0 and depth % self.snapshot_interval == 0

    def touch(self, snap: Snapshot) -> None:
        """Marks `snap` as just used (least-recently-used order)."""
        snap.last_used = next(self._clock)

    # ----- taking snapshots ---------------------------------------------------------------
    def reserve(
        self, seq_id: int, seq_slot: int, tokens: list[int], group: Any, index: int
    ) -> PendingSnapshot | None:
        """A slot for a snapshot of `tokens` to take after the step (None when every slot is
        pinned); the node is marked pending so no other sequence takes it too. When the
        snapshot exists already (it lacks the prompt logprobs this request will add), no slot
        is taken."""
        node = self.tree.insert(tokens)
        slot = None
        if node.snapshot is None:
            slot = self._take_slot()
            if slot is None:
                self.tree.prune(node)
                return None
        node.pending = True
        return PendingSnapshot(seq_id, seq_slot, slot, list(tokens), group, index)

    def commit(self, pending: PendingSnapshot, prompt_logprobs: list | None, k: int) -> Snapshot:
        """Registers a snapshot whose state the runner copied (or will copy before any step
        reads it); takes its KV block references; returns it.

        Args:
            pending: from `reserve`.
            prompt_logprobs: the request's prompt logprobs so far (index = token position), or
                None when it asked for none; entries of tokens `1 .. depth - 1` are kept.
            k: the request's `prompt_logprobs` count.
        """
        node = self.tree.insert(pending.tokens)
        node.pending = False
        depth = len(pending.tokens)
        snap = node.snapshot
        if snap is None:
            assert pending.slot is not None
            blocks = self.blocks.share(pending.seq_id, depth) if self.blocks is not None else []
            snap = Snapshot(node, pending.slot, depth, blocks, pending.hidden)
            node.snapshot = snap
            self._snapshots.add(snap)
        elif pending.slot is not None:  # taken meanwhile (a finished sequence's end)
            self.slots.free(pending.slot - self.first_slot)
        if prompt_logprobs is not None and len(prompt_logprobs) >= depth and k > snap.logprobs_k:
            # The state is as taken; only what this request scored is added.
            snap.prompt_logprobs = list(prompt_logprobs[1:depth])
            snap.logprobs_k = k
            if pending.hidden is not None:
                snap.hidden = pending.hidden
        self.touch(snap)
        return snap

    def discard(self, pending: PendingSnapshot) -> None:
        """Drops a reserved snapshot whose step failed: no half-written snapshot is kept."""
        if pending.slot is not None:
            self.slots.free(pending.slot - self.first_slot)
        node = self.tree.insert(pending.tokens)
        node.pending = False
        self.tree.prune(node)

    def drop(self, snap: Snapshot) -> None:
        """Evicts `snap` if the cache still holds it (its state copy's step failed)."""
        if snap in self._snapshots:
            self._evict(snap)

    def has_snapshot(self, tokens: list[int]) -> bool:
        """True when a snapshot (taken or pending) of exactly `tokens` exists."""
        nodes = self.tree.path(tokens)
        if not nodes or nodes[-1].depth != len(tokens):
            return False
        return nodes[-1].snapshot is not None or nodes[-1].pending

    # ----- pins and eviction ----------------------------------------------------------------
    def pin(self, snap: Snapshot) -> None:
        """Keeps `snap` from eviction until `unpin` (a scheduled copy reads it)."""
        snap.pins += 1
        self.touch(snap)

    def unpin(self, snap: Snapshot) -> None:
        snap.pins -= 1

    def _take_slot(self) -> int | None:
        if self.slots.num_free == 0 and not self.evict_one():
            return None
        return self.slots.allocate() + self.first_slot

    def evict_one(self, need_blocks: bool = False) -> bool:
        """Evicts the least recently used unpinned snapshot (one holding KV blocks when
        `need_blocks`); False when none can go."""
        candidates = [s for s in self._snapshots if s.pins == 0 and (s.blocks or not need_blocks)]
        if not candidates:
            return False
        self._evict(min(candidates, key=lambda s: s.last_used))
        return True

    def _evict(self, snap: Snapshot) -> None:
        self.evictions += 1
        self._snapshots.discard(snap)
        self.slots.free(snap.slot - self.first_slot)
        if self.blocks is not None and snap.blocks:
            self.blocks.release(snap.blocks)
        snap.node.snapshot = None
        self.tree.prune(snap.node)

    def clear(self) -> None:
        """Evicts every unpinned snapshot."""
        while self.evict_one():
            pass

    @property
    def num_snapshots(self) -> int:
        """Snapshots held now."""
        return len(self._snapshots)
