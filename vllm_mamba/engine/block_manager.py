"""KV block bookkeeping: which blocks of the paged pool each sequence's tokens live in.

Plain Python, no tensors. `BlockManager` serves hybrid models: a sequence's block table grows
as its tokens are scheduled (a prefill chunk, or one decode token), and its blocks return to
the pool when it finishes, is aborted or is preempted. A fork (`n > 1`) shares all of its
parent's blocks by reference count; the first write into a shared block (the partial last
prompt block) copies it first (copy-on-write), and the copies to make are handed to the
runner with the step (`take_copies`). Full prompt blocks stay shared until every sequence is
done with them.

With sliding-window layers the attention layers form several KV groups (`kv_cache.KVGroups`),
each with a block table per sequence, kept interleaved in one list (logical block `i` of
group `g` at index `i * G + g`), so a sequence's table is still one `list[int]` everywhere
(steps, forks, prefix snapshots). A sliding group's logical blocks wholly before the window of
the next token to compute are dropped (`NO_BLOCK` in the table) when the sequence allocates
its next tokens: no query reads them again (speculative rejections only shorten a sequence
back to tokens past them). A prefix snapshot keeps only the blocks its continuation reads.

`PlaceholderBlockManager` is the same interface for attention-free models: there are no
blocks, so it never limits admission and holds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NO_BLOCK", "BlockManager", "PlaceholderBlockManager", "blocks_for"]

NO_BLOCK = -1  # a table entry whose block a sliding window dropped (never read again)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that `num_tokens` tokens occupy."""
    return -(-num_tokens // block_size)


def _live(blocks: list[int]) -> list[int]:
    """The entries of `blocks` that hold a block."""
    return [b for b in blocks if b != NO_BLOCK]


class BlockManager:
    """The pool's free list, reference counts and per-sequence block tables.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        windows: per KV group, its sliding window in tokens (None: full attention).
    """

    def __init__(
        self, num_blocks: int, block_size: int, windows: tuple[int | None, ...] = (None,)
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = windows
        self.num_groups = len(windows)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._refs = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Share of the pool in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block: int) -> int:
        """Sequences holding `block`."""
        return self._refs[block]

    def block_table(self, seq_id: int) -> list[int]:
        """The blocks of sequence `seq_id`, in token order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def blocks_needed(self, work: Iterable[tuple[int, int, int]]) -> int:
        """Blocks that scheduling `work` would take from the pool, copies included.

        Args:
            work: `(seq_id, num_computed_tokens, num_new_tokens)` of each sequence.
        """
        refs: dict[int, int] = {}
        need = 0
        groups = self.num_groups
        for seq_id, start, num in work:
            table = self.block_table(seq_id)
            for index in self._passed(table, start):
                count = refs.get(table[index], self._refs[table[index]])
                refs[table[index]] = count - 1
                need -= count == 1  # dropped, back to the pool
            end = blocks_for(start + num, self.block_size) * groups
            for index in range(start // self.block_size * groups, min(len(table), end)):
                block = table[index]
                count = refs.get(block, self._refs[block])
                if count > 1:  # shared: this write copies it
                    need += 1
                    refs[block] = count - 1
            need += max(end - len(table), 0)
        return need

    def can_allocate(self, work: Iterable[tuple[int, int, int]]) -> bool:
        """True when the pool has the blocks that `work` needs (see `blocks_needed`)."""
        return self.blocks_needed(work) <= len(self._free)

    def allocate(self, seq_id: int, start: int, num: int) -> None:
        """Makes tokens `[start, start + num)` of `seq_id` writable: new blocks at the end,
        and a private copy of any shared block they write into.

        Raises:
            RuntimeError: the pool ran out (the scheduler checks `can_allocate` first).
        """
        table = self._tables.setdefault(seq_id, [])
        for index in self._passed(table, start):
            self.release([table[index]])
            table[index] = NO_BLOCK
        end = blocks_for(start + num, self.block_size) * self.num_groups
        for index in range(start // self.block_size * self.num_groups, min(len(table), end)):
            block = table[index]
            if self._refs[block] > 1:
                new = self._take()
                self._refs[block] -= 1
                self._copies.append((block, new))
                table[index] = new
        while len(table) < end:
            table.append(self._take())

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Drops the blocks past the first `num_tokens` tokens of `seq_id` (the positions of
        rejected draft tokens)."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        keep = blocks_for(num_tokens, self.block_size) * self.num_groups
        self.release(table[keep:])
        del table[keep:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (one more reference each)."""
        table = list(self.block_table(parent_id))
        for block in _live(table):
            self._refs[block] += 1
        self._tables[child_id] = table

    def free(self, seq_id: int) -> None:
        """Drops the sequence's references; blocks nobody holds return to the pool."""
        self.release(self._tables.pop(seq_id, []))

    def share(self, seq_id: int, num_tokens: int) -> list[int]:
        """One more reference to each block holding tokens `[0, num_tokens)` of `seq_id` that a
        continuation from `num_tokens` reads (a prefix-cache snapshot keeps them; a sliding
        group's blocks before that window are `NO_BLOCK`); returns the table of those."""
        table = self.block_table(seq_id)
        blocks = table[: blocks_for(num_tokens, self.block_size) * self.num_groups]
        for index in self._passed(blocks, num_tokens):
            blocks[index] = NO_BLOCK
        for block in _live(blocks):
            self._refs[block] += 1
        return blocks

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """Gives a sequence with no blocks yet a reference to `blocks` (a prefix-cache hit);
        its first write into the shared last block copies it."""
        assert not self._tables.get(seq_id), f"sequence {seq_id} already holds blocks"
        for block in _live(blocks):
            self._refs[block] += 1
        self._tables[seq_id] = list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drops one reference to each of `blocks` (`NO_BLOCK` entries skipped); those nobody
        holds return to the pool."""
        for block in _live(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """The `(src, dst)` block copies owed since the last call; the runner makes them
        before the step's forward."""
        copies, self._copies = self._copies, []
        return copies

    def _passed(self, table: list[int], start: int) -> list[int]:
        """Indices of `table` that still hold a block no query from position `start` on
        reads: a sliding group's logical blocks wholly before `start`'s window. The dropped
        entries of a group are always a prefix of its blocks, so the scan walks back from the
        window and stops at the first one (amortised O(1) per step)."""
        passed = []
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            first = max(start - window + 1, 0)  # the first position `start` reads
            index = (first // self.block_size - 1) * self.num_groups + g
            while index >= 0 and (index >= len(table) or table[index] != NO_BLOCK):
                if index < len(table):
                    passed.append(index)
                index -= self.num_groups
        return passed

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV block")
        block = self._free.pop()
        self._refs[block] = 1
        return block


class PlaceholderBlockManager:
    """The block manager of attention-free models: no blocks, never limits admission."""

    num_blocks = 0
    block_size = 0
    num_free_blocks = 0
    num_used_blocks = 0

    def usage(self) -> float:
        """Nothing is ever in use."""
        return 0.0

    def block_table(self, seq_id: int) -> list[int]:
        """No blocks."""
        return []

    def blocks_needed(self, work: Iterable[tuple[int, int, int]]) -> int:
        """Nothing is needed."""
        return 0

    def can_allocate(self, work: Iterable[tuple[int, int, int]]) -> bool:
        """Blocks never limit admission."""
        return True

    def allocate(self, seq_id: int, start: int, num: int) -> None:
        """Nothing to allocate."""

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Nothing to trim."""

    def fork(self, parent_id: int, child_id: int) -> None:
        """Nothing to share."""

    def free(self, seq_id: int) -> None:
        """Nothing to free."""

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """Nothing to share (a prefix-cache hit of an attention-free model has no blocks)."""

    def take_copies(self) -> list[tuple[int, int]]:
        """No copies."""
        return []
