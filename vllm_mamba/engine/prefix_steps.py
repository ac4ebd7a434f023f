"""The engine's side of prefix caching, around each step.

The scheduler decides hits and where snapshots are due (`prefix_cache.PrefixCache`); the
worker's runner copies states (told to keep each sampled position's final hidden row when it is
built). This module does what lies between, on the engine thread, through the executor:

- before the forward, it fills the prompt logprobs a hit skipped: those the snapshot kept
  (cut to the request's top-k) and the next prompt token's, scored from the snapshot's saved
  final hidden row;
- after a successful forward, it registers the snapshots the runner took (a failed step
  registers none, so no half-written snapshot is ever found) and, when the step ends, unpins
  the snapshots its hits read;
- when a sequence finishes, it saves its state (prompt plus all but its last token, which was
  sampled but never run): the next chat turn starts there.

The engine calls these unconditionally: `PrefixCacheSteps` with prefix caching on,
`NoPrefixSteps` (no-ops, no counters) when it is off.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.engine.output_processor import OutputProcessor
from vllm_mamba.engine.prefix_cache import PrefixCache, Snapshot
from vllm_mamba.engine.scheduler import SchedulerOutput
from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.executor.base import Executor
from vllm_mamba.outputs import PositionLogprobs

__all__ = ["PrefixCacheSteps", "NoPrefixSteps"]


class PrefixCacheSteps:
    """Prefix-cache work of the engine's steps (see the module docstring)."""

    def __init__(self, cache: PrefixCache, executor: Executor, outputs: OutputProcessor) -> None:
        self.cache = cache
        self.executor = executor
        self.outputs = outputs

    @property
    def queries(self) -> int:
        """Prompt tokens looked up in the cache (vLLM's counter)."""
        return self.cache.queries

    @property
    def hits(self) -> int:
        """Prompt tokens found in the cache."""
        return self.cache.hits

    def reset(self) -> None:
        """Forgets every snapshot and zeroes the counters (after the warm-up)."""
        self.cache.clear()
        self.cache.queries = self.cache.hits = 0

    def before_forward(self, step: SchedulerOutput) -> None:
        """Fills the prompt logprobs of the step's hits."""
        for hit in step.hits:
            self._hit_prompt_logprobs(hit.group, hit.seq, hit.snapshot)

    def after_forward(self, step: SchedulerOutput) -> None:
        """Registers the snapshots the runner took in this step's forward."""
        while step.snapshots:
            pending = step.snapshots.pop(0)
            group = pending.group
            lps = group.prompt_logprobs if pending.index == 0 else None
            self.cache.commit(pending, lps, group.params.prompt_logprobs or 0)

    def end_step(self, step: SchedulerOutput, failed: bool) -> None:
        """Unpins the hits' snapshots; after a failed step, drops its reserved snapshots."""
        if failed:
            for pending in step.snapshots:
                self.cache.discard(pending)
            step.snapshots = []
        for hit in step.hits:
            self.cache.unpin(hit.snapshot)

    def on_finished(self, group: SequenceGroup, seq: Sequence, hidden: Any) -> None:
        """Saves a finished sequence's state unless that prefix is saved already.

        Args:
            hidden: the sequence's last final hidden row `(H,)` (of its sampled position),
                or None.
        """
        if seq.slot is None or seq.num_computed_tokens < 1:
            return
        tokens = seq.token_slice(0, seq.num_computed_tokens)
        if self.cache.has_snapshot(tokens):
            return
        pending = self.cache.reserve(seq.seq_id, seq.slot, tokens, group, seq.index)
        if pending is None:
            return
        pending.hidden = hidden.clone() if hidden is not None else None
        self.executor.copy_states([seq.slot], [pending.slot])
        lps = group.prompt_logprobs if seq.index == 0 else None
        self.cache.commit(pending, lps, group.params.prompt_logprobs or 0)

    def _hit_prompt_logprobs(self, group: SequenceGroup, seq: Sequence, snap: Snapshot) -> None:
        k = group.params.prompt_logprobs
        if k is None or seq.index != 0 or group.prompt_logprobs is None:
            return
        depth, prompt = snap.num_tokens, group.prompt_token_ids
        if len(group.prompt_logprobs) > depth:  # already scored (a preempted request)
            return
        assert snap.prompt_logprobs is not None  # `match` only returns such snapshots
        first = len(group.prompt_logprobs)  # the first token position still owed
        kept = snap.prompt_logprobs[first - 1 :]  # entries of tokens first .. depth - 1
        group.prompt_logprobs.extend(
            _trim_top(entry, k, prompt[first + i]) for i, entry in enumerate(kept)
        )
        chunk = self.executor.prompt_logprob_from_hidden(snap.hidden, prompt[depth], k, depth)
        self.outputs.append_prompt_logprobs(group, chunk)


class NoPrefixSteps:
    """The engine's prefix-cache work when prefix caching is off: none."""

    queries = 0
    hits = 0

    def reset(self) -> None:
        """Nothing to forget."""

    def before_forward(self, step: SchedulerOutput) -> None:
        """No hits to fill."""

    def after_forward(self, step: SchedulerOutput) -> None:
        """No snapshots to register."""

    def end_step(self, step: SchedulerOutput, failed: bool) -> None:
        """Nothing pinned."""

    def on_finished(self, group: SequenceGroup, seq: Sequence, hidden: Any) -> None:
        """Nothing saved."""


def _trim_top(entry: PositionLogprobs, k: int, target: int) -> PositionLogprobs:
    """A prompt-logprob entry kept with a larger top-k, cut to the request's `k`."""
    return {t: lp for t, lp in entry.items() if lp.rank <= k or t == target}
