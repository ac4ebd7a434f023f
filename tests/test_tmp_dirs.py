"""The test session's directories (`tests.helpers.tmp_dirs`): owned by the scope that made
them, cached checkpoints evicted least recently used past the budget unless a wider fixture or
import time holds them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.helpers import tmp_dirs


@pytest.fixture(autouse=True)
def _own_cache() -> Iterator[None]:
    """Each test sees only its own cache entries (a worker's cache holds the suite's tiny
    checkpoints too, which `trim` would weigh against these); they go afterwards."""
    others = dict(tmp_dirs._entries)
    tmp_dirs._entries.clear()
    yield
    for entry in tmp_dirs._entries.values():
        for path in entry.dirs:
            shutil.rmtree(path, ignore_errors=True)
    tmp_dirs._entries.clear()
    tmp_dirs._entries.update(others)


def _write(path: str, n: int) -> str:
    with open(os.path.join(path, "blob"), "wb") as f:
        f.write(b"x" * n)
    return path


@tmp_dirs.session_cache
def _cached(name: str, n: int = 1000) -> str:
    return _write(tmp_dirs.make_tmp_dir(f"cached-{name}-"), n)


def test_a_scope_owns_its_directories() -> None:
    with tmp_dirs.scope() as owned:
        path = tmp_dirs.make_tmp_dir("owned-")
    assert os.path.isdir(path)
    owned.release()
    assert not os.path.exists(path)


def test_cached_directories_are_evicted_least_used_then_least_recently_used() -> None:
    with tmp_dirs.scope() as test:
        a, b, c = _cached("a"), _cached("b"), _cached("c")
        assert _cached("a") == a and _cached("c") == c  # hits: b is the least used
    test.release()
    assert all(os.path.isdir(p) for p in (a, b, c))  # the cache owns them, not the test
    tmp_dirs.trim(budget=sum(e.bytes for e in tmp_dirs._entries.values()) - 1)
    assert not os.path.exists(b) and os.path.isdir(a) and os.path.isdir(c)
    with tmp_dirs.scope():
        again = _cached("b")  # made again after its eviction
    assert again != b and os.path.isdir(again)


def test_an_entry_a_module_fixture_used_stays_until_it_is_torn_down() -> None:
    with tmp_dirs.scope(lasting=True) as fixture:
        held = _cached("held", 10**5)
    with tmp_dirs.scope():
        other = _cached("other", 10**5)
    tmp_dirs.trim(budget=0)
    assert os.path.isdir(held) and not os.path.exists(other)
    fixture.release()
    tmp_dirs.trim(budget=0)
    assert not os.path.exists(held)


def test_entries_made_at_import_time_or_inside_another_stay() -> None:
    @tmp_dirs.session_cache
    def outer() -> tuple[str, str]:
        return _cached("inner"), tmp_dirs.make_tmp_dir("outer-")

    open_scopes = list(tmp_dirs._scopes)  # this test's own, opened by conftest
    tmp_dirs._scopes.clear()  # none open: as at collection
    try:
        at_import = _cached("import")
    finally:
        tmp_dirs._scopes[:] = open_scopes
    with tmp_dirs.scope():
        inner, own = outer()
    tmp_dirs.trim(budget=0)
    assert os.path.isdir(at_import) and os.path.isdir(inner)
    assert not os.path.exists(own)  # the outer entry itself was not held
