"""Engine statistics: the counters the engine keeps, the snapshot it hands to other threads,
and the periodic statistics line logged while the engine is busy (like vLLM's).

The engine thread owns `EngineCounters` and, after every step, publishes a frozen
`StatsSnapshot`; readers on other threads (`/metrics`, the log line) only ever see snapshots,
never the scheduler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("vllm_mamba.engine")

LOG_INTERVAL_S = 5.0


@dataclass
class EngineCounters:
    """Monotonic counters, written by the engine thread only."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    failed_requests: int = 0
    preemptions: int = 0


@dataclass(frozen=True)
class StatsSnapshot:
    """The engine's state after one step, safe to read from any thread."""

    time: float
    num_running: int
    num_waiting: int
    slots_used: int
    slots_total: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    failed_requests: int
    preemptions: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0  # 0 for attention-free models (no KV cache)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there
    spec_enabled: bool = False  # speculative decoding (the spec_* counters below)
    spec_num_drafts: int = 0  # chains verified
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # drafts accepted at each chain position


class StatLogger:
    """Logs throughput and queue lengths every `interval` seconds while there is activity."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: StatsSnapshot | None = None

    def maybe_log(self, snap: StatsSnapshot) -> bool:
        """Logs one line when `interval` has passed since the last; returns True if it did."""
        last = self._last
        if last is None:
            self._last = snap
            return False
        elapsed = snap.time - last.time
        if elapsed < self.interval:
            return False
        self._last = snap
        busy = snap.steps != last.steps or snap.num_running or snap.num_waiting
        if not busy:
            return False
        kv = ""
        if snap.kv_blocks_total:
            kv = (
                f", KV cache: {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks "
                f"({100.0 * snap.kv_blocks_used / snap.kv_blocks_total:.1f}%), "
                f"Preemptions: {snap.preemptions}"
            )
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, State slots: %d/%d (%.1f%%)%s",
            (snap.prompt_tokens - last.prompt_tokens) / elapsed,
            (snap.generation_tokens - last.generation_tokens) / elapsed,
            snap.num_running,
            snap.num_waiting,
            snap.slots_used,
            snap.slots_total,
            100.0 * snap.slots_used / max(snap.slots_total, 1),
            kv,
        )
        drafts = snap.spec_num_drafts - last.spec_num_drafts
        if snap.spec_enabled and drafts:
            drafted = snap.spec_num_draft_tokens - last.spec_num_draft_tokens
            accepted = snap.spec_num_accepted_tokens - last.spec_num_accepted_tokens
            per_pos = [
                (now_ - then) / drafts
                for now_, then in zip(
                    snap.spec_accepted_per_pos,
                    last.spec_accepted_per_pos or (0,) * len(snap.spec_accepted_per_pos),
                )
            ]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance "
                "rate: %.1f%%",
                1.0 + accepted / drafts,
                accepted,
                drafted,
                ", ".join(f"{r:.3f}" for r in per_pos),
                100.0 * accepted / max(drafted, 1),
            )
        return True


def now() -> float:
    """The clock of snapshots."""
    return time.monotonic()
