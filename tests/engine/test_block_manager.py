"""The KV block manager: tables grow by block, forks share by reference count, the first write
into a shared block copies it, and every block returns to the pool."""

from __future__ import annotations

import random

import pytest

from vllm_mamba.engine.block_manager import BlockManager, PlaceholderBlockManager, blocks_for


def test_tables_grow_by_block_and_free_returns_everything() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, 0, 5)  # a prefill chunk of 5 tokens: 2 blocks
    assert len(bm.block_table(0)) == 2 and bm.num_free_blocks == 6
    bm.allocate(0, 5, 3)  # up to 8 tokens: still 2 blocks
    assert len(bm.block_table(0)) == 2
    bm.allocate(0, 8, 1)  # the 9th token opens a third block
    assert len(bm.block_table(0)) == 3
    assert len(set(bm.block_table(0))) == 3
    bm.free(0)
    assert bm.num_free_blocks == 8 and bm.block_table(0) == [] and bm.usage() == 0.0


def test_fork_shares_blocks_and_copies_the_partial_one_on_write() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate(0, 0, 10)  # 2 full blocks and a partial one (2 of 4 tokens)
    parent = list(bm.block_table(0))
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.block_table(1) == bm.block_table(2) == parent
    assert [bm.ref_count(b) for b in parent] == [3, 3, 3] and bm.num_used_blocks == 3
    # Each sequence writes position 10 (the partial block): the first two copy it.
    assert bm.blocks_needed([(s, 10, 1) for s in (0, 1, 2)]) == 2
    for seq in (1, 2, 0):
        bm.allocate(seq, 10, 1)
    copies = bm.take_copies()
    assert [src for src, _ in copies] == [parent[2], parent[2]]
    assert bm.block_table(0) == parent  # the last writer keeps the original
    assert {bm.block_table(s)[2] for s in (0, 1, 2)} == {parent[2], *(d for _, d in copies)}
    assert [bm.ref_count(b) for b in parent[:2]] == [3, 3] and bm.ref_count(parent[2]) == 1
    assert bm.num_used_blocks == 5 and bm.take_copies() == []
    for seq in (0, 1, 2):
        bm.free(seq)
    assert bm.num_free_blocks == 16


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, 0, 8)
    bm.fork(0, 1)
    assert bm.blocks_needed([(0, 8, 1), (1, 8, 1)]) == 2  # one new block each
    bm.allocate(0, 8, 1)
    bm.allocate(1, 8, 1)
    assert bm.take_copies() == [] and bm.num_used_blocks == 4


def test_blocks_needed_is_exact_and_exhaustion_is_an_error() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=3)
    lens = {}
    for seq in range(6):
        n = rng.randint(1, 9)
        assert bm.blocks_needed([(seq, 0, n)]) == blocks_for(n, 3)
        bm.allocate(seq, 0, n)
        lens[seq] = n
    for _ in range(30):
        seq = rng.randrange(6)
        n = rng.randint(1, 4)
        free = bm.num_free_blocks
        need = bm.blocks_needed([(seq, lens[seq], n)])
        if need > free:
            assert not bm.can_allocate([(seq, lens[seq], n)])
            with pytest.raises(RuntimeError, match="no free KV block"):
                bm.allocate(seq, lens[seq], n)
            break
        bm.allocate(seq, lens[seq], n)
        lens[seq] += n
        assert free - bm.num_free_blocks == need
        assert len(bm.block_table(seq)) == blocks_for(lens[seq], 3)


def test_placeholder_never_limits() -> None:
    bm = PlaceholderBlockManager()
    assert bm.can_allocate([(0, 0, 10**9)]) and bm.num_used_blocks == 0
    bm.allocate(0, 0, 10)
    assert bm.block_table(0) == [] and bm.take_copies() == []


def _held_sliding(bm: BlockManager, seq: int, group: int) -> list[int]:
    """The logical blocks of `group` that `seq` still holds."""
    table = bm.block_table(seq)
    return [i for i in range(len(table) // bm.num_groups) if table[i * bm.num_groups + group] >= 0]


@pytest.mark.parametrize(("windows", "block_size"), [((None, 6), 4), ((5,), 2), ((9, None, 9), 4)])
def test_sliding_groups_hold_only_what_the_window_reads(
    windows: tuple[int | None, ...], block_size: int
) -> None:
    """Decoding token by token (and a chunk in between): a full group keeps every block; a
    sliding group keeps every block a query from the next token on reads and at most the
    window plus the chunk's worth; `blocks_needed` equals what each allocation takes."""
    bm = BlockManager(num_blocks=200, block_size=block_size, windows=windows)
    done = 0
    for num in [3, *[1] * 30, 11, *[1] * 20]:
        free = bm.num_free_blocks
        need = bm.blocks_needed([(0, done, num)])
        bm.allocate(0, done, num)
        assert free - bm.num_free_blocks == need
        for g, window in enumerate(windows):
            held = _held_sliding(bm, 0, g)
            reads = range(max(done - (window or done + 1) + 1, 0), done + num)
            assert {p // block_size for p in reads} <= set(held)
            if window is None:
                assert held == list(range(blocks_for(done + num, block_size)))
            else:
                assert len(held) <= (window - 1 + num) // block_size + 2
        done += num
    bm.free(0)
    assert bm.num_free_blocks == 200


def test_sliding_blocks_needed_is_exact_with_forks_and_snapshots() -> None:
    """Random prefills, decodes, forks and snapshot shares over a full and a sliding group:
    each allocation takes exactly `blocks_needed`, and everything returns to the pool."""
    rng = random.Random(1)
    bm = BlockManager(num_blocks=2000, block_size=3, windows=(None, 7))
    lens: dict[int, int] = {}
    snapshots = []
    for step in range(200):
        if len(lens) < 3 or rng.random() < 0.1:
            seq = max(lens, default=-1) + 1
            if lens and rng.random() < 0.5:
                parent = rng.choice(list(lens))
                bm.fork(parent, seq)
                lens[seq] = lens[parent]
            else:
                lens[seq] = 0
        seq = rng.choice(list(lens))
        num = rng.choice([1, 1, 2, 5, 13])
        free, need = bm.num_free_blocks, bm.blocks_needed([(seq, lens[seq], num)])
        bm.allocate(seq, lens[seq], num)
        assert free - bm.num_free_blocks == need, step
        lens[seq] += num
        if rng.random() < 0.1:
            snapshots.append(bm.share(seq, lens[seq]))
    for seq in lens:
        bm.free(seq)
    for blocks in snapshots:
        bm.release(blocks)
    assert bm.num_free_blocks == 2000


def test_snapshot_of_a_sliding_group_keeps_only_the_window() -> None:
    """A snapshot at 20 tokens (window 6, blocks of 4) keeps the blocks of positions 15-19
    and every full-group block; a sequence that adopts it continues from there."""
    bm = BlockManager(num_blocks=64, block_size=4, windows=(None, 6))
    bm.allocate(0, 0, 20)
    snap = bm.share(0, 20)
    assert [snap[i * 2] >= 0 for i in range(5)] == [True] * 5
    assert [snap[i * 2 + 1] >= 0 for i in range(5)] == [False, False, False, True, True]
    bm.free(0)
    bm.adopt(1, snap)
    bm.allocate(1, 20, 1)
    assert _held_sliding(bm, 1, 1) == [3, 4, 5] and len(bm.block_table(1)) == 12
    bm.free(1)
    bm.release(snap)
    assert bm.num_free_blocks == 64
