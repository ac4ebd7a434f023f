"""`vllm_mamba.engine.native_memory.heap_in_use`: the bytes malloc has handed out follow a
native allocation and its free (the soak test's measure of growth)."""

from __future__ import annotations

import platform

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
