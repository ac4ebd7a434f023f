"""Fixtures shared by every test module (vLLM's `hf_runner` / `vllm_runner` pattern).

- `hf_runner`: the `HfRunner` class; `hf_runner(model_dir)` loads the transformers reference.
- `vllm_runner`: the `VllmRunner` class; `with vllm_runner(model_dir, **engine_kwargs) as
  runner:` gives a fresh engine and checks, on a clean exit, that it drained.
- `example_token_prompts`: the eight token-id prompts (1 to 131 tokens) of the comparisons.

Tests marked `cuda` are skipped on a machine without an NVIDIA GPU. Tests marked
`whole_machine` (timing, thread counts, soak, several processes of threads) need every CPU of
the machine: `make test` runs them after the parallel part, one at a time.

Under pytest-xdist (`-n N`) each worker process is pinned to its own share of the CPUs this
run may use (`pin_worker_cpus`), so an engine's default thread count (one per CPU of its
affinity mask) and the servers it starts (which inherit the mask) never oversubscribe the
machine: two workers of two threads each on two cores would make every kernel barrier wait
for a parked thread.

Tiny checkpoints of every family come from the one registry, `tests.tiny_models` (by name,
saved once and reused until the disk budget evicts them); the directories tests make belong to
the fixture or test that made them and go when it ends (`tests.helpers.tmp_dirs`, whose scopes
the hooks below open). The OpenAI server fixtures are in `tests/entrypoints/conftest.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import tmp_dirs
from tests.helpers.prompts import make_prompts
from tests.helpers.runners import HfRunner, VllmRunner


def worker_cpus(cpus: list[int], worker: int, workers: int) -> list[int]:
    """Worker `worker`'s share of `cpus` among `workers` workers: disjoint shares of
    `len(cpus) // workers` CPUs (the first `len(cpus) % workers` workers get one more); the
    shares wrap around when there are more workers than CPUs."""
    if workers <= 0 or not cpus:
        return list(cpus)
    if workers >= len(cpus):
        return [cpus[worker % len(cpus)]]
    base, extra = divmod(len(cpus), workers)
    start = worker * base + min(worker, extra)
    return cpus[start : start + base + (worker < extra)]


def pin_worker_cpus() -> None:
    """Pins this xdist worker (and the processes it starts) to its share of the CPUs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or workers <= 1 or not hasattr(os, "sched_setaffinity"):
        return
    share = worker_cpus(sorted(os.sched_getaffinity(0)), int(worker[2:]), workers)
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def pytest_configure(config: pytest.Config) -> None:
    """Pins xdist workers to their CPUs (see the module docstring)."""
    pin_worker_cpus()


def pytest_ignore_collect(collection_path: object, config: pytest.Config) -> bool | None:
    """`-m whole_machine` alone (`make test`'s second run) imports only the test modules that
    name the mark (every such test is marked in its own module), not all of them again."""
    path = str(collection_path)
    if config.getoption("markexpr", "") != "whole_machine" or not path.endswith(".py"):
        return None
    if not os.path.basename(path).startswith("test_"):
        return None
    with open(path, encoding="utf-8") as f:
        return "whole_machine" not in f.read()


def shares_module_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a fixture set up once per module, class or package (a server, an
    engine), which its module's other tests reuse."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        defs and defs[-1].scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the `cuda` tests without a GPU. Groups, for `--dist loadgroup`, the tests of a
    module that share a module-scoped fixture (one server or engine per module, on one
    worker); every other test is handed out alone, so a long parametrised module (the family
    suite) spreads over the workers. Runs before xdist's own hook, which reads the groups."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
        if item.get_closest_marker("xdist_group") is None and shares_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


_fixture_dirs: dict[int, list[tmp_dirs.Scope]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    """The directories a fixture's setup makes are its own (`tmp_dirs`); a fixture wider than a
    function pins the cached checkpoints it uses until it is torn down."""
    with tmp_dirs.scope(lasting=fixturedef.scope != "function") as owned:
        try:
            return (yield)
        finally:
            _fixture_dirs.setdefault(id(fixturedef), []).append(owned)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef) -> None:
    """After a fixture's own teardown: its directories go."""
    for owned in _fixture_dirs.pop(id(fixturedef), []):
        owned.release()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """The directories a test's body makes go when the body ends."""
    with tmp_dirs.scope() as owned:
        try:
            return (yield)
        finally:
            owned.release()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After each test: cached checkpoints past the disk budget go (`tmp_dirs.trim`)."""
    try:
        return (yield)
    finally:
        tmp_dirs.trim()


@pytest.fixture(scope="session")
def hf_runner() -> type[HfRunner]:
    """The transformers reference runner class."""
    return HfRunner


@pytest.fixture(scope="session")
def vllm_runner() -> type[VllmRunner]:
    """The engine runner class."""
    return VllmRunner


@pytest.fixture(scope="session")
def example_token_prompts() -> list[list[int]]:
    """Eight token-id prompts of 1 to 131 tokens, from a fixed seed."""
    return make_prompts()
