"""The parallel test run's own setup (`tests/conftest.py`): each xdist worker's CPU share, and
which tests stay together on one worker."""

from __future__ import annotations

import os

import pytest

from tests.conftest import worker_cpus


@pytest.mark.parametrize("ncpus", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_worker_shares_are_disjoint_and_cover_the_cpus(ncpus: int, workers: int) -> None:
    cpus = [c * 2 + 1 for c in range(ncpus)]  # any ids, not 0..n-1
    shares = [worker_cpus(cpus, w, workers) for w in range(workers)]
    assert all(shares), shares  # every worker gets at least one CPU
    assert all(set(s) <= set(cpus) for s in shares)
    if workers <= ncpus:
        flat = [c for s in shares for c in s]
        assert sorted(flat) == cpus  # disjoint, and none left over
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:  # more workers than CPUs: one CPU each, round robin
        assert [s[0] for s in shares] == [cpus[w % ncpus] for w in range(workers)]


def test_this_worker_runs_on_its_share() -> None:
    """Under xdist the worker's affinity is its share (and torch's pool is sized to it)."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    mask = sorted(os.sched_getaffinity(0))
    if workers > 1:
        assert len(mask) <= max(1, -(-(os.cpu_count() or 1) // workers))
    assert torch.get_num_threads() <= len(mask) or workers <= 1


def test_tests_without_module_fixtures_are_not_grouped(request: pytest.FixtureRequest) -> None:
    """A test without module-scoped fixtures is not grouped (it may run on any worker)."""
    assert request.node.get_closest_marker("xdist_group") is None


@pytest.fixture(scope="module")
def shared_by_the_module() -> int:
    return 1


def test_module_fixture_users_are_grouped_by_module(
    request: pytest.FixtureRequest, shared_by_the_module: int
) -> None:
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args == ("tests/test_parallel_setup.py",)
