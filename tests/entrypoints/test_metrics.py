"""`/metrics` through `prometheus_client`'s own parser: vLLM's metric names, a served model
name with a quote escaped correctly, and values consistent with the traffic sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import RunningServer, launch_server

QUOTED_NAME = 'tiny "quoted" \\ model'
VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_success",
    "vllm:kv_cache_usage_perc",
)


@pytest.fixture(scope="module")
def quoted_server() -> Iterator[RunningServer]:
    with launch_server("--served-model-name", QUOTED_NAME) as running:
        yield running


def scrape(server: RunningServer) -> dict[str, list]:
    """Samples by metric family name, parsed by prometheus_client."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_metrics_parse_and_match_the_traffic(quoted_server: RunningServer) -> None:
    server = quoted_server
    before = scrape(server)
    assert set(VLLM_NAMES) <= set(before), set(VLLM_NAMES) - set(before)
    url = f"{server.url}/v1/completions"
    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    for prompt in prompts:
        body = {"model": QUOTED_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0}
        response = httpx.post(url, json=body, headers=server.headers, timeout=60)
        assert response.status_code == 200, response.text
    after = scrape(server)
    for family in after.values():
        for sample in family:
            if "model_name" in sample.labels:
                assert sample.labels["model_name"] == QUOTED_NAME

    def delta(family: str, sample: str, **labels: str) -> float:
        return value(after[family], sample, **labels) - value(
            before.get(family, []), sample, **labels
        )

    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 9
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 15
    success = delta("vllm:request_success", "vllm:request_success_total", finished_reason="length")
    assert success == 3  # requests, not sequences
    assert delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 9
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 15
    assert delta("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 3
    assert value(after["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert value(after["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == 0
