"""The server's native heap: fewer glibc malloc arenas, and free pages handed back when idle.

A server's threads (event loop, tokenizer, engine, grammar and HTTP helpers) each get their own
glibc arena by default (up to 8 per core); memory freed in one arena is reused only by its
threads, and freed pages at the top of a heap stay mapped. Under mixed traffic RSS then
creeps up per request although nothing leaks. `limit_arenas` caps the arenas (what
`MALLOC_ARENA_MAX` does, set at run time), and `trim` returns free pages to the system
(`malloc_trim`); the engine calls it when it goes idle, at most once per `TRIM_INTERVAL_S`.
`heap_in_use` reads the bytes malloc has handed out and not yet had back (glibc's `mallinfo2`,
all arenas and mmapped chunks): unlike RSS it does not move with fragmentation or with pages
kept or trimmed, so the soak test fits its growth per request. All do nothing (or return None)
where the C library is not glibc.

`freeze_startup_heap` moves the objects alive once the server is loaded (about 1.4 million:
torch, transformers, the model) out of Python's cyclic collector, as vLLM does. Each closed
HTTP connection leaves a reference cycle (asyncio's socket transport holds a bound method of
itself), collected only by a full collection; with the startup objects counted as long-lived,
one runs only after ~350,000 more objects pile up, so those cycles held RSS growing by ~350 B
per request for thousands of requests (pymalloc's arenas, outside malloc's heap in use).
Frozen, the objects a full collection walks are the server's own, and it runs often and fast.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


M_ARENA_MAX = -8
DEFAULT_ARENAS = 2
TRIM_INTERVAL_S = 1.0

_libc: ctypes.CDLL | None = None
_last_trim = 0.0


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt  # noqa: B018 - glibc only
            libc.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def limit_arenas(count: int = DEFAULT_ARENAS) -> bool:
    """Caps glibc's malloc arenas at `count`; True when it took effect."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, count))


def trim(force: bool = False) -> None:
    """Returns free heap pages to the system (at most once per `TRIM_INTERVAL_S`)."""
    global _last_trim
    libc = _glibc()
    now = time.monotonic()
    if libc is None or (not force and now - _last_trim < TRIM_INTERVAL_S):
        return
    _last_trim = now
    libc.malloc_trim(0)


def heap_in_use() -> int | None:
    """Bytes allocated by malloc and not freed (in arenas plus mmapped chunks), or None where
    `mallinfo2` is missing (not glibc, or glibc before 2.33)."""
    libc = _glibc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def freeze_startup_heap() -> None:
    """Collects the garbage of startup, then freezes every object still alive (`gc.freeze`),
    so later full collections walk only what was allocated since (see the module docstring);
    the last collection restarts the collector's count of long-lived objects from those."""
    gc.collect()
    gc.freeze()
    gc.collect()
