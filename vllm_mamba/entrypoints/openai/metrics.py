"""The server's Prometheus metrics, with vLLM's names, through `prometheus_client`.

Gauges and token counters come from the latest `StatsSnapshot` the engine thread handed over
(read at scrape time by a collector); the latency and length histograms and the finished
requests counter are fed by `ServerMetrics.track`, which wraps each engine request's output
stream. For an attention-free model the state slots are its whole cache, so
`vllm:kv_cache_usage_perc` reports the share of state slots in use (as do
`vllm:state_slots_used` / `vllm:state_slots_total`); for a hybrid it reports the share of KV
blocks in use (also `vllm:kv_cache_blocks_used` / `vllm:kv_cache_blocks_total`), the state
slots staying in their own gauges. `vllm:num_preemptions_total` counts preemptions;
`vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` count prompt tokens looked
up in the prefix cache and found there (0 when it is off). With speculative decoding,
`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total` (label `position`)
count the chains verified, their draft tokens and the accepted ones. `vllm:native_heap_in_use_bytes`
(glibc only) and `vllm:python_allocated_blocks` report the process's live native heap bytes
and Python objects at scrape time, for leak checks such as the soak test. Every app
has its own registry; label values are escaped by the library.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_mamba.engine import native_memory
from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineCollector(Collector):
    """Gauges and counters of the engine's latest statistics snapshot."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        if stats.kv_blocks_total:
            usage = stats.kv_blocks_used / stats.kv_blocks_total
            cache = "KV cache blocks"
        else:
            usage = stats.slots_used / max(stats.slots_total, 1)
            cache = "state slots"
        gauges = [
            ("vllm:num_requests_running", "Requests being generated.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:state_slots_used", "State slots in use.", stats.slots_used),
            ("vllm:state_slots_total", "State slots in all.", stats.slots_total),
            ("vllm:kv_cache_usage_perc", f"Share of the cache ({cache}) in use.", usage),
        ]
        if stats.kv_blocks_total:
            gauges += [
                ("vllm:kv_cache_blocks_used", "KV cache blocks in use.", stats.kv_blocks_used),
                ("vllm:kv_cache_blocks_total", "KV cache blocks in all.", stats.kv_blocks_total),
            ]
        heap = native_memory.heap_in_use()
        if heap is not None:
            gauges.append(("vllm:native_heap_in_use_bytes", "Bytes malloc has handed out.", heap))
        blocks = sys.getallocatedblocks()
        gauges.append(("vllm:python_allocated_blocks", "Python memory blocks allocated.", blocks))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        counters = [
            ("vllm:prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens),
            ("vllm:request_failures", "Requests ended by a failed step.", stats.failed_requests),
            ("vllm:num_preemptions", "Preemptions by recompute.", stats.preemptions),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
        ]
        if stats.spec_enabled:
            counters += [
                ("vllm:spec_decode_num_drafts", "Draft chains verified.", stats.spec_num_drafts),
                (
                    "vllm:spec_decode_num_draft_tokens",
                    "Draft tokens verified.",
                    stats.spec_num_draft_tokens,
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens",
                    "Draft tokens accepted.",
                    stats.spec_num_accepted_tokens,
                ),
            ]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if stats.spec_enabled:
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each position of a chain.",
                labels=["model_name", "position"],
            )
            for pos, value in enumerate(stats.spec_accepted_per_pos):
                family.add_metric([self.model_name, str(pos)], value)
            yield family


class ServerMetrics:
    """Everything `/metrics` reports for one engine and model name."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between two outputs.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last output.",
            LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to the first step that ran the request.",
            LATENCY_BUCKETS,
        )
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", LENGTH_BUCKETS
        )
        self.generation_len = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", LENGTH_BUCKETS
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    async def track(
        self, stream: AsyncIterator[RequestOutput], arrival: float
    ) -> AsyncIterator[RequestOutput]:
        """Passes one engine request's `stream` through, observing its latencies and lengths.

        Args:
            stream: a request's outputs from `AsyncLLMEngine.generate`.
            arrival: `time.monotonic()` when the request arrived.
        """
        label = self.model_name
        last: float | None = None
        final: RequestOutput | None = None
        try:
            async for out in stream:
                now = time.monotonic()
                if last is None:
                    self.ttft.labels(label).observe(now - arrival)
                    scheduled = out.metrics.get("first_scheduled_time")
                    if scheduled is not None:
                        self.queue.labels(label).observe(max(scheduled - arrival, 0.0))
                else:
                    self.itl.labels(label).observe(now - last)
                last = now
                if out.finished:
                    final = out
                yield out
        finally:
            self._finish(final, arrival)

    def _finish(self, final: RequestOutput | None, arrival: float) -> None:
        label = self.model_name
        if final is None:
            self.success.labels(label, "abort").inc()
            return
        self.e2e.labels(label).observe(time.monotonic() - arrival)
        self.prompt_len.labels(label).observe(len(final.prompt_token_ids))
        self.generation_len.labels(label).observe(sum(len(c.token_ids) for c in final.outputs))
        reason = final.outputs[0].finish_reason if final.outputs else None
        self.success.labels(label, reason or "abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
