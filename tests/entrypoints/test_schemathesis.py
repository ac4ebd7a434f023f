"""Property-based fuzzing of every route in the server's own `/openapi.json` with
schemathesis (a bounded number of examples per route): no input may produce a 5xx, and the
engine must still serve a greedy request identically afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.entrypoints.conftest import RunningServer, launch_server

MAX_EXAMPLES = 25
GREEDY = {"prompt": "def main():", "max_tokens": 8, "temperature": 0}


@pytest.fixture(autouse=True)
def subnormal_floats() -> None:
    """Hypothesis needs IEEE subnormal floats; an engine created earlier in this process
    flushed them to zero on this thread (see `flush_denormals`)."""
    torch.set_flush_denormal(False)


@pytest.fixture(scope="module")
def fuzzed_server() -> Iterator[RunningServer]:
    """A server with short generations (a fuzzed `max_tokens` stays cheap)."""
    with launch_server("--max-model-len", "48", "--max-num-seqs", "16") as running:
        yield running


@pytest.fixture(scope="module")
def reference(fuzzed_server: RunningServer) -> str:
    """The greedy text of `GREEDY` before any fuzzing."""
    url = f"{fuzzed_server.url}/v1/completions"
    response = httpx.post(url, json=GREEDY, headers=fuzzed_server.headers, timeout=60)
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: RunningServer, reference: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_input_is_a_server_error(case: schemathesis.Case, fuzzed_server: RunningServer) -> None:
    case.call_and_validate(
        base_url=fuzzed_server.url,
        headers=fuzzed_server.headers,
        checks=[not_a_server_error],
        timeout=60,
    )


def test_engine_unchanged_after_fuzzing(fuzzed_server: RunningServer, reference: str) -> None:
    assert httpx.get(f"{fuzzed_server.url}/health", timeout=5).status_code == 200
    url = f"{fuzzed_server.url}/v1/completions"
    response = httpx.post(url, json=GREEDY, headers=fuzzed_server.headers, timeout=60)
    assert response.json()["choices"][0]["text"] == reference
