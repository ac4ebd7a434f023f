"""`vllm_mamba.engine.native_memory.heap_in_use`: the bytes malloc has handed out follow a
native allocation and its free (the soak test's measure of growth); `freeze_startup_heap`:
reference cycles left behind after startup are collected while they are few, although the
startup heap is large."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from vllm_mamba.engine import native_memory

SIZE = 8 << 20


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
def test_heap_in_use_follows_an_allocation() -> None:
    before = native_memory.heap_in_use()
    if before is None:
        pytest.skip("glibc without mallinfo2 (before 2.33)")
    buffer = bytearray(SIZE)  # one malloc of SIZE bytes
    during = native_memory.heap_in_use()
    del buffer
    after = native_memory.heap_in_use()
    assert during - before >= SIZE
    assert during - after >= SIZE


# A process with a large startup heap (as torch's and the model's) then opens and closes
# "connections", each a reference cycle (as an asyncio transport is) open long enough to reach
# the oldest generation; prints the most cycles ever closed but not yet collected.
CYCLES = 120_000
CYCLES_SCRIPT = f"""
import collections, gc, sys, weakref
from vllm_mamba.engine.native_memory import freeze_startup_heap

startup = [[i] for i in range(1_000_000)]
gc.collect()
if sys.argv[1] == "freeze":
    freeze_startup_heap()
collected = 0

def gone(_):
    global collected
    collected += 1

class Connection:
    pass

refs, open_, peak = [], collections.deque(), 0
for i in range({CYCLES}):
    conn = Connection()
    conn.me = conn
    refs.append(weakref.ref(conn, gone))
    open_.append(conn)
    if len(open_) > 5_000:
        open_.popleft()
    peak = max(peak, i + 1 - len(open_) - collected)
print(peak)
"""


def test_cycles_after_a_frozen_startup_heap_are_collected_while_few() -> None:
    """Without the freeze no full collection runs before ~250,000 more objects outlive the
    young generations (a quarter of the startup heap): every closed cycle here would still
    be uncollected (115,000); frozen, full collections keep them to under half."""
    done = subprocess.run(
        [sys.executable, "-c", CYCLES_SCRIPT, "freeze"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < CYCLES // 2
