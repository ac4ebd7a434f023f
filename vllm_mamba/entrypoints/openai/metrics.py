"""The server's Prometheus metrics, rendered in the text exposition format for `GET /metrics`.

Gauges (running and waiting requests, state slots in use) and token counters come from the
latest statistics snapshot the engine thread handed over; the time-to-first-token and
inter-token latency histograms are fed by `ServerMetrics.track`, which wraps a request's output
stream.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import AsyncIterator

from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.outputs import RequestOutput

PREFIX = "vllm_mamba:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Histogram:
    """A cumulative Prometheus histogram."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Adds one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, model_name: str) -> list[str]:
        """The exposition lines of this histogram."""
        label = f'model_name="{model_name}"'
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{{label},le="{le}"}} {total}')
        lines.append(f"{self.name}_sum{{{label}}} {self.sum}")
        lines.append(f"{self.name}_count{{{label}}} {total}")
        return lines


class ServerMetrics:
    """Everything `/metrics` reports for one engine and model name."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two consecutive outputs of a request.",
            ITL_BUCKETS,
        )
        self.finished = {"stop": 0, "length": 0, "abort": 0}

    async def track(
        self, stream: AsyncIterator[RequestOutput], arrival: float
    ) -> AsyncIterator[RequestOutput]:
        """Passes `stream` through, timing its first token and the gaps between outputs.

        Args:
            stream: a request's outputs from `AsyncLLMEngine.generate`.
            arrival: `time.monotonic()` when the request arrived.
        """
        last: float | None = None
        finished = False
        try:
            async for out in stream:
                now = time.monotonic()
                if last is None:
                    self.ttft.observe(now - arrival)
                else:
                    self.itl.observe(now - last)
                last = now
                finished = out.finished
                if finished:
                    for comp in out.outputs:
                        reason = comp.finish_reason or "abort"
                        self.finished[reason] = self.finished.get(reason, 0) + 1
                yield out
        finally:
            if not finished:
                self.finished["abort"] += 1

    def render(self) -> str:
        """The Prometheus text of every metric."""
        stats = self.engine.stats
        label = f'model_name="{self.model_name}"'
        lines: list[str] = []

        def metric(name: str, kind: str, doc: str, value: float) -> None:
            lines.extend(
                [
                    f"# HELP {PREFIX}{name} {doc}",
                    f"# TYPE {PREFIX}{name} {kind}",
                    f"{PREFIX}{name}{{{label}}} {value}",
                ]
            )

        metric("num_requests_running", "gauge", "Requests being generated.", stats.num_running)
        metric("num_requests_waiting", "gauge", "Requests waiting.", stats.num_waiting)
        metric("state_slots_used", "gauge", "State slots in use.", stats.slots_used)
        metric("state_slots_total", "gauge", "State slots in all.", stats.slots_total)
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", stats.prompt_tokens)
        metric("generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens)
        name = PREFIX + "request_success_total"
        lines += [f"# HELP {name} Finished sequences by reason.", f"# TYPE {name} counter"]
        for reason, count in self.finished.items():
            lines.append(f'{name}{{{label},finished_reason="{reason}"}} {count}')
        lines += self.ttft.render(self.model_name)
        lines += self.itl.render(self.model_name)
        return "\n".join(lines) + "\n"
