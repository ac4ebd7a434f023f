"""Directories of the test session (tiny checkpoints, GGUF files), removed as soon as nothing
can use them any more, so that a full run's disk use stays small (CI failed with "No space left
on device" when every saved model lived until the session's end: ~6 GB on two workers).

Everything goes under one root directory per pytest process, which an `atexit` handler of that
process deletes (forked workers, which end by `os._exit`, never run it, and the handler checks
the pid besides). Within it, each directory belongs to where `make_tmp_dir` was called
(`tests/conftest.py` opens the scopes):

- in a fixture's setup: that fixture; the directory goes when the fixture is torn down (a
  module-scoped fixture's at the end of its module);
- in a test's call: that test; the directory goes when the call ends;
- in a `session_cache`d function (a tiny checkpoint saved once, reused by many tests): that
  cache entry. After each test, `trim` deletes the least used entries until the cache's
  directories take at most `VLLM_MAMBA_TEST_TMP_BUDGET_MB` (default 768); a later call saves
  the checkpoint again (the builders are seeded, so it is the same). An entry used during the
  setup of a fixture wider than a function (which may keep the path for its module) is kept
  until that fixture is torn down; one used at import time or while another entry was being
  made is kept for the session;
- anywhere else: the session.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

BUDGET_BYTES = int(os.environ.get("VLLM_MAMBA_TEST_TMP_BUDGET_MB", "768")) * 2**20


def _remove(root: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(root, ignore_errors=True)


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="vllm-mamba-tests-")
    atexit.register(_remove, root, os.getpid())
    return root


@dataclass
class Scope:
    """Where directories are being made: a fixture's setup, a test's call, or a cache entry's
    computation. `lasting`: a fixture wider than a function (its paths may outlive a test)."""

    lasting: bool = False
    computing: bool = False  # a cache entry being computed
    dirs: list[str] = field(default_factory=list)
    pinned: list[Entry] = field(default_factory=list)

    def release(self) -> None:
        """Deletes this scope's directories and unpins the cache entries it used."""
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        self.dirs.clear()
        for entry in self.pinned:
            entry.pins -= 1
        self.pinned.clear()


@dataclass
class Entry:
    """A `session_cache` result and the directories made while computing it."""

    value: Any
    dirs: list[str]
    pins: int = 0
    uses: int = 0
    last_use: int = 0
    bytes: int = 0  # of `dirs` when made


_scopes: list[Scope] = []  # innermost last; empty: the session
_entries: dict[tuple, Entry] = {}
_clock = itertools.count(1)


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def make_tmp_dir(prefix: str) -> str:
    """A new empty directory named `prefix...` under the session's root, owned by the innermost
    scope (see the module docstring)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=_root())
    if _scopes:
        _scopes[-1].dirs.append(path)
    return path


@contextmanager
def scope(lasting: bool = False, computing: bool = False) -> Iterator[Scope]:
    """Opens a scope that owns the directories made inside it; the caller releases it."""
    s = Scope(lasting=lasting, computing=computing)
    _scopes.append(s)
    try:
        yield s
    finally:
        _scopes.remove(s)


def session_cache(fn: F | None = None, *, evict: bool = True) -> Any:
    """`functools.cache` whose entries own the directories made while computing them, and may
    be evicted by `trim` when nothing can still hold their paths (`evict=False`: results too
    slow to make again, kept for the session)."""
    if fn is None:
        return functools.partial(session_cache, evict=evict)

    @functools.wraps(fn)
    def cached(*args: Any, **kwargs: Any) -> Any:
        key = (fn.__module__, fn.__qualname__, args, tuple(sorted(kwargs.items())))
        entry = _entries.get(key)
        if entry is None:
            with scope(computing=True) as made:
                value = fn(*args, **kwargs)
            size = sum(_dir_bytes(d) for d in made.dirs)

            entry = Entry(value, list(made.dirs), pins=0 if evict else 1, bytes=size)
            _entries[key] = entry
            made.dirs.clear()
        entry.uses += 1
        entry.last_use = next(_clock)
        holder = next((s for s in reversed(_scopes) if s.lasting), None)
        if not _scopes or any(s.computing for s in _scopes):
            entry.pins += 1  # import time, or inside another entry: kept for the session
        elif holder is not None:
            entry.pins += 1
            holder.pinned.append(entry)
        return entry.value

    return cached  # type: ignore[return-value]


def trim(budget: int = BUDGET_BYTES) -> None:
    """Deletes unpinned cache entries, the least used first (then the least recently used),
    until the cached directories take at most `budget` bytes (called after each test). Least
    used first: the family suite's parametrised tests cycle through every variant, which a
    least-recently-used order alone would make every one of them save again."""
    total = sum(entry.bytes for entry in _entries.values())
    for key, entry in sorted(_entries.items(), key=lambda kv: (kv[1].uses, kv[1].last_use)):
        if total <= budget:
            break
        if entry.pins > 0:
            continue
        for path in entry.dirs:
            shutil.rmtree(path, ignore_errors=True)
        total -= entry.bytes
        del _entries[key]
